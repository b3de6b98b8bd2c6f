"""Losses, all readable in one place, and the gradient-accumulation rescaling wrapper.

Gradient accumulation and contrastive losses
--------------------------------------------
`RescaleAccumulatedLoss` divides each microbatch loss by the number of accumulation steps k,
so the summed gradients are the mean of the k microbatch gradients. For a per-sample loss
(MSE, pixel loss) with equal microbatches that *is* the big-batch gradient. For InfoNCE it is
not: a microbatch only sees its own negatives, so accumulating k microbatches of b samples
trains on k problems of b, never one problem of k*b. The trainer therefore names the choice
(`[loss] negatives`): "microbatch" is this wrapper around `ClipLoss`; "global" (one exact
problem over the global batch) needs the streaming loss and GradCache.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titan_contrastive.parallelisms.collectives import all_gather_with_grad


class RescaleAccumulatedLoss:
    """Wrap a training loss so each call returns `loss / accumulation_steps`.

    Only the training loss is wrapped; evaluation builds its own, unwrapped loss so a
    validation number can never be silently divided by k. `no_rescale()` turns the division
    off temporarily (e.g. to log the raw value of a microbatch).
    """

    def __init__(self, unwrapped_loss_fn: Callable[..., torch.Tensor], accumulation_steps: int) -> None:
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps={accumulation_steps} must be >= 1")
        self.unwrapped_loss_fn = unwrapped_loss_fn
        self.accumulation_steps = accumulation_steps
        self.skip_rescale = False
        functools.update_wrapper(self, unwrapped_loss_fn, updated=())

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        loss = self.unwrapped_loss_fn(*args, **kwargs)
        return loss if self.skip_rescale else loss / self.accumulation_steps

    @contextlib.contextmanager
    def no_rescale(self) -> Iterator[None]:
        """Return the raw loss inside the block (restores the previous setting on exit)."""
        previous, self.skip_rescale = self.skip_rescale, True
        try:
            yield
        finally:
            self.skip_rescale = previous


def clip_loss(image_emb: torch.Tensor, text_emb: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE: mean of image->text and text->image cross-entropy, pair i <-> i.

    Dense reference: materialises the N x N logits, so use it for batches that fit.
    """
    if image_emb.shape != text_emb.shape:
        raise ValueError(f"image embeddings {tuple(image_emb.shape)} and text embeddings {tuple(text_emb.shape)} must have the same shape")
    logits = logit_scale * image_emb @ text_emb.T
    labels = torch.arange(logits.shape[0], device=logits.device)
    return 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels))


class ClipLoss:
    """CLIP loss over the microbatches of all ranks of `group` (open_clip's gather-with-grad).

    Each rank all-gathers the embeddings *with* gradient and computes the same loss over the
    gathered batch. Backward of the gather sums every rank's gradient for the local rows
    (P times dL/dz_local), and DDP's mean over P ranks then gives exactly dL/dtheta of the
    gathered problem. With no group (or one process) it is `clip_loss` on the local batch.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1

    def __call__(self, image_emb: torch.Tensor, text_emb: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            image_emb = all_gather_with_grad(image_emb, self.group)
            text_emb = all_gather_with_grad(text_emb, self.group)
        return clip_loss(image_emb, text_emb, logit_scale)


LOSSES: dict[str, Callable[[dist.ProcessGroup | None], Callable[..., torch.Tensor]]] = {"clip": ClipLoss}


def build_loss_fn(name: str, group: dist.ProcessGroup | None = None) -> Callable[..., torch.Tensor]:
    """Build a loss by name; `group` is the data-parallel group whose microbatches share negatives."""
    if name not in LOSSES:
        raise ValueError(f"loss.name={name!r} is not a known loss; valid: {', '.join(LOSSES)}")
    return LOSSES[name](group)
