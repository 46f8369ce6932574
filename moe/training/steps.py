"""Expert-parallel training: data parallel for the dense part, experts spread over ranks as in inference.

Every rank holds the embedding, attention, norms, routers and head (replicated, gradients all-reduced)
and only its own experts. A step's global batch is the same whatever the rank count: rank r takes
rows [r*B/R, (r+1)*B/R). Tokens reach their experts through the same all-to-all dispatcher as inference,
which is differentiable, so expert gradients collect contributions from every rank's tokens.

Each rank's loss is its share of the global mean (local sums divided by the global token count), so the
gradients summed over ranks equal the one-rank gradients of the whole batch, up to float rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.basic import init_weights
from models.config import ModelConfig
from models.transformer import Transformer
from moe.parallel.distributed import DistContext
from moe.parallel.placement import Placement, PlacementError
from moe.parallel.sharding import apply_expert_placement, connect_ranks


@dataclass(frozen=True)
class TrainSettings:
    seq_len: int = 256
    batch_size: int = 16  # sequences per step, over all ranks
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    balance_coef: float = 0.01  # weight of the Switch load-balancing loss
    seed: int = 0


# --- model -------------------------------------------------------------------------------------------

def init_model(cfg: ModelConfig, seed: int) -> Transformer:
    """A freshly initialised full model; every rank builds the same one, then keeps its experts."""
    model = Transformer(cfg)
    init_weights(model, std=0.02, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():  # residual branches scaled down with depth (GPT-2 style)
        for block in model.layers.values():
            block.attention.wo.weight.mul_(1 / math.sqrt(2 * cfg.n_layers))
            block.feed_forward.experts.w2.mul_(1 / math.sqrt(2 * cfg.n_layers))
    return model


def shard_experts(model: Transformer, placement: Placement, ctx: DistContext) -> None:
    """Keep this rank's experts of every block (their initial weights) and route through the all-to-all."""
    if any(len(r) > 1 for block in placement.expert_ranks for r in block):
        raise PlacementError("training needs one replica per expert (replicas would need their own grad sync)")
    full = {name: block.feed_forward.experts for name, block in model.layers.items()}
    apply_expert_placement(model, placement, ctx.rank, device=ctx.device)
    connect_ranks(model, placement, ctx)
    with torch.no_grad():
        for name, block in model.layers.items():
            local = block.feed_forward.experts
            for w in ("w1", "w2", "w3"):
                getattr(local, w).copy_(getattr(full[name], w)[local.expert_ids])


def is_expert_param(name: str) -> bool:
    return ".experts." in name


# --- losses ------------------------------------------------------------------------------------------

def balance_loss(model: Transformer, dist_ctx: DistContext, global_tokens: int) -> torch.Tensor:
    """This rank's share of the Switch loss E * sum_e f_e * P_e, averaged over blocks.

    f_e (fraction of routed copies that went to e) is counted over the global batch; P_e (mean router
    probability of e) is linear in each token, so each rank adds its tokens' part and the ranks' shares sum
    to the global value. 1.0 means perfectly balanced routing.
    """
    total = torch.zeros((), device=dist_ctx.device)
    blocks = list(model.layers.values())
    for block in blocks:
        gate = block.feed_forward.gate
        logits = gate.last_logits_TE
        E, K = gate.n_experts, gate.top_k
        counts = torch.bincount(logits.topk(K, dim=-1).indices.reshape(-1), minlength=E).float()
        dist_ctx.all_reduce(counts)
        f = counts / (global_tokens * K)
        total = total + E * (f * torch.softmax(logits, dim=-1).sum(0)).sum() / global_tokens
        gate.last_logits_TE = None
    return total / len(blocks)


# --- one step ----------------------------------------------------------------------------------------

@dataclass
class StepResult:
    loss: float  # mean cross-entropy over the global batch, nats/token
    balance: float  # load-balancing loss (1.0 = balanced)
    grad_norm: float  # before clipping


def local_rows(batch_BL: torch.Tensor, dist_ctx: DistContext) -> torch.Tensor:
    B = batch_BL.shape[0]
    if B % dist_ctx.world_size:
        raise ValueError(f"--batch-size {B} is not divisible by {dist_ctx.world_size} ranks")
    n = B // dist_ctx.world_size
    return batch_BL[dist_ctx.rank * n:(dist_ctx.rank + 1) * n]


def forward_backward(model: Transformer, batch_BL: torch.Tensor, settings: TrainSettings,
                     dist_ctx: DistContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and gradients of this rank's rows of a global batch [B, L+1]; returns (ce_sum, balance)."""
    rows = local_rows(batch_BL, dist_ctx).to(dist_ctx.device)
    inputs, targets = rows[:, :-1], rows[:, 1:]
    global_tokens = batch_BL.shape[0] * inputs.shape[1]
    logits = model(inputs)
    ce_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum")
    balance = balance_loss(model, dist_ctx, inputs.numel() * dist_ctx.world_size)
    (ce_sum / global_tokens + settings.balance_coef * balance).backward()
    return ce_sum.detach(), balance.detach()


def sync_dense_grads(model: Transformer, dist_ctx: DistContext) -> None:
    """Sum the replicated parameters' gradients over ranks, as one flat all-reduce."""
    if not dist_ctx.distributed:
        return
    grads = [p.grad for n, p in model.named_parameters() if not is_expert_param(n) and p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist_ctx.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def clip_grads(model: Transformer, max_norm: float, dist_ctx: DistContext) -> float:
    """Clip by the global norm: dense gradients are identical everywhere, expert ones are summed over ranks."""
    dense_sq = torch.zeros((), dtype=torch.float64)
    expert_sq = torch.zeros((), dtype=torch.float64)
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        sq = p.grad.double().pow(2).sum().cpu()
        if is_expert_param(name):
            expert_sq += sq
        else:
            dense_sq += sq
    if dist_ctx.distributed:
        expert_sq = expert_sq.to(dist_ctx.device)
        dist_ctx.all_reduce(expert_sq)
        expert_sq = expert_sq.cpu()
    norm = float((dense_sq + expert_sq).sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


def train_step(model: Transformer, optimizer: torch.optim.Optimizer, batch_BL: torch.Tensor,
               settings: TrainSettings, dist_ctx: DistContext) -> StepResult:
    optimizer.zero_grad(set_to_none=True)
    ce_sum, balance = forward_backward(model, batch_BL, settings, dist_ctx)
    sync_dense_grads(model, dist_ctx)
    norm = clip_grads(model, settings.grad_clip, dist_ctx)
    optimizer.step()
    stats = torch.stack([ce_sum.double(), balance.double()]).to(dist_ctx.device)
    dist_ctx.all_reduce(stats)
    tokens = batch_BL.shape[0] * (batch_BL.shape[1] - 1)
    return StepResult(loss=float(stats[0]) / tokens, balance=float(stats[1]), grad_norm=norm)


def make_optimizer(model: Transformer, settings: TrainSettings) -> torch.optim.Optimizer:
    """AdamW (fused kernel); no weight decay on norms and the router."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if name.endswith("norm.weight") or ".gate." in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, 0.95), fused=True)


def lr_at(step: int, total_steps: int, settings: TrainSettings) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr at total_steps."""
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = min(1.0, (step - settings.warmup_steps) / max(1, total_steps - settings.warmup_steps))
    floor = settings.lr * settings.min_lr_ratio
    return floor + (settings.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


# --- data --------------------------------------------------------------------------------------------

def sample_batch(stream: torch.Tensor, batch: int, seq_len: int, step: int, seed: int) -> torch.Tensor:
    """Random windows [batch, seq_len + 1] of the token stream; the same on every rank for a given step."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch,), generator=g)
    return torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()]).long()
