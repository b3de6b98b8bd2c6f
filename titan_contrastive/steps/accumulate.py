"""Plain gradient accumulation (seed 004): per microbatch one forward, the loss / k, one backward.

With `[loss] negatives = "microbatch"` each microbatch (with the other DP ranks' current ones,
gathered with gradient) is one contrastive problem; `RescaleAccumulatedLoss` divides each by the
k accumulation steps, so `.grad` ends as the mean of the k problems' gradients. The data-parallel
reduction runs in the last microbatch's backward only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from titan_contrastive.config import JobConfig
from titan_contrastive.losses import Objective
from titan_contrastive.steps.base import Batch, ContrastiveLog, StepContext
from titan_contrastive.steps.contrastive import chunk_knob, microbatch_problem, train_loss

__all__ = ["AccumulateStep"]


class AccumulateStep(ContrastiveLog):
    """k x (forward, loss / k, backward); `loss_fn` is already divided by k (RescaleAccumulatedLoss);
    `objective` describes it for the start log; `ids`: the loss takes the documents' ids (`ids=`; a
    run with a guide also hands it the guide's embeddings, `StepContext.loss_inputs`)."""

    def __init__(
        self, ctx: StepContext, loss_fn: Callable[..., Tensor], objective: str = "given loss", *, ids: bool = False
    ) -> None:
        self.ctx, self.loss_fn, self.objective, self.ids = ctx, loss_fn, objective, ids

    @classmethod
    def build(cls, ctx: StepContext, cfg: JobConfig, objective: Objective, knobs: dict[str, int]) -> AccumulateStep:
        return cls(ctx, train_loss(ctx, objective), objective.describe(), ids=objective.needs_ids)

    def microbatch(self, batch: Batch, is_last: bool = True) -> Tensor:
        """One microbatch: forward, rescaled loss, backward into .grad (reduced if `is_last`)."""
        with self.ctx.grad_sync(is_last):
            loss = self.loss_fn(*self.ctx.encode(batch), **self.ctx.loss_inputs(batch, self.ids))
            self.ctx.backward(loss)
        return loss.detach()

    def __call__(self, microbatches: Sequence[Batch]) -> float:
        losses = [self.microbatch(mb, is_last=i == len(microbatches) - 1) for i, mb in enumerate(microbatches)]
        return torch.stack(losses).sum().item()  # each is already / k: the sum is the mean

    def describe(self) -> str:
        return microbatch_problem(self.ctx, self.objective, None)

    def knobs(self) -> dict[str, list[int]]:
        return chunk_knob(self.ctx)
