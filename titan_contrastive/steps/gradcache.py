"""GradCache chunks with microbatch negatives (seeds 000 and 002): each microbatch (with all DP
ranks') is still one contrastive problem, but it is forwarded in chunks of `[gradcache]
chunk_sizes` samples, so activation memory is one chunk's whatever the microbatch.

Per microbatch, `GradCache.cache_step` over the model's outputs (image embeddings, text
embeddings, exp(logit_scale): one model with several outputs): no-graph forwards, the loss and its
gradient cache, replayed forwards with the surrogate backward. The data-parallel reduction runs
only in the last chunk of the last microbatch.

Text families (a model with `padded_inputs`: {batch key: pad id}, the bi_encoder) get token-aware
chunks: each chunk cut to its longest sequence, and with `[gradcache] chunk_tokens` chunks of
length-sorted samples packed to a token budget, their embeddings put back in batch order before
the loss (`batching.tokens`). Every DP rank then runs as many chunks as the rank with the most.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from titan_contrastive.config import ConfigError, JobConfig
from titan_contrastive.grad_cache import GradCache, Replay
from titan_contrastive.losses import Objective
from titan_contrastive.steps.base import Batch, ContrastiveLog, StepContext
from titan_contrastive.steps.contrastive import (
    CHUNK_KNOB,
    chunk_knob,
    gradcache_chunk,
    microbatch_problem,
    train_loss,
)

__all__ = ["GradCacheStep"]


def _planner_error(tokens: int) -> ConfigError:
    return ConfigError(
        f"gradcache.chunk_tokens={tokens} sets the chunks by a token budget; the memory planner "
        "(memory.budget_gib) plans gradcache.chunk_sizes: use one of them"
    )


class GradCacheStep(ContrastiveLog):
    def __init__(
        self,
        ctx: StepContext,
        loss_fn: Callable[..., Tensor],
        chunk_size: int,
        objective: str = "given loss",
        *,
        chunk_tokens: int = 0,
        pad_ids: Mapping[str, int] | None = None,
        ids: bool = False,
    ) -> None:
        self.ctx, self.loss_fn, self.chunk_size, self.objective = ctx, loss_fn, chunk_size, objective
        self.chunk_tokens, self.pad_ids, self.ids = chunk_tokens, dict(pad_ids or {}), ids

    @classmethod
    def build(cls, ctx: StepContext, cfg: JobConfig, objective: Objective, knobs: dict[str, int]) -> GradCacheStep:
        chunk = gradcache_chunk(ctx, cfg, knobs)
        assert chunk is not None, (
            "GradCacheStep needs a chunk size (steps.build_gradient_step picks AccumulateStep otherwise)"
        )
        tokens, pad_ids = cfg.gradcache.chunk_tokens, ctx.pad_ids
        if tokens and not pad_ids:
            raise ConfigError(
                f"gradcache.chunk_tokens={tokens}: the {ctx.family or 'model'} family's inputs are not padded token "
                "ids (its model declares no padded_inputs); token budgets are for text families such as bi_encoder: "
                "set gradcache.chunk_tokens=0"
            )
        if tokens and CHUNK_KNOB in knobs:
            raise _planner_error(tokens)
        return cls(
            ctx,
            train_loss(ctx, objective),
            chunk,
            objective.describe(),
            chunk_tokens=tokens,
            pad_ids=pad_ids,
            ids=objective.needs_ids,
        )

    def outputs(self, *, replay: Replay | None = None, **batch: Tensor) -> tuple[Tensor, ...]:
        """The model's outputs for GradCache: embeddings per sample, the temperature as a 0-dim
        per-step value (GradCache gives its whole gradient to the first chunk). `replay`: in the
        re-forward, the first pass's outputs of the chunk, for the model (`StepContext.encode`)."""
        return tuple(out if out.dim() > 1 else out.reshape(()) for out in self.ctx.encode(batch, replay=replay))

    def __call__(self, microbatches: Sequence[Batch]) -> float:
        losses = []
        precision = self.ctx.precision
        for i, mb in enumerate(microbatches):
            is_last = i == len(microbatches) - 1
            split = None if self.chunk_tokens else self.ctx.layout.split  # token chunks are cut by GradCache itself
            # the model's locked towers reuse the first pass's embeddings
            # the loss sees the representations in batch order, so the batch's document ids (and guide) fit them
            loss_fn = functools.partial(self.loss_fn, **self.ctx.loss_inputs(mb, self.ids, self.chunk_size))
            cache = GradCache(
                [self.outputs],
                self.chunk_size,
                loss_fn,
                split_input_fn=split,
                get_rep_fn=tuple,
                fp16=precision.scaler is not None,
                scaler=precision.scaler,
                sync_context=lambda _model, sync, last=is_last: self.ctx.grad_sync(sync and last),
                chunk_tokens=self.chunk_tokens,
                pad_ids=self.pad_ids,
                group=self.ctx.dp_group,
                replay=True,
            )
            losses.append(cache.cache_step(mb, no_sync_except_last=True).detach())
        return torch.stack(losses).sum().item()  # one host sync per step, not one per microbatch

    def describe(self) -> str:
        if self.chunk_tokens:
            return (
                microbatch_problem(self.ctx, self.objective, None)
                + f"; GradCache: forwards in chunks of <= {self.chunk_tokens} "
                "tokens (length-sorted samples, each chunk cut to its longest sequence)"
            )
        return microbatch_problem(self.ctx, self.objective, self.chunk_size)

    def knobs(self) -> dict[str, list[int]]:
        if self.chunk_tokens:
            raise _planner_error(self.chunk_tokens)
        return chunk_knob(self.ctx)
