"""AdamW with CLIP's parameter groups (weight decay on matrices only), and the gradient clipping before its step."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_contrastive.config.job_config import Optimizer as OptimizerConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split parameters: >= 2-D weights decay; biases, norm gains, and scalars such as
    logit_scale do not (decaying the temperature would pull it toward 1, as open_clip notes).
    Embedding tables are 2-D but are excluded by name, as in CLIP."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_embedding = "embedding" in name or name.endswith("class_embedding")
        (decay if p.ndim >= 2 and not is_embedding else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """Build the optimizer named in `[optimizer]` (AdamW is the only choice so far) for its trainable parameters."""
    fused = cfg.implementation == "fused"
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        **({"fused": True} if fused else {"foreach": True}),
    )


def clip_grad_norm(
    model: nn.Module, max_norm: float, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None
) -> float:
    """The total gradient norm over all ranks (FSDP/HSDP shards included), after unscaling float16
    gradients; gradients are clipped to `max_norm` when it is > 0."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    if isinstance(norm, DTensor):  # torch 2.9 leaves it partial over the shards, and the clip coefficient's
        norm = norm.full_tensor()  # `norm + 1e-6` would then add 1e-6 to each rank's part
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm.item()
