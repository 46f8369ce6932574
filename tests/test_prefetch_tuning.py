"""The decode kernel's prefetch distance (models/kernels/tuning.py): a hint that never changes a bit, measured per
machine and model shape, the fastest kept, cached, measured again only where the cache cannot say; the
environment's value wins, a bad one is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from models import weights
from models.kernels import native, tuning
from moe import MoEModel
from tests.checkpoints import tiny_config, write_checkpoint

pytestmark = pytest.mark.skipif(not native.available(), reason=f"kernel not built: {native.why_unavailable()}")


@pytest.fixture(autouse=True)
def _restore_distances():
    before = dict(tuning._distances)
    yield
    tuning._set(before)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The cache in a folder of the test's own; every read counts (MIN_BYTES 0: tiny weights are measured)."""
    monkeypatch.setattr(native, "built_library", lambda: tmp_path / "build" / "kernels.so")
    (tmp_path / "build").mkdir()
    monkeypatch.setattr(tuning, "MIN_BYTES", 0)
    monkeypatch.delenv(tuning.ENV, raising=False)
    return tmp_path / "build" / "prefetch.json"


class Clock:
    """Each timed pass takes `cost[distance]` (the distance the kernels were last told), so the fastest is known."""

    def __init__(self, monkeypatch, cost: dict[int, float]) -> None:
        self.t, self.cost, self.now, self.calls = 0.0, cost, 0, 0
        told = native._ops.set_prefetch
        monkeypatch.setattr(native._ops, "set_prefetch", lambda b, i: (setattr(self, "now", b), told(b, i))[1])

    def __call__(self) -> float:
        self.calls += 1
        self.t += self.cost[self.now]
        return self.t


def _reads(dtype: torch.dtype) -> list[tuple]:
    w = torch.randn(4, 96, 160).to(dtype) if dtype != torch.int8 else torch.randint(-127, 128, (4, 96, 160),
                                                                                   dtype=torch.int8)
    counts = torch.tensor([1, 0, 2, 0])
    return [(w, counts, torch.rand(4, 96) if dtype == torch.int8 else None)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("rows", [torch.float32, torch.bfloat16])
def test_a_distance_never_changes_a_bit(dtype, rows):
    (w, counts, scale), = _reads(dtype)
    x = torch.randn(3, w.shape[-1]).to(rows)
    outs = []
    for distance in tuning.CANDIDATES + (64,):
        tuning._set(dict.fromkeys(tuning.KINDS.values(), distance))
        outs.append(native.grouped(x, w, counts, scale))
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("dtype,kind", [(torch.bfloat16, "bfloat16"), (torch.int8, "int8")])
def test_the_fastest_distance_is_kept_cached_and_read_back(cache, monkeypatch, dtype, kind):
    clock = Clock(monkeypatch, {0: 3.0, 1024: 1.0, 4096: 2.0})
    assert tuning.tune(_reads(dtype), clock)[kind] == 1024
    assert list(json.loads(cache.read_text()).values()) == [1024]
    assert clock.calls > 2 * len(tuning.CANDIDATES) * tuning.ROUNDS
    measured = clock.calls
    tuning._set(dict.fromkeys(tuning.KINDS.values(), 0))
    assert tuning.tune(_reads(dtype), clock)[kind] == 1024  # read back: nothing measured again
    assert clock.calls == measured


def test_a_request_must_earn_its_place(cache, monkeypatch):
    """Distances within 2% of the fastest are one speed: the shortest of them is kept (no requests here)."""
    clock = Clock(monkeypatch, {0: 1.015, 1024: 1.0, 4096: 2.0})
    assert tuning.tune(_reads(torch.bfloat16), clock)["bfloat16"] == 0


def test_another_machine_or_shape_is_measured_on_its_own(cache, monkeypatch):
    clock = Clock(monkeypatch, {0: 1.0, 1024: 2.0, 4096: 3.0})
    cache.write_text(json.dumps({"another CPU; bfloat16; rows of 320 bytes": 4096}))
    assert tuning.tune(_reads(torch.bfloat16), clock)["bfloat16"] == 0
    assert sorted(json.loads(cache.read_text()).values()) == [0, 4096]


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"%s": 333}'])
def test_a_corrupt_or_foreign_cache_is_measured_over(cache, monkeypatch, content):
    key = f"{tuning.machine_key()}; bfloat16; rows of 320 bytes"
    cache.write_text(content.replace("%s", key))
    clock = Clock(monkeypatch, {0: 2.0, 1024: 2.0, 4096: 1.0})
    assert tuning.tune(_reads(torch.bfloat16), clock)["bfloat16"] == 4096
    assert json.loads(cache.read_text())[key] == 4096


def test_the_environments_distance_wins_and_a_bad_one_is_refused(cache, monkeypatch):
    clock = Clock(monkeypatch, {0: 1.0, 1024: 1.0, 4096: 1.0})
    monkeypatch.setenv(tuning.ENV, "2048")
    assert tuning.tune(_reads(torch.int8), clock) == {"bfloat16": 2048, "int8": 2048}
    assert clock.calls == 0 and not cache.exists()
    for bad in ("-1", "4k", "99999"):
        monkeypatch.setenv(tuning.ENV, bad)
        with pytest.raises(ValueError, match=f"^{tuning.ENV}={bad!r}: a number of bytes from 0 to 65536$"):
            tuning.tune(_reads(torch.int8), clock)


def test_reads_that_fit_in_a_cache_are_not_measured(cache, monkeypatch):
    monkeypatch.setattr(tuning, "MIN_BYTES", 10**9)
    clock = Clock(monkeypatch, {0: 1.0, 1024: 1.0, 4096: 1.0})
    before = dict(tuning._distances)
    assert tuning.tune(_reads(torch.bfloat16), clock) == before
    assert clock.calls == 0 and not cache.exists()


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_a_models_decode_reads_are_its_streamed_weights(tmp_path, dtype):
    """What is timed is what a decode step reads: each block's fused q/k/v, its output and its two expert stacks
    with top-k experts getting a row, and the head; the model says the distance it runs with."""
    cfg = tiny_config()
    write_checkpoint(tmp_path, cfg)
    with MoEModel.from_pretrained(tmp_path, dtype=dtype) as model:
        reads = weights.decode_reads(model.engine.model)
        assert model.info.prefetch_bytes == [tuning._distances]
    assert len(reads) == cfg.n_layers * 4 + 1
    assert {r[0].dtype for r in reads} == {torch.int8 if dtype == "int8" else torch.bfloat16}
    experts = [r[1].tolist() for r in reads if r[1] is not None]
    assert experts == [[1] * cfg.top_k + [0] * (cfg.n_experts - cfg.top_k)] * (2 * cfg.n_layers)
