"""Generation: a request's parameters, the sampler, stop strings, and the batched loop over any engine."""

from moe.generation.loop import (
    GenerationResult,
    RowOutput,
    Stepper,
    check_prompts,
    generate_tokens,
    left_pad,
    needs_tokenizer,
)
from moe.generation.params import SamplingParams
from moe.generation.sampler import Sampler

__all__ = ["GenerationResult", "RowOutput", "SamplingParams", "Sampler", "Stepper", "check_prompts",
           "generate_tokens", "left_pad", "needs_tokenizer"]
