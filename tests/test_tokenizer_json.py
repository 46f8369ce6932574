"""A checkpoint that ships only `tokenizer.json` (as Qwen, OLMoE, granite and gpt-oss do): ids and text are the
`tokenizers` library's (and transformers' fast tokenizer's), BOS as `tokenizer_config.json` says, streaming never
splits a UTF-8 character, and every EOS of generation_config.json stops a sequence."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe import MoEModel, SamplingParams
from moe.generation.params import with_bad_word_ids
from moe.tokenizer import HFTokenizer, IncrementalDecoder
from tests.checkpoints import ROOT, tiny_config, write_checkpoint

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
        "of a wife. Café, naïve, 東京, 😀! ") * 20


def byte_level_bpe(directory, bos: bool):
    """A byte-level BPE tokenizer.json trained here, with <s> and </s>, as Qwen-style checkpoints ship them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                                 "add_bos_token": bos}))
    return tok


@pytest.fixture(scope="module", params=[True, False], ids=["bos", "no-bos"])
def ckpt(request, tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("tokjson") / "ckpt", tiny_config(vocab_size=300))
    return path, byte_level_bpe(path, request.param), request.param


def test_ids_and_text_are_the_tokenizers_librarys(ckpt):
    path, tok, bos = ckpt
    model = MoEModel.from_pretrained(path)
    assert isinstance(model.tokenizer, HFTokenizer)
    for text in ("And God said", TEXT[:200], " leading space", "東京😀"):
        assert model.tokenizer.encode(text) == tok.encode(text).ids
        assert model.tokenizer.decode(tok.encode(text, add_special_tokens=False).ids) == text
    assert (model.tokenizer.encode("x")[0] == 1) == bos


def test_transformers_fast_tokenizer_gives_the_same_ids(ckpt):
    transformers = pytest.importorskip("transformers")
    path, _, _ = ckpt
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    ours = MoEModel.from_pretrained(path).tokenizer
    for text in ("And God said", TEXT[:300]):
        assert ours.encode(text) == theirs(text)["input_ids"]


def test_bad_words_are_tokenized_as_vllm_reads_them_into_transformers_ids(ckpt):
    """vLLM's reading of `bad_words`: each word as it reads alone, and after a space where that spells it with other
    tokens of the same count; the ids transformers' tokenizer gives them, without the BOS the checkpoint may add."""
    transformers = pytest.importorskip("transformers")
    path, _, _ = ckpt
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    words = ["truth", " a single man", "東京", "fortune,"]
    want = []
    for word in words:
        alone, spaced = (theirs.encode(t, add_special_tokens=False) for t in (word.lstrip(), " " + word.lstrip()))
        want += [tuple(alone)] + [tuple(spaced)] * (spaced[0] != alone[0] and len(spaced) == len(alone))
    got = with_bad_word_ids(SamplingParams(bad_words=words), MoEModel.from_pretrained(path).tokenizer)
    assert got.bad_words_ids == tuple(dict.fromkeys(want)) and got.bad_words == ()
    assert len(got.bad_words_ids) > len(words)  # some words are held back in both spellings


def test_a_tokenizer_json_checkpoint_generates_and_streams_whole_characters(ckpt):
    path, _, _ = ckpt
    model = MoEModel.from_pretrained(path)
    pieces: list[str] = []
    out = model.generate(["Café 東京"], max_new_tokens=24, ignore_eos=True, streamer=lambda b, p: pieces.append(p))
    # Random weights write bytes that need not form UTF-8: the stream still adds up to the text; an unfinished
    # character waits for its bytes, and at the very end comes as the replacement mark the text has too.
    assert "".join(pieces) == out[0]


def test_a_character_split_over_tokens_streams_whole(ckpt):
    path, tok, _ = ckpt
    model = MoEModel.from_pretrained(path)
    byte_tokens = [tok.token_to_id(c) for c in "ðŁĺĢ"]  # the four bytes of 😀 as ByteLevel's characters
    decoder = IncrementalDecoder(model.tokenizer, model.tokenizer.encode("x"))
    got = [decoder.push(t) for t in byte_tokens]
    assert got == ["", "", "", "😀"]


def test_special_tokens_are_text_as_transformers_decodes_them(ckpt):
    """`decode` keeps special tokens' text unless told to skip them, as transformers' fast tokenizer does; generated
    text skips them (vLLM's, llama.cpp's and transformers' pipelines' default), streamed alike."""
    transformers = pytest.importorskip("transformers")
    path, _, _ = ckpt
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    model = MoEModel.from_pretrained(path)
    ids = [1, 40, 2, 77, 3, 120, 0, 2]
    for skip in (True, False):
        assert model.tokenizer.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip)
    prompt = model.tokenizer.encode("And God said")
    sample = dict(max_new_tokens=40, temperature=30.0, ignore_eos=True)  # near-uniform: some tokens are special
    seed = next(s for s in range(50) if {0, 1, 2, 3} & set(model.generate([prompt], seed=s, **sample)[0]))
    for skip in (True, False):
        pieces: list[str] = []
        out = model.generate(["And God said"], seed=seed, skip_special_tokens=skip,
                             streamer=lambda b, p, pieces=pieces: pieces.append(p), **sample)[0]
        whole = theirs.decode(prompt + out.token_ids, skip_special_tokens=skip)
        assert out == whole[len(theirs.decode(prompt, skip_special_tokens=skip)):] == "".join(pieces)


def test_every_eos_of_generation_config_stops(tmp_path):
    path = write_checkpoint(tmp_path / "ckpt", tiny_config())
    with MoEModel.from_pretrained(path) as model:
        free = model.generate([[1, 5, 9]], max_new_tokens=12, ignore_eos=True)[0]
    stop = free[3]  # the fourth greedy token, made an end-of-sequence token
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, stop]}))
    with MoEModel.from_pretrained(path) as model:
        assert stop in model.eos_ids and 2 in model.eos_ids
        assert model.generate([[1, 5, 9]], max_new_tokens=12)[0] == free[:free.index(stop)]


def test_sampling_defaults_of_generation_config_apply_where_none_is_given(tmp_path):
    path = write_checkpoint(tmp_path / "ckpt", tiny_config())
    (path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.7, "top_k": 5}))
    with MoEModel.from_pretrained(path) as model:
        sampled = model.generate([[1, 5, 9]], max_new_tokens=8, seed=3)
        assert model.last_defaults == ["temperature", "top_k"]
        assert sampled == model.generate([[1, 5, 9]], max_new_tokens=8, seed=3, temperature=0.7, top_k=5)
        greedy = model.generate([[1, 5, 9]], max_new_tokens=8, temperature=0)
        assert model.last_defaults == ["top_k"]
        assert greedy == model.generate([[1, 5, 9]], max_new_tokens=8, temperature=0, top_k=1)


class Counting:
    """A tokenizer whose decode calls are counted by length: the windows an incremental decoder asks for."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.longest = tokenizer, 0

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens)


@pytest.mark.parametrize("skip", [True, False], ids=["skip-special", "keep-special"])
@pytest.mark.parametrize("kind", ["tokenizer.json", "sentencepiece"])
def test_a_long_stream_adds_up_to_the_tokenizers_text_in_short_windows(ckpt, kind, skip):
    """Random ids (bytes that need not form UTF-8, pieces with and without leading spaces, special tokens): the
    pieces and the final flush give the tokenizer's own decode of the whole text after the prompt, and no decode call
    ever sees more than a few tokens, however long the answer (the cost of a token does not grow with it)."""
    import random

    from moe.tokenizer import load_tokenizer

    path, _, _ = ckpt
    whole = (MoEModel.from_pretrained(path).tokenizer if kind == "tokenizer.json"
             else load_tokenizer(Path(__file__).resolve().parents[1] / "weights" / "tiny-moe-austen-bbe"))
    rng = random.Random(0)
    prompt, ids = [rng.randrange(4, 300) for _ in range(6)], [rng.randrange(0, 300) for _ in range(1500)]
    counting = Counting(whole)
    decoder = IncrementalDecoder(counting, prompt, skip)
    pieces = [decoder.push(t) for t in ids] + [decoder.flush()]
    context = prompt[-IncrementalDecoder.CONTEXT:]
    assert "".join(pieces) == whole.decode(context + ids, skip)[len(whole.decode(context, skip)):]
    assert ("<s>" in "".join(pieces)) != skip
    assert counting.longest <= 24


@pytest.mark.parametrize("how", ["save_pretrained", "convert", "shard"])
def test_a_save_carries_the_tokenizer_and_generation_files_as_they_were(ckpt, how, tmp_path):
    """`save_pretrained`, `scripts/convert.py` and `scripts/shard.py` copy the files beside the weights (the
    tokenizer.json, its config, the chat template, generation_config.json); transformers' tokenizer reads the copy
    as the original, and so does ours."""
    transformers = pytest.importorskip("transformers")
    path, _, _ = ckpt
    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(path, src)
    (src / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.7,
                                                            "eos_token_id": [2, 3]}))
    (src / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    if how == "save_pretrained":
        with MoEModel.from_pretrained(src) as model:
            model.save_pretrained(out)
    else:
        done = subprocess.run([sys.executable, str(ROOT / "scripts" / f"{how}.py"), "--ckpt", str(src), "--out",
                               str(out), "--quiet"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    theirs, before = transformers.AutoTokenizer.from_pretrained(out), transformers.AutoTokenizer.from_pretrained(src)
    messages = [{"role": "user", "content": "Café 東京"}]
    assert theirs.apply_chat_template(messages) == before.apply_chat_template(messages)
    saved = MoEModel.from_pretrained(out)
    assert saved.tokenizer.encode(TEXT[:300]) == theirs(TEXT[:300])["input_ids"]
    assert saved.generation_defaults.sampling == {"temperature": 0.7} and 3 in saved.eos_ids
