"""Expert-load reports: pure functions of a `[blocks, 2, experts]` count tensor and a placement.

Counts are token copies routed to each expert (row 0 prefill, row 1 decode), gathered across ranks
once when a report is asked for. A report is written as JSON and CSV, printed as a table, and drawn
as a heatmap with per-rank bars (matplotlib, optional). Dense blocks among MoE ones (Qwen2/3-MoE's
`mlp_only_layers`, DeepSeek's first blocks) have no experts: their rows are zeros the figures leave out.
"""

from __future__ import annotations

import csv
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import torch

from models.config import ModelConfig
from moe.parallel.placement import Placement


def imbalance(loads: torch.Tensor) -> dict[str, float]:
    """max/mean and coefficient of variation of a load vector (0 when nothing was routed)."""
    loads = loads.double()
    mean = loads.mean().item()
    if mean == 0:
        return {"max_over_mean": 0.0, "cv": 0.0}
    return {"max_over_mean": loads.max().item() / mean, "cv": loads.std(unbiased=False).item() / mean}


def rank_loads(counts_LE: torch.Tensor, placement: Placement) -> torch.Tensor:
    """[blocks, ranks] token copies each rank computes; a replicated expert's copies split evenly, a split expert's
    (experts by `tensor`) computed by every rank of its group, each its slice."""
    L, E = counts_LE.shape
    out = torch.zeros(L, placement.world_size, dtype=torch.float64)
    for i in range(L):
        split = placement.strategy(i).experts == "tensor"
        for e in range(E):
            ranks = placement.expert_ranks[i][e]
            for r in ranks:
                out[i, r] += counts_LE[i, e].item() / (1 if split else len(ranks))
    return out


@dataclass
class ExpertLoadReport:
    counts: torch.Tensor  # [blocks, 2, experts] int64: prefill, decode
    placement: Placement
    entropy_sum: float | None  # sum over blocks and routed tokens of the router's entropy (nats); None: untracked
    routed_tokens: int  # tokens routed per block
    received: torch.Tensor | None = None  # [blocks, ranks] copies each rank's experts computed (measured)
    dense: tuple[int, ...] = ()  # blocks with no experts (one dense MLP)

    @classmethod
    def of(cls, counts: torch.Tensor, entropy: torch.Tensor, received: torch.Tensor | None, placement: Placement,
           cfg: ModelConfig) -> ExpertLoadReport:
        """From an engine's load statistics (`load_stats`): the tokens a block routed are its copies over top_k, and
        the entropy, summed only while tracked, is scaled from the tokens it covered to all of them."""
        routing = max(cfg.n_layers - len(cfg.dense_layers), 1)  # the blocks with a router
        tokens = int(counts.sum()) // (cfg.top_k * routing)
        summed, covered = entropy.tolist()
        entropy_sum = summed / covered * tokens * routing if covered else None
        return cls(counts, placement, entropy_sum, tokens, received, tuple(cfg.dense_layers))

    @property
    def routed(self) -> list[int]:
        """The blocks with experts."""
        return [i for i in range(self.counts.shape[0]) if i not in self.dense]

    @property
    def total(self) -> torch.Tensor:
        return self.counts.sum(1)  # [blocks, experts]

    def rank_load(self) -> torch.Tensor:
        """[blocks, ranks]: measured where the ranks counted their rows, else derived from the placement."""
        if self.received is not None and self.received.shape[1] == self.placement.world_size:
            return self.received.double()
        return rank_loads(self.total, self.placement)

    def to_json(self) -> dict:
        total, ranks = self.total, self.rank_load()
        blocks, routed = [], self.routed
        for i in range(total.shape[0]):
            block = {"block": i, "strategy": self.placement.strategy(i).describe()}
            blocks.append(block | ({"dense": True} if i in self.dense else {
                "experts": imbalance(total[i]), "ranks": imbalance(ranks[i]),
                "unused_experts": [e for e in range(total.shape[1]) if total[i, e] == 0]}))
        return {
            "counts": total.tolist(),
            "counts_prefill": self.counts[:, 0].tolist(),
            "counts_decode": self.counts[:, 1].tolist(),
            "rank_load": [[round(x, 3) for x in row] for row in ranks.tolist()],
            "placement": self.placement.to_json(),
            "dense_blocks": list(self.dense),
            "imbalance": {"experts": imbalance(total[routed].reshape(-1)), "ranks": imbalance(ranks.sum(0)),
                          "per_block": blocks},
            "unused_experts": sum(len(b.get("unused_experts", ())) for b in blocks),
            "mean_router_entropy": None if self.entropy_sum is None else
            self.entropy_sum / (self.routed_tokens * len(routed)) if self.routed_tokens else 0.0,
            "routed_tokens": self.routed_tokens,
        }

    def table(self) -> str:
        total, ranks = self.total, self.rank_load()
        E, R = total.shape[1], ranks.shape[1]
        head = "block " + " ".join(f"e{e:<5}" for e in range(E)) + " | " + " ".join(f"r{r:<6}" for r in range(R))
        lines = [head + " | max/mean(ranks) | attention / experts"]
        for i in range(total.shape[0]):
            if i in self.dense:  # the columns of a routed block's row, blank
                lines.append(f"{i:<5} {'dense: no experts':<{7 * E - 1}} | {'':<{8 * R - 1}} | {'':<15} | "
                             f"{self.placement.strategy(i).describe()}")
                continue
            cells = " ".join(f"{int(c):<6}" for c in total[i].tolist())
            rcells = " ".join(f"{x:<7.1f}" for x in ranks[i].tolist())
            strategy = self.placement.strategy(i).describe()
            lines.append(f"{i:<5} {cells} | {rcells} | {imbalance(ranks[i])['max_over_mean']:<15.2f} | {strategy}")
        lines.append(f"total {int(total.sum())} token copies; overall rank max/mean "
                     f"{imbalance(ranks.sum(0))['max_over_mean']:.2f}")
        return "\n".join(lines)

    def write(self, out_dir: str | Path) -> list[Path]:
        """expert_load.json, expert_load.csv and (with matplotlib) expert_load.png, each written atomically."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        written = [out / "expert_load.json", out / "expert_load.csv"]
        _atomic_write(written[0], json.dumps(self.to_json(), indent=1) + "\n")
        _atomic_write(written[1], self._csv())
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return written
        from moe.reports.plot import draw_heatmap

        draw_heatmap(self.total, self.rank_load(), out / "expert_load.png", self.dense)
        return [*written, out / "expert_load.png"]

    def _csv(self) -> str:
        import io

        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(["block", "expert", "ranks", "prefill", "decode", "total"])
        for i in self.routed:
            for e in range(self.counts.shape[2]):
                ranks = " ".join(map(str, self.placement.expert_ranks[i][e]))
                p, d = int(self.counts[i, 0, e]), int(self.counts[i, 1, e])
                w.writerow([i, e, ranks, p, d, p + d])
        return buf.getvalue()


def _atomic_write(path: Path, text: str) -> None:
    """Write beside, then rename: a reader never sees half a report. A plain exclusive open (not mkstemp,
    which makes owner-only files) gives the file the permissions the umask allows, like any other file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.partial")
    try:
        with open(tmp, "x") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
