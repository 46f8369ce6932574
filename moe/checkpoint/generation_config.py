"""`generation_config.json`: the checkpoint's end-of-sequence tokens and its sampling defaults, as transformers
and vLLM apply them where a caller gives none."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from moe.checkpoint.files import CheckpointError


@dataclass(frozen=True)
class GenerationDefaults:
    eos_ids: tuple[int, ...] = ()  # every one of them ends a sequence
    sampling: dict[str, float | int] = field(default_factory=dict)  # temperature, top_p, ..., where it sets them
    path: Path | None = None

    def merged(self, **given: float | int | None) -> tuple[dict[str, float | int], list[str]]:
        """The caller's values where given (not None), else the file's; and the names that came from the file."""
        out, from_file = {}, []
        for name, value in given.items():
            if value is None and name in self.sampling:
                out[name] = self.sampling[name]
                from_file.append(name)
            elif value is not None:
                out[name] = value
        return out, from_file


def read_generation_config(directory: str | Path, config_eos: list[int] | int | None) -> GenerationDefaults:
    """The file beside the weights, if any: its `eos_token_id` (one or a list; else config.json's) and, where
    `do_sample` is true, its temperature, top_p, top_k and min_p (a file that does not sample is greedy:
    temperature 0); its repetition_penalty either way (transformers applies it to greedy search too)."""
    eos = config_eos
    path = Path(directory) / "generation_config.json"
    sampling: dict[str, float | int] = {}
    if path.exists():
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: cannot parse JSON ({e})") from None
        eos = raw.get("eos_token_id", eos)
        if raw.get("do_sample"):
            sampling = {k: raw[k] for k in ("temperature", "top_p", "top_k", "min_p") if raw.get(k) is not None}
            sampling.setdefault("temperature", 1.0)
        elif "do_sample" in raw:
            sampling = {"temperature": 0.0}
        if raw.get("repetition_penalty") not in (None, 1, 1.0):
            sampling["repetition_penalty"] = raw["repetition_penalty"]
    ids = tuple(eos) if isinstance(eos, list) else (eos,) if isinstance(eos, int) else ()
    return GenerationDefaults(ids, sampling, path if path.exists() else None)
