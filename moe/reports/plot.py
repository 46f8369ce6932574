"""The expert-load picture: a blocks x experts heatmap beside per-rank load bars (matplotlib)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def draw_heatmap(counts_LE: torch.Tensor, ranks_LR: torch.Tensor, path: Path, dense: tuple[int, ...] = ()) -> None:
    """`dense`: blocks without experts, left blank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L, E = counts_LE.shape
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(4 + 0.5 * E + 3, 1.5 + 0.45 * L),
                                 gridspec_kw={"width_ratios": [max(E, 2), 3]})
    shown = counts_LE.double().numpy().copy()
    shown[list(dense)] = float("nan")  # drawn blank
    im = ax.imshow(shown, aspect="auto", cmap="viridis")
    ax.set_xlabel("expert")
    ax.set_ylabel("block")
    ax.set_xticks(range(E))
    ax.set_yticks(range(L))
    ax.set_title("token copies per expert")
    for i in dense:
        ax.text((E - 1) / 2, i, "dense: no experts", ha="center", va="center", fontsize=7)
    for i in (i for i in range(L) if i not in dense):
        for e in range(E):
            v = int(counts_LE[i, e])
            ax.text(e, i, str(v), ha="center", va="center", fontsize=7,
                    color="white" if v < counts_LE.max() * 0.6 else "black")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    totals = ranks_LR.sum(0).numpy()
    bx.bar(range(len(totals)), totals, color="tab:orange")
    mean = totals.mean()
    bx.axhline(mean, color="black", linestyle="--", linewidth=1, label=f"mean; max/mean {totals.max() / mean:.2f}"
               if mean else "mean")
    bx.set_xlabel("rank")
    bx.set_ylabel("token copies computed")
    bx.set_xticks(range(len(totals)))
    bx.set_title("load per rank")
    bx.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.partial.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
