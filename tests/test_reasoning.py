"""A thinking model's reasoning apart from its answer (`--reasoning-parser`, `moe.serve.reasoning`): the readings of
vLLM's `qwen3` and `deepseek_r1` parsers, the same whatever pieces a stream cuts the text into."""

from __future__ import annotations

import pytest

from moe.serve.reasoning import ReasoningSplit

CASES = [  # parser, the prompt's text, the answer's text -> (reasoning, content)
    ("qwen3", "", "<think>Who asks?</think>\n\nEmma.", ("Who asks?", "\n\nEmma.")),
    ("qwen3", "", "\n<think>\nHm.\n</think>Emma.", ("\nHm.\n", "Emma.")),
    ("qwen3", "", "Emma.", (None, "Emma.")),  # thinking off (enable_thinking false): all content
    ("qwen3", "", "<think>Who asks and", ("Who asks and", None)),  # cut short while thinking
    ("qwen3", "", "<think></think>Emma.", (None, "Emma.")),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Who asks?</think>Emma.", ("Who asks?", "Emma.")),  # opened
    ("qwen3", "<think>old</think><|im_start|>assistant\n", "Emma.", (None, "Emma.")),  # a closed one before
    ("qwen3", "", "a < b </thin", (None, "a < b </thin")),
    ("deepseek_r1", "", "Who asks?</think>Emma.", ("Who asks?", "Emma.")),  # R1 thinks first, tag or not
    ("deepseek_r1", "", "<think>Who asks?</think>Emma.", ("Who asks?", "Emma.")),
    ("deepseek_r1", "", "Who asks and", ("Who asks and", None)),
]


@pytest.mark.parametrize("parser, prompt, text, want", CASES)
def test_whole_answers_split_as_vllms_parsers_read_them(parser, prompt, text, want):
    assert ReasoningSplit(parser, prompt).whole(text) == want


@pytest.mark.parametrize("parser, prompt, text, want", CASES)
def test_a_stream_cut_anywhere_gives_the_whole_answers_parts(parser, prompt, text, want):
    for a in range(len(text) + 1):
        for b in range(a, len(text) + 1):
            split, thought, answer = ReasoningSplit(parser, prompt), "", ""
            for piece in (text[:a], text[a:b], text[b:], None):
                got = split.feed(piece) if piece is not None else split.finish()
                thought, answer = thought + got[0], answer + got[1]
            assert (thought or None, answer or None) == want, (a, b)
