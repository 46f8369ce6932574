"""Structured outputs (vLLM's `structured_outputs`): answers held to a JSON schema, a regex, a choice, a Lark grammar
or any JSON object are what those say (checked with Python's json and re), and greedy ones are each step's most
likely token among those llguidance allows, as transformers' logits rank them; on 2 ranks as on one."""

from __future__ import annotations

import json
import re

import pytest
import torch

from moe import MoEModel, SamplingParams, StructuredOutputsParams
from tests.test_chat_template import CHATML, checkpoint

llguidance = pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"name": {"enum": ["Emma", "Harriet"]},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{2,5} (is|was) [0-9]{1,2}"
CHOICE = ["Emma", "Mr Knightley", "Harriet"]
LARK = 'start: "Emma " verb " " ("happy" | "clever")\nverb: "is" | "was"'
GBNF = 'root ::= "Emma " verb " " ("happy" | "clever")\nverb ::= "is" | "was"'  # llama.cpp's form of the same
PROMPTS = ["Emma Woodhouse,", "It is a truth"]


def valid(kind: str, text: str) -> bool:
    if kind == "json":
        got = json.loads(text)
        return set(got) == {"name", "age"} and got["name"] in ("Emma", "Harriet") and 0 <= got["age"] <= 99
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICE
    if kind in ("grammar", "gbnf"):
        return re.fullmatch("Emma (is|was) (happy|clever)", text) is not None
    return isinstance(json.loads(text), dict)


SPECS = {"json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
         "regex": StructuredOutputsParams(regex=REGEX), "choice": StructuredOutputsParams(choice=CHOICE),
         "grammar": StructuredOutputsParams(grammar=LARK), "gbnf": StructuredOutputsParams(grammar=GBNF),
         "json_object": StructuredOutputsParams(json_object=True, disable_any_whitespace=True)}


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("structured"), template_config=CHATML)


@pytest.fixture(scope="module")
def model(chat_ckpt):
    with MoEModel.from_pretrained(chat_ckpt) as m:
        yield m


@pytest.mark.parametrize("kind", ["json", "regex", "choice", "grammar", "gbnf"])
def test_greedy_answers_are_valid_and_each_step_the_most_likely_allowed_token(chat_ckpt, model, kind):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(chat_ckpt, dtype=torch.float32)
    got = model.generate(PROMPTS, SamplingParams(max_tokens=48, structured_outputs=SPECS[kind]))
    tokenizer = llguidance.LLTokenizer(model.tokenizer.tok.to_str(), n_vocab=model.config.vocab_size,
                                       eos_token=model.tokenizer.eos_id)
    for prompt, out in zip(PROMPTS, got, strict=True):
        assert valid(kind, str(out)) and out.finish_reason == "stop", str(out)
        matcher = llguidance.LLMatcher(tokenizer, SPECS[kind].grammar_text())
        ids, want = model.tokenizer.encode(prompt), []
        while not matcher.is_stopped() and len(want) < 48:
            with torch.no_grad():
                logits = hf(torch.tensor([ids + want])).logits[0, -1]
            mask = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
            allowed = ((mask[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).flatten()[:len(logits)].bool()
            token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            if token == model.tokenizer.eos_id:
                break
            want.append(token)
            assert matcher.consume_token(token)
        assert out.token_ids == want


@pytest.mark.parametrize("kind", list(SPECS))
def test_sampled_answers_are_valid_and_a_rows_own_whatever_the_batch(model, kind):
    params = SamplingParams(max_tokens=64, temperature=0.8, seed=5, structured_outputs=SPECS[kind])
    together = model.generate(PROMPTS, [params, SamplingParams(max_tokens=8, temperature=1.0, seed=1)])
    alone = model.generate(PROMPTS[:1], params)
    assert together[0].token_ids == alone[0].token_ids
    if together[0].finish_reason == "stop":  # a sampled JSON object may run past max_tokens
        assert valid(kind, str(together[0]))


def test_bad_structures_are_refused_in_one_line(model):
    for spec, why in (({"regex": "("}, "structured_outputs: .*invalid regex"),
                      ({"regex": "a", "choice": ["b"]}, "takes one of"),
                      ({"choice": []}, "choice must be a list of strings"),
                      ({"json": "{not json"}, "not a JSON schema"), ({"grammar": "root ::= ("}, "grammar"),
                      ({"nope": 1}, "must be an object with one of")):
        with pytest.raises(ValueError, match=why) as caught:
            model.generate(PROMPTS[0], SamplingParams(structured_outputs=spec))
        assert "\n" not in str(caught.value)
    assert model.generate(PROMPTS[0], max_new_tokens=2)  # the model goes on


@pytest.mark.multiprocess
def test_two_ranks_give_one_ranks_structured_answers(chat_ckpt, model):
    rows = [SamplingParams(max_tokens=32, structured_outputs=SPECS["json"]),
            SamplingParams(max_tokens=16, temperature=0.9, seed=2, structured_outputs=SPECS["regex"])]
    with MoEModel.from_pretrained(chat_ckpt, gpus=2) as sharded:
        assert [o.token_ids for o in sharded.generate(PROMPTS, rows)] == \
            [o.token_ids for o in model.generate(PROMPTS, rows)]
