"""The pixel-loss step (the vae family's): the masked pixel loss of the global batch, exactly,
under gradient accumulation and data parallelism (seed 003 + seed 004).

Why a step of its own: a masked mean is not a per-sample mean. With variable-size images the
microbatches score different numbers of pixels, so averaging k microbatch means (what
`RescaleAccumulatedLoss` does) is not the global batch's loss. The denominators depend only on
the masks, so they are known before any compute.

Order of operations:
1. D_j = C · Σ mask over microbatch j; D = Σ_j D_j all-reduced over the DP ranks;
2. per microbatch: the model returns its masked mean L_j (the decoder runs in chunks inside the
   model, per its args' `pixel_loss` options, or at the memory planner's `decode_chunk`); backward
   of L_j · w_j with w_j = D_j / D · dp_degree, the factor DDP / FSDP2 gradient averaging divides
   by again; gradient sync only on the last one;
3. the logged loss Σ_j L_j · D_j / D, all-reduced: the global batch's masked mean.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from titan_contrastive.components.memory_planner import doubling
from titan_contrastive.components.pixel_loss import MIN_DENOMINATOR, PixelLossOptions
from titan_contrastive.config import ConfigError, JobConfig
from titan_contrastive.steps.base import Batch, StepContext

__all__ = ["DECODE_KNOB", "PixelStep"]

DECODE_KNOB = "pixel_loss.chunk_size"


class PixelStep:
    """The masked pixel loss of the global batch; `decode_chunk` (the planner's knob) fixes the
    images per decoder call, else the model's args decide."""

    def __init__(self, ctx: StepContext, decode_chunk: int | None = None) -> None:
        self.ctx, self.decode_chunk = ctx, decode_chunk
        # what the vae decodes with ([pixel_loss] via its args)
        self.options: PixelLossOptions = ctx.model.args.pixel_loss

    @classmethod
    def build(cls, ctx: StepContext, cfg: JobConfig, objective: None, knobs: dict[str, int]) -> PixelStep:
        """Refuses what cannot work: contrastive settings, and a decoder backward inside the
        forward where FSDP2 or float16 loss scaling are on."""
        if cfg.loss.negatives == "global" or cfg.gradcache.enabled:
            raise ConfigError(
                f"model.name={ctx.family} trains with the pixel loss; loss.negatives=global and gradcache.enabled "
                "are for contrastive losses: set loss.negatives=microbatch and gradcache.enabled=false"
            )
        options: PixelLossOptions = ctx.model.args.pixel_loss
        if options.mode == "per_chunk_backward" and isinstance(ctx.model, FSDPModule):
            raise ConfigError(
                "pixel_loss.mode=per_chunk_backward runs the decoder's backward inside the forward, which FSDP2 does "
                "not allow; use DDP (--parallelism.data_parallel_replicate_degree=-1 "
                "--parallelism.data_parallel_shard_degree=1) or pixel_loss.mode=chunked"
            )
        if options.mode == "per_chunk_backward" and ctx.precision.scaler is not None:
            raise ConfigError(
                "pixel_loss.mode=per_chunk_backward does not support float16 loss scaling; "
                "use training.mixed_precision_param=bfloat16 or pixel_loss.mode=chunked"
            )
        return cls(ctx, decode_chunk=knobs.get(DECODE_KNOB))

    def __call__(self, microbatches: Sequence[Batch]) -> float:
        ctx, dp_degree = self.ctx, self.ctx.dp_degree
        channels = ctx.model.args.in_channels
        dens = torch.stack([mb["mask"].to(ctx.device, torch.float64).sum() * channels for mb in microbatches])
        total = dens.sum()
        if ctx.dp_group is not None:
            dist.all_reduce(total, group=ctx.dp_group)
        loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
        weights = (dens / total.clamp_min(MIN_DENOMINATOR) * dp_degree).tolist()  # one host sync
        for j, (mb, weight) in enumerate(zip(microbatches, weights)):
            with ctx.grad_sync(j == len(microbatches) - 1):
                loss = ctx.run(mb, backward_scale=weight, decode_chunk=self.decode_chunk)[0]
                ctx.backward(loss * weight)
            loss_sum += loss.detach().double() * weight / dp_degree
        if ctx.dp_group is not None:
            dist.all_reduce(loss_sum, group=ctx.dp_group)
        return loss_sum.item()

    def describe(self) -> str:
        px = self.options
        chunks = self.decode_chunk or ("adaptive size" if px.adaptive else px.chunk_size)
        return (
            f"pixel loss: masked {px.loss_type} mean over the global batch, decoder mode {px.mode}, chunks of {chunks}"
        )

    def knobs(self) -> dict[str, list[int]]:
        """Images per decoder call: 1, 2, 4, ... up to the microbatch (adaptive off)."""
        return {DECODE_KNOB: doubling(1, self.ctx.local_batch_size)}

    def log_values(self) -> dict[str, float]:
        return {}
