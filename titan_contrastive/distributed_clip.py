"""Seed 001's interface to the exact streaming distributed contrastive step:
`distributed_train_step(model, optimizer, local_x, local_y, config)`, with the seed's softmax
loss (`config["LOSS"] = "clip"`, the default), SigLIP's sigmoid loss ("siglip") or any other
objective of `titan_contrastive.losses`.

The algorithm (phases A-E, O(N d) memory, gradients identical to the dense loss) is
`StreamingClipStep` in `titan_contrastive.steps.global_negatives`, which the trainer runs for
`[loss] negatives = "global"`; this module adapts it to the seed's call: a DDP- / FSDP2-wrapped
or plain model, a config dict with the seed's keys, one optimizer step, the global loss returned.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from titan_contrastive.config import ConfigError
from titan_contrastive.config.job_config import Loss
from titan_contrastive.grad_cache.sync import grad_sync
from titan_contrastive.losses import Objective, build_objective
from titan_contrastive.losses.fused import require_kernel
from titan_contrastive.steps.global_negatives import DistributedClipError, StreamingClipStep

__all__ = ["DistributedClipError", "StreamingClipStep", "distributed_train_step"]

_KEYS = ("GLOBAL_BATCH_SIZE", "MICRO_BATCH_SIZE", "STREAM_CHUNK_SIZE", "TAU")


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _positive_int(config: Mapping[str, Any], key: str) -> int:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DistributedClipError(f"config['{key}']={value!r}: must be an integer >= 1")
    return value


def _objective(loss: Any) -> Objective:
    """config["LOSS"]: an objective's name (`losses.OBJECTIVES`) or an objective object."""
    if not isinstance(loss, str):
        if not callable(getattr(loss, "streamed", None)):
            raise DistributedClipError(f"config['LOSS']={loss!r}: give an objective's name (e.g. 'clip') or object")
        return loss
    try:
        return build_objective(Loss(name=loss))
    except ConfigError as e:
        raise DistributedClipError(str(e).replace("loss.name=", "config['LOSS']=")) from None


def distributed_train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, local_x: Tensor, local_y: Tensor, config: Mapping[str, Any]
) -> float:
    """One optimizer step of the exact global contrastive loss; returns the global loss on every rank.

    model: DDP-wrapped, FSDP2 (`fully_shard`), or plain on a single process; `forward(x, y)`
    returns L2-normalized `(z_x, z_y)`, optionally followed by `exp(logit_scale)` and, for the
    sigmoid loss, `logit_bias`. config: N = GLOBAL_BATCH_SIZE (= local batch x world size),
    MICRO_BATCH_SIZE (re-forward chunk), STREAM_CHUNK_SIZE (rows per logit block), TAU (fixed
    temperature, t = 1/TAU; None = learn the model's `logit_scale`: t = exp(logit_scale),
    optionally clamped to t <= config["MAX_LOGIT_SCALE"], e.g. 100 as in CLIP). Optional LOSS:
    an objective's name, "clip" (default; symmetric InfoNCE) or "siglip" (the sigmoid loss, with
    BIAS: a fixed bias, or None to learn the model's `logit_bias`), or an objective object from
    `titan_contrastive.losses` (e.g. `InfoNCE(symmetric=False)`). Optional KERNEL: "auto" (default:
    the fused Triton kernels on CUDA where they serve the objective), "pytorch", "triton" or
    "triton_exact" (losses/fused.py). Optional HARD_NEGATIVES = k (default 0): local_y holds 1 + k
    rows per sample, its positive then its k hard negatives, and the model's z_y as many.
    """
    missing = [k for k in _KEYS if k not in config]
    if missing:
        raise DistributedClipError(
            f"config lacks {', '.join(missing)}; it needs {', '.join(_KEYS)} (TAU=None learns logit_scale)"
        )
    n, micro = _positive_int(config, "GLOBAL_BATCH_SIZE"), _positive_int(config, "MICRO_BATCH_SIZE")
    chunk = _positive_int(config, "STREAM_CHUNK_SIZE")
    world = dist.get_world_size() if dist.is_initialized() else 1
    wrapped = isinstance(model, (nn.parallel.DistributedDataParallel, FSDPModule))
    if world > 1 and not wrapped:
        raise DistributedClipError(
            f"model is not DDP- or FSDP2-wrapped but WORLD_SIZE={world}: wrap it, or its gradients are never reduced"
        )
    if n % world:
        raise DistributedClipError(
            f"GLOBAL_BATCH_SIZE={n} is not divisible by WORLD_SIZE={world}; use a multiple of {world}"
        )
    k = config.get("HARD_NEGATIVES", 0)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise DistributedClipError(f"config['HARD_NEGATIVES']={k!r}: must be an integer >= 0")
    if len(local_y) != len(local_x) * (1 + k):
        raise DistributedClipError(
            f"local_x has {len(local_x)} samples but local_y has {len(local_y)}; with HARD_NEGATIVES={k} local_y holds "
            f"{1 + k} rows per sample (its positive, then its hard negatives): {len(local_x) * (1 + k)}"
        )
    if len(local_x) != n // world:
        raise DistributedClipError(
            f"local batch is {len(local_x)} but GLOBAL_BATCH_SIZE / WORLD_SIZE = {n} / {world} = {n // world}; pass "
            "each rank its N/P samples"
        )
    tau = config["TAU"]
    if tau is not None and not (_is_number(tau) and 0 < tau < math.inf):
        raise DistributedClipError(
            f"config['TAU']={tau!r}: must be a finite number > 0 (e.g. 0.07), or None to learn logit_scale"
        )
    objective = _objective(config.get("LOSS", "clip"))
    fixed_bias = config.get("BIAS")
    if fixed_bias is not None and not (_is_number(fixed_bias) and math.isfinite(fixed_bias)):
        raise DistributedClipError(
            f"config['BIAS']={fixed_bias!r}: must be a finite number (e.g. -10), or None to learn logit_bias"
        )
    if not objective.has_bias and fixed_bias is not None:
        raise DistributedClipError(f"config['BIAS']={fixed_bias!r}: {objective.describe()} has no bias")
    max_scale = config.get("MAX_LOGIT_SCALE")
    if max_scale is not None and not (_is_number(max_scale) and 0 < max_scale < math.inf):
        raise DistributedClipError(
            f"config['MAX_LOGIT_SCALE']={max_scale!r}: must be a finite number > 0 (the largest temperature "
            "t = 1/TAU, e.g. 100 as in CLIP), or None for no clamp"
        )
    kernel = config.get("KERNEL", "auto")
    try:
        require_kernel(kernel)
    except (ValueError, ImportError) as e:
        raise DistributedClipError(str(e).replace("loss.kernel=", "config['KERNEL']=")) from None
    unwrapped = _unwrap(model)
    logit_scale, logit_bias = getattr(unwrapped, "logit_scale", None), getattr(unwrapped, "logit_bias", None)

    def from_model(param: Tensor | None, name: str, place: str) -> Tensor | None:
        if param is not None and hasattr(param, "placements"):  # a DTensor shard: FSDP2 unshards it only inside forward
            raise DistributedClipError(f"FSDP2 shards {name} outside forward; return it as forward's {place} output")
        return param

    def encode(mb: tuple[Tensor, Tensor]) -> tuple[Tensor | None, ...]:
        out = model(*mb)
        zx, zy = out[0], out[1]
        if k:  # [b, 1 + k, d]: each sample's positive, then its negatives
            zy = zy.reshape(len(zx), 1 + k, zy.shape[-1])
        scale = out[2] if len(out) > 2 else None
        bias = out[3] if len(out) > 3 else None
        if scale is None and tau is None and logit_scale is not None:
            scale = from_model(logit_scale, "logit_scale", "third").exp()
        if bias is None and fixed_bias is None and objective.has_bias:
            bias = from_model(logit_bias, "logit_bias", "fourth")
        if scale is not None and max_scale is not None:
            scale = scale.clamp(max=max_scale)
        return zx, zy, scale, bias

    step = StreamingClipStep(
        stream_chunk_size=chunk,
        group=dist.group.WORLD if world > 1 else None,
        grad_average_factor=world if wrapped else 1,
        fixed_scale=None if tau is None else 1.0 / tau,
        kernel=kernel,
        objective=objective,
        fixed_bias=None if fixed_bias is None else float(fixed_bias),
    )
    microbatches = [
        (local_x[i : i + micro], local_y[i * (1 + k) : (i + micro) * (1 + k)]) for i in range(0, len(local_x), micro)
    ]
    optimizer.zero_grad(set_to_none=True)
    # DDP reduces after the last microbatch only; FSDP2 reduce-scatters every one (its memory saving)
    loss = step(encode, microbatches, grad_sync=lambda is_last: grad_sync(model, is_last, defer_fsdp=False))
    optimizer.step()
    return loss.item()
