"""Sampling controls and results against outside oracles: transformers' generate and logits processors for
penalties, filters and log-probabilities; stop strings, stop ids and finish reasons on the trained model's text;
per-request seeds alone, in batches and on 2 ranks."""

from __future__ import annotations

import pytest
import torch

from moe import MoEModel, SamplingParams
from moe.generation import scoring
from tests.checkpoints import TRAINED, hf_model

PROMPTS = [[1, 17, 99, 5, 42, 7], [1, 64, 3, 12], [1, 88, 23, 51, 9, 30, 77, 4, 11]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = hf_model("mixtral")
    path = tmp_path_factory.mktemp("hf") / "ckpt"
    hf.save_pretrained(path)
    with MoEModel.from_pretrained(path) as model:
        yield hf, model


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_repetition_penalty_greedy_equals_transformers(pair, penalty):
    hf, model = pair
    got = model.generate(PROMPTS, max_new_tokens=16, temperature=0, repetition_penalty=penalty, ignore_eos=True)
    for prompt, out in zip(PROMPTS, got, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0,
                               repetition_penalty=penalty, eos_token_id=None)[0, len(prompt):].tolist()
        assert list(out) == want


def test_min_tokens_holds_back_the_end_as_transformers_min_new_tokens_does(pair):
    """Each prompt's second greedy token made a stop token: it ends the answer at once, unless min_tokens holds it
    (and end-of-sequence) back, as transformers' MinNewTokensLengthLogitsProcessor does."""
    hf, model = pair
    for prompt in PROMPTS:
        stop = list(model.generate([prompt], max_new_tokens=4, temperature=0, ignore_eos=True)[0])[1]
        assert len(model.generate([prompt], max_new_tokens=16, temperature=0, stop_token_ids=[stop])[0]) == 1
        got = model.generate([prompt], max_new_tokens=16, temperature=0, stop_token_ids=[stop], min_tokens=6)[0]
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0,
                               min_new_tokens=6, eos_token_id=[2, stop])[0, len(prompt):].tolist()
        assert list(got) == (want[:-1] if want[-1] in (2, stop) else want) and len(got) >= 6  # theirs keep the end


def test_logit_bias_greedy_equals_transformers_sequence_bias(pair):
    """A ban of each prompt's second greedy token and a push for another: the answers change, and equal transformers'
    with the same single-token `sequence_bias`, applied before its repetition penalty as ours is."""
    hf, model = pair
    for prompt in PROMPTS:
        plain = list(model.generate(prompt, max_new_tokens=12, temperature=0, ignore_eos=True)[0])
        bias = {plain[1]: -100.0, (plain[0] + 7) % 64: 4.5}
        got = model.generate(prompt, max_new_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.2,
                             logit_bias={str(i) if i % 2 else i: v for i, v in bias.items()})[0]  # JSON's keys too
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0,
                               eos_token_id=None, repetition_penalty=1.2,
                               sequence_bias={(i,): v for i, v in bias.items()})[0, len(prompt):].tolist()
        assert list(got) == want and want != plain and plain[1] not in want


def test_allowed_token_ids_equal_transformers_prefix_allowed_tokens(pair):
    """vLLM's `allowed_token_ids` against transformers' `prefix_allowed_tokens_fn` giving the same tokens each step,
    with a repetition penalty after the mask; one row allowed a few tokens, the row beside it left as it was alone."""
    hf, model = pair
    plain = [list(c) for c in model.generate(PROMPTS[:2], max_new_tokens=10, temperature=0, ignore_eos=True)]
    allowed = sorted({plain[0][1], (plain[0][0] + 5) % 64, 11, 40})
    rows = [SamplingParams(max_tokens=10, repetition_penalty=1.2, ignore_eos=True, allowed_token_ids=allowed),
            SamplingParams(max_tokens=10, ignore_eos=True)]
    got, beside = model.generate(PROMPTS[:2], rows)
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=10, do_sample=False, pad_token_id=0,
                           eos_token_id=None, repetition_penalty=1.2,
                           prefix_allowed_tokens_fn=lambda batch, ids: allowed)[0, len(PROMPTS[0]):].tolist()
    assert list(got) == want and want != plain[0] and list(beside) == plain[1]
    drawn = model.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=1.5, seed=3, allowed_token_ids=allowed,
                                                   ignore_eos=True))
    assert all(set(c.token_ids) <= set(allowed) for c in drawn)
    for bad, why in (([], "at least one token"), ([-1], "integers >= 0"), ([10**6], "outside the vocabulary")):
        with pytest.raises(ValueError, match=why):
            model.generate(PROMPTS[0], SamplingParams(allowed_token_ids=bad))


def test_truncate_prompt_tokens_reads_the_prompts_last_tokens(pair):
    """vLLM's `truncate_prompt_tokens=K`: the answer of the prompt's last K tokens (transformers' greedy answer to
    them), K counted as the prompt's length; -1 keeps up to the context; a K the context cannot hold is refused."""
    hf, model = pair
    got = model.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True, truncate_prompt_tokens=3))
    for prompt, out in zip(PROMPTS, got, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt[-3:]]), max_new_tokens=6, do_sample=False, pad_token_id=0,
                               eos_token_id=None)[0, 3:].tolist()
        assert list(out) == want and out.prompt_tokens == 3
    whole = model.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))
    kept = model.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True, truncate_prompt_tokens=-1))
    assert [list(c) for c in kept] == [list(c) for c in whole] != [list(c) for c in got]
    for bad, why in ((0, "be at least 1"), (-2, "be at least 1"), (model.config.max_seq_len + 1, "be at most"),
                     (2.5, "be an integer")):
        with pytest.raises(ValueError, match=f"truncate_prompt_tokens must {why}"):
            model.generate(PROMPTS[0], SamplingParams(truncate_prompt_tokens=bad))


def test_bad_words_ids_equal_transformers_no_bad_words(pair):
    """Words of one, two and three tokens from each prompt's greedy answer, banned: the answers change and equal
    transformers' `bad_words_ids` (whose matches may reach into the prompt, which these words' leading tokens are not
    at its end, so the two read the same); two prompts with different words in one batch, as each alone."""
    hf, model = pair
    plain = [list(c) for c in model.generate(PROMPTS, max_new_tokens=12, temperature=0, ignore_eos=True)]
    words = [[(p[2], p[3]), (p[5], p[6], p[7]), (p[9],)] for p in plain]
    assert all(prompt[-1] not in (w[0] for w in ws) for prompt, ws in zip(PROMPTS, words, strict=True))
    rows = [SamplingParams(max_tokens=12, ignore_eos=True, bad_words_ids=ws) for ws in words]
    got = model.generate(PROMPTS, rows)
    for prompt, ws, out, before in zip(PROMPTS, words, got, plain, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0,
                               eos_token_id=None, bad_words_ids=[list(w) for w in ws])[0, len(prompt):].tolist()
        assert list(out) == want != before
        assert list(model.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, bad_words_ids=ws))[0]) \
            == want
    three = model.generate(PROMPTS, [SamplingParams(max_tokens=12, ignore_eos=True, bad_words_ids=[ws[1]])
                                     for ws in words])  # the three-token word alone: held back at its third token
    assert all(list(t)[:7] == p[:7] and t.token_ids[7] != p[7] for t, p in zip(three, plain, strict=True))
    for bad, why in (([[]], "bad_words_ids must be"), ([[-1]], "bad_words_ids must be"), ([""], "bad_words must")):
        with pytest.raises(ValueError, match=why):
            SamplingParams(**{"bad_words" if why.startswith("bad_words must") else "bad_words_ids": bad})


@pytest.mark.parametrize("chunk", [512, 2])
def test_prompt_logprobs_equal_transformers_log_softmax(pair, chunk, monkeypatch):
    """Scored in chunks on a cache of the prompt's own (of 2 positions here: every boundary crossed)."""
    monkeypatch.setattr(scoring, "SCORE_CHUNK", chunk)
    hf, model = pair
    for prompt, out in zip(PROMPTS, model.generate(PROMPTS, max_new_tokens=2, prompt_logprobs=3), strict=True):
        logp = hf_logits(hf, prompt).log_softmax(-1)[:-1]
        first, *rest = out.prompt_logprobs
        assert first is None and [e.token for e in rest] == prompt[1:]
        want = logp.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        assert (torch.tensor([e.logprob for e in rest]) - want).abs().max() < 1e-4
        assert [[i for i, _ in e.top] for e in rest] == logp.topk(3).indices.tolist()


def test_presence_and_frequency_penalties_equal_a_step_by_step_reference(pair):
    hf, model = pair
    presence, frequency = 0.7, 0.4
    got = model.generate(PROMPTS, max_new_tokens=12, temperature=0, presence_penalty=presence,
                         frequency_penalty=frequency, ignore_eos=True)
    for prompt, out in zip(PROMPTS, got, strict=True):
        ids, counts = list(prompt), {}
        for _ in range(12):
            logits = hf_logits(hf, ids)[-1]
            for t, n in counts.items():  # OpenAI's definition: over the generated tokens only
                logits[t] -= frequency * n + presence
            t = int(logits.argmax())
            counts[t] = counts.get(t, 0) + 1
            ids.append(t)
        assert list(out) == ids[len(prompt):]


def test_logprobs_equal_transformers_log_softmax(pair):
    hf, model = pair
    got = model.generate(PROMPTS[:2], max_new_tokens=8, temperature=0.9, seed=4, logprobs=3, ignore_eos=True)
    for prompt, out in zip(PROMPTS[:2], got, strict=True):
        want = hf_logits(hf, prompt + out.token_ids).log_softmax(-1)[len(prompt) - 1:-1]
        assert len(out.logprobs) == len(out.token_ids) == 8
        for step, entry in enumerate(out.logprobs):
            assert entry.token == out.token_ids[step]
            assert abs(entry.logprob - want[step, entry.token].item()) < 1e-4
            top = want[step].topk(3)
            assert [i for i, _ in entry.top] == top.indices.tolist()
            assert max(abs(v - w) for (_, v), w in zip(entry.top, top.values.tolist(), strict=True)) < 1e-4


FILTERS = {"top_k": dict(top_k=3), "top_p": dict(top_p=0.5), "min_p": dict(min_p=0.3),
           "all": dict(top_k=5, top_p=0.8, min_p=0.1)}


@pytest.mark.parametrize("name", FILTERS)
def test_samples_lie_in_the_set_transformers_allows(pair, name):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    hf, model = pair
    given = FILTERS[name]
    warpers = LogitsProcessorList([TemperatureLogitsWarper(1.5)])
    warpers += [TopKLogitsWarper(given["top_k"])] if "top_k" in given else []
    warpers += [TopPLogitsWarper(given["top_p"])] if "top_p" in given else []
    warpers += [MinPLogitsWarper(given["min_p"])] if "min_p" in given else []
    kept = []
    for seed in range(4):
        out = model.generate(PROMPTS[:2], max_new_tokens=10, temperature=1.5, seed=seed, ignore_eos=True, **given)
        for prompt, o in zip(PROMPTS[:2], out, strict=True):
            ids = prompt + o.token_ids
            logits = hf_logits(hf, ids)[len(prompt) - 1:-1]
            for step, token in enumerate(o.token_ids):
                scores = warpers(torch.tensor([ids[:len(prompt) + step]]), logits[step:step + 1].clone())[0]
                assert scores[token] > float("-inf"), (seed, step, token)
                kept.append(int((scores > float("-inf")).sum()))
    assert max(kept) > 1  # the filters left a choice: the draws were tested, not forced


def test_a_seeded_request_samples_alike_alone_in_a_batch_and_on_two_ranks(pair, tmp_path):
    hf, model = pair
    a, b = PROMPTS[0], PROMPTS[2]
    kw = dict(max_new_tokens=10, temperature=1.0, top_k=20, seed=11, ignore_eos=True)
    alone = model.generate([a], **kw)[0]
    assert model.generate([a, b], **kw)[0] == alone
    assert model.generate([b, a], **kw)[1] == alone
    assert model.generate([b, a], **kw | dict(seed=[5, 11]))[1] == alone  # a seed per prompt
    hf.save_pretrained(tmp_path / "ckpt")
    with MoEModel.from_pretrained(tmp_path / "ckpt", gpus=2) as sharded:
        assert sharded.generate([b, a], **kw)[1] == alone


@pytest.fixture(scope="module")
def trained():
    with MoEModel.from_pretrained(TRAINED) as model:
        yield model


PROMPT = "It is a truth universally acknowledged, that"


def test_sampling_params_as_vllm_passes_them(trained):
    """vLLM's `generate(prompts, SamplingParams(...))`, one for all or one per prompt, and `chat`'s: used as given,
    the keywords' answers; a fresh seed where one has none; keywords beside them are refused."""
    prompts = [PROMPT, "And God said"]
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=4)
    whole = trained.generate(prompts, params)
    want = trained.generate(prompts, max_new_tokens=10, temperature=0.9, top_p=0.9, seed=4)
    assert [(str(a), a.token_ids, a.seed) for a in whole] == [(str(b), b.token_ids, b.seed) for b in want]
    each = trained.generate(prompts, sampling_params=[params, SamplingParams(max_tokens=3)])
    assert each[0].token_ids == whole[0].token_ids
    assert each[1].token_ids == trained.generate(prompts[1], max_new_tokens=3, temperature=0)[0].token_ids
    fresh = trained.generate(prompts, SamplingParams(temperature=1.0, max_tokens=6))
    again = trained.generate(prompts[1], SamplingParams(temperature=1.0, max_tokens=6, seed=fresh[1].seed))
    assert again[0].token_ids == fresh[1].token_ids and fresh[0].seed != fresh[1].seed
    messages = [{"role": "user", "content": "Emma"}]
    template = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    assert trained.chat(messages, params, chat_template=template).token_ids == \
        trained.chat(messages, max_new_tokens=10, temperature=0.9, top_p=0.9, seed=4, chat_template=template).token_ids
    for beside in (dict(temperature=0.5), dict(seed=1), dict(max_new_tokens=5)):
        with pytest.raises(ValueError, match=f"{next(iter(beside))} was given beside"):
            trained.generate(prompts, sampling_params=params, **beside)
    with pytest.raises(ValueError, match="one per prompt"):
        trained.generate(prompts, [params])


def test_a_stop_string_across_tokens_ends_the_text_before_it(trained):
    full = trained.generate([PROMPT], max_new_tokens=24, temperature=0)[0]
    assert full.finish_reason == "length" and full.stop_reason is None and len(full.token_ids) == 24
    pieces = [trained.tokenizer.decode_continuation(trained.tokenizer.encode(PROMPT), full.token_ids[:n])
              for n in range(1, 25)]
    # a stop string from the middle of one token's text into the next's
    n = next(i for i in range(2, 20) if len(pieces[i]) - len(pieces[i - 1]) >= 2)
    stop = pieces[n][len(pieces[n - 1]) - 1:len(pieces[n - 1]) + 1]
    assert full.index(stop) == len(pieces[n - 1]) - 1
    streamed = []
    got = trained.generate([PROMPT], max_new_tokens=24, temperature=0, stop=["zzz", stop],
                           streamer=lambda b, piece: streamed.append(piece))[0]
    assert got == full[:full.index(stop)]
    assert "".join(streamed) == got  # held back at the piece boundary, never shown
    assert got.finish_reason == "stop" and got.stop_reason == stop
    assert got.token_ids == full.token_ids[:n + 1]  # the stop string's last token was generated


def test_a_stop_string_is_looked_for_only_after_min_tokens(trained):
    """As vLLM checks: the first occurrence that ends within the first min_tokens tokens' text does not stop the
    answer; the next one, found after, does."""
    full = trained.generate([PROMPT], max_new_tokens=40, temperature=0)[0]
    prompt = trained.tokenizer.encode(PROMPT)
    stop = " "  # in nearly every token's text
    assert full.index(stop) < len(trained.tokenizer.decode_continuation(prompt, full.token_ids[:1]))
    streamed = []
    got = trained.generate([PROMPT], max_new_tokens=40, temperature=0, stop=[stop], min_tokens=5,
                           streamer=lambda b, piece: streamed.append(piece))[0]
    first5 = trained.tokenizer.decode_continuation(prompt, full.token_ids[:5])
    assert got == full[:full.index(stop, len(first5) - len(stop) + 1)] == "".join(streamed)
    assert got.finish_reason == "stop" and len(got.token_ids) > 5


def test_stop_token_ids_end_without_the_token(trained):
    full = trained.generate([PROMPT, "And"], max_new_tokens=16, temperature=0)
    token = full[0].token_ids[5]
    first = full[0].token_ids.index(token)
    got = trained.generate([PROMPT, "And"], max_new_tokens=16, temperature=0, stop_token_ids=[token])
    assert got[0].token_ids == full[0].token_ids[:first]
    assert (got[0].finish_reason, got[0].stop_reason) == ("stop", token)
    assert got[0] == full[0][:len(got[0])]
    assert got[1].token_ids == full[1].token_ids[:full[1].token_ids.index(token)] if token in full[1].token_ids \
        else got[1].finish_reason == "length"


def test_token_prompts_return_ids_with_their_text(trained):
    ids = trained.tokenizer.encode(PROMPT)
    out = trained.generate([ids], max_new_tokens=6, temperature=0)[0]
    assert list(out) == out.token_ids and out.text == trained.generate([PROMPT], max_new_tokens=6)[0]
    assert out.prompt_tokens == len(ids) and out.completion_tokens == 6


@pytest.mark.parametrize("bad", [dict(stop=[""]), dict(min_p=2), dict(logprobs=-1), dict(seed=[1, 2]),
                                 dict(repetition_penalty=-1), dict(presence_penalty="a"),
                                 dict(logit_bias={5: 101}), dict(logit_bias={"x": 1}), dict(logit_bias={10**6: 1})])
def test_bad_values_are_refused_and_the_model_stays_usable(trained, bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        trained.generate([PROMPT], max_new_tokens=4, **bad)
    assert trained.generate([PROMPT], max_new_tokens=2)[0].finish_reason == "length"


@pytest.mark.parametrize("attention", ["layer", "replicated"])
def test_stop_strings_and_logprobs_on_two_rank_processes(trained, attention):
    """The ranks read the tokenizer to find stop strings; the head's rank (rank 1 under layer placement) sends
    the log-probabilities with the tokens, samples each row under its own parameters (logit_bias, min_tokens,
    allowed_token_ids, bad words) and scores a prompt (prompt_logprobs)."""
    kw = dict(max_new_tokens=16, temperature=0.7, seed=[1, 2], stop=["ou", "ss"], logprobs=2)
    one = trained.generate([PROMPT, "And"], **kw)
    rows = [SamplingParams(max_tokens=8, temperature=0, logit_bias={one[0].token_ids[0]: -100}, prompt_logprobs=2,
                           bad_words_ids=[one[0].token_ids[1:3]]),
            SamplingParams(max_tokens=8, temperature=0.9, seed=3, min_tokens=8,  # a row's own params, on the ranks
                           allowed_token_ids=sorted(set(one[1].token_ids[:6])))]
    with MoEModel.from_pretrained(TRAINED, gpus=2, attention=attention) as sharded:
        two = sharded.generate([PROMPT, "And"], **kw)
        got, want = sharded.generate([PROMPT, "And"], rows), trained.generate([PROMPT, "And"], rows)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        scored = [(e.token, e.logprob, [i for i, _ in e.top]) for e in got[0].prompt_logprobs[1:]]
        assert scored == [(e.token, pytest.approx(e.logprob, abs=1e-4), [i for i, _ in e.top])
                          for e in want[0].prompt_logprobs[1:]]
    for a, b in zip(one, two, strict=True):
        assert (a, a.token_ids, a.finish_reason, a.stop_reason) == (b, b.token_ids, b.finish_reason, b.stop_reason)
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
    assert any(a.stop_reason in ("ou", "ss") for a in one)  # a stop string was met
