"""GradCache chunks with microbatch negatives (seeds 000 and 002): each microbatch (with all DP
ranks') is still one contrastive problem, but it is forwarded in chunks of `[gradcache]
chunk_sizes` samples, so activation memory is one chunk's whatever the microbatch.

Per microbatch, `GradCache.cache_step` over the model's outputs (image embeddings, text
embeddings, exp(logit_scale): one model with several outputs): no-graph forwards, the loss and its
gradient cache, replayed forwards with the surrogate backward. The data-parallel reduction runs
only in the last chunk of the last microbatch.
"""

from __future__ import annotations

from typing import Callable, Sequence

from torch import Tensor

from titan_contrastive.config import JobConfig
from titan_contrastive.grad_cache import GradCache
from titan_contrastive.steps.base import Batch, ContrastiveLog, StepContext
from titan_contrastive.steps.contrastive import chunk_knob, gradcache_chunk, microbatch_problem, train_loss

__all__ = ["GradCacheStep"]


class GradCacheStep(ContrastiveLog):
    def __init__(self, ctx: StepContext, loss_fn: Callable[..., Tensor], chunk_size: int, loss_name: str = "given") -> None:
        self.ctx, self.loss_fn, self.chunk_size, self.loss_name = ctx, loss_fn, chunk_size, loss_name

    @classmethod
    def build(cls, ctx: StepContext, cfg: JobConfig, loss_name: str, knobs: dict[str, int]) -> GradCacheStep:
        chunk = gradcache_chunk(ctx, cfg, knobs)
        assert chunk is not None, "GradCacheStep needs a chunk size (steps.build_gradient_step picks AccumulateStep otherwise)"
        return cls(ctx, train_loss(ctx, loss_name), chunk, loss_name)

    def outputs(self, **batch: Tensor) -> tuple[Tensor, ...]:
        """The model's outputs for GradCache: embeddings per sample, the temperature as a 0-dim
        per-step value (GradCache gives its whole gradient to the first chunk)."""
        return tuple(out if out.dim() > 1 else out.reshape(()) for out in self.ctx.encode(batch))

    def __call__(self, microbatches: Sequence[Batch]) -> float:
        total = 0.0
        precision = self.ctx.precision
        for i, mb in enumerate(microbatches):
            is_last = i == len(microbatches) - 1
            cache = GradCache([self.outputs], self.chunk_size, self.loss_fn, split_input_fn=self.ctx.layout.split, get_rep_fn=tuple,
                              fp16=precision.scaler is not None, scaler=precision.scaler,
                              sync_context=lambda _model, sync, last=is_last: self.ctx.grad_sync(sync and last))
            total += cache.cache_step(mb, no_sync_except_last=True).item()
        return total

    def describe(self) -> str:
        return microbatch_problem(self.ctx, self.loss_name, self.chunk_size)

    def knobs(self) -> dict[str, list[int]]:
        return chunk_knob(self.ctx)
