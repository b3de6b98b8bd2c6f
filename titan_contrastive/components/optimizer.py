"""AdamW with CLIP's parameter groups (weight decay on matrices only; optionally each tower's layers at decaying
learning rates), and the gradient clipping before its step."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_contrastive.components.tower_layers import tower_depth, tower_layer
from titan_contrastive.config import ConfigError
from titan_contrastive.config.job_config import Optimizer as OptimizerConfig

STATIC_QUERY = "static_query.weight"
"""The name's end of inference-free SPLADE's query weights (`models/bi_encoder/static_query.py`)."""


def lr_scales(model: nn.Module, towers: Mapping[str, str], layer_decay: float) -> dict[str, float]:
    """Each parameter's learning-rate multiplier under layer-wise decay (BEiT's, as timm applies it): in a tower
    of L blocks, block i trains at `layer_decay ** (L - i)`, what comes before the blocks (embeddings) at
    `layer_decay ** (L + 1)`, what comes after (final norm, projection, head) and what no tower holds (the
    logit scale and bias) at 1 (`tower_layers`)."""
    names = [name for name, _ in model.named_parameters()]
    scales = dict.fromkeys(names, 1.0)
    for prefix in towers.values():
        depth = tower_depth(names, prefix)
        for name in (n for n in names if n.startswith(prefix)):
            scales[name] = layer_decay ** (depth + 1 - tower_layer(name, prefix, depth))
    return scales


def param_groups(
    model: nn.Module,
    weight_decay: float,
    lr: float,
    towers: Mapping[str, str] | None = None,
    layer_decay: float = 1.0,
    own_lrs: Mapping[str, float] | None = None,
) -> list[dict]:
    """Split parameters: >= 2-D weights decay; biases, norm gains, and scalars such as
    logit_scale do not (decaying the temperature would pull it toward 1, as open_clip notes).
    Embedding tables are 2-D but are excluded by name, as in CLIP. With `layer_decay` < 1, also by
    learning rate (`lr_scales`), and so are the parameters `own_lrs` names (name: its learning rate); the groups
    at the full `lr` first (the one the log reports)."""
    scales = lr_scales(model, towers or {}, layer_decay) if layer_decay < 1 else {}
    scales |= {name: own / lr for name, own in (own_lrs or {}).items()}
    groups: dict[tuple[float, int], list[nn.Parameter]] = {}  # (-scale, 0 decays / 1 does not)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_embedding = "embedding" in name or name.endswith("class_embedding")
        decays = p.ndim >= 2 and not is_embedding
        groups.setdefault((-scales.get(name, 1.0), 0 if decays else 1), []).append(p)
    keys = sorted(groups, key=lambda key: (key[0] != -1.0, key)) if scales else [(-1.0, 0), (-1.0, 1)]
    return [
        {"params": groups.get(key, []), "weight_decay": 0.0 if key[1] else weight_decay, "lr": -key[0] * lr}
        for key in keys
    ]


def build_optimizer(
    model: nn.Module, cfg: OptimizerConfig, towers: Mapping[str, str] | None = None
) -> torch.optim.Optimizer:
    """Build the optimizer named in `[optimizer]` (AdamW is the only choice so far) for its trainable parameters;
    `towers`: the family's (`ModelSpec.towers`), for `layer_decay`; inference-free SPLADE's query weights (a
    parameter named `*static_query.weight`) at `static_query_lr`."""
    fused = cfg.implementation == "fused"
    own_lrs = {}
    if cfg.static_query_lr:
        own_lrs = {name: cfg.static_query_lr for name, _ in model.named_parameters() if name.endswith(STATIC_QUERY)}
        if not own_lrs:
            raise ConfigError(
                f"optimizer.static_query_lr={cfg.static_query_lr}: the model has no inference-free query weights "
                "(bi_encoder with model.pooling='splade' and model.inference_free=true has); remove it"
            )
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay, cfg.lr, towers, cfg.layer_decay, own_lrs),
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
