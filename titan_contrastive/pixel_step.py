"""The vae family's train step: the masked pixel loss of the global batch, exactly, under
gradient accumulation and data parallelism (seed 003 + seed 004).

Why a step of its own: a masked mean is not a per-sample mean. With variable-size images the
microbatches score different numbers of pixels, so averaging k microbatch means (what
`RescaleAccumulatedLoss` does) is not the global batch's loss. The denominators depend only on
the masks, so they are known before any compute.

Order of operations:
1. D_j = C · Σ mask over microbatch j; D = Σ_j D_j all-reduced over the DP ranks;
2. per microbatch: the model returns its masked mean L_j (the decoder runs in chunks inside the
   model, per `[pixel_loss] mode`); backward of L_j · w_j with w_j = D_j / D · dp_degree, the
   factor DDP / FSDP2 gradient averaging divides by again; gradient sync only on the last one;
3. the logged loss Σ_j L_j · D_j / D, all-reduced: the global batch's masked mean.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.distributed as dist

from titan_contrastive.components.pixel_loss import MIN_DENOMINATOR
from titan_contrastive.config import ConfigError, JobConfig

__all__ = ["PixelStep", "pixel_loss_options"]


def pixel_loss_options(cfg: JobConfig, *, fsdp: bool, fp16_scaler: bool) -> dict[str, Any]:
    """`compute_pixel_loss` keywords from `[pixel_loss]`; combinations that cannot work are refused."""
    px = cfg.pixel_loss
    if cfg.loss.negatives == "global" or cfg.gradcache.enabled:
        raise ConfigError(f"model.name={cfg.model.name} trains with the pixel loss; loss.negatives=global and gradcache.enabled "
                          "are for contrastive losses: set loss.negatives=microbatch and gradcache.enabled=false")
    if px.mode == "per_chunk_backward" and fsdp:
        raise ConfigError("pixel_loss.mode=per_chunk_backward runs the decoder's backward inside the forward, which FSDP2 does "
                          "not allow; use DDP (--parallelism.data_parallel_replicate_degree=-1 "
                          "--parallelism.data_parallel_shard_degree=1) or pixel_loss.mode=chunked")
    if px.mode == "per_chunk_backward" and fp16_scaler:
        raise ConfigError("pixel_loss.mode=per_chunk_backward does not support float16 loss scaling; "
                          "use training.mixed_precision_param=bfloat16 or pixel_loss.mode=chunked")
    return dict(mode=px.mode, loss_type=px.loss_type, chunk_size=px.chunk_size, adaptive=px.adaptive,
                empty_cache_every=px.empty_cache_every)


class PixelStep:
    """Callable per train step; `forward(batch, backward_scale) -> microbatch masked mean`."""

    def __init__(self, *, channels: int, dp_degree: int, device: torch.device, distributed: bool) -> None:
        self.channels, self.dp_degree, self.device, self.distributed = channels, dp_degree, device, distributed

    def __call__(self, forward: Callable[[dict[str, torch.Tensor], float], torch.Tensor], microbatches: list[dict[str, torch.Tensor]], *,
                 grad_sync: Callable[[bool], contextlib.AbstractContextManager], backward: Callable[[torch.Tensor], None]) -> float:
        dens = torch.stack([mb["mask"].to(self.device, torch.float64).sum() * self.channels for mb in microbatches])
        total = dens.sum()
        if self.distributed:
            dist.all_reduce(total)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        weights = (dens / total.clamp_min(MIN_DENOMINATOR) * self.dp_degree).tolist()  # one host sync
        for j, (mb, weight) in enumerate(zip(microbatches, weights)):
            with grad_sync(j == len(microbatches) - 1):
                loss = forward(mb, weight)
                backward(loss * weight)
            loss_sum += loss.detach().double() * weight / self.dp_degree
        if self.distributed:
            dist.all_reduce(loss_sum)
        return loss_sum.item()
