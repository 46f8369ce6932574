"""Mixtral-style mixture-of-experts inference with experts and layers placed over ranks."""

from moe.api import MoEModel
from moe.checkpoint.files import CheckpointError
from moe.generation.params import SamplingParams
from moe.generation.structured import StructuredOutputsParams

__all__ = ["MoEModel", "CheckpointError", "SamplingParams", "StructuredOutputsParams"]
