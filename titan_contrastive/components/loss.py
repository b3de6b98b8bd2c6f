"""Losses, all readable in one place, and the gradient-accumulation rescaling wrapper.

Gradient accumulation and contrastive losses
--------------------------------------------
`RescaleAccumulatedLoss` divides each microbatch loss by the number of accumulation steps k,
so the summed gradients are the mean of the k microbatch gradients. For a per-sample loss
(MSE, pixel loss) with equal microbatches that *is* the big-batch gradient. For InfoNCE it is
not: a microbatch only sees its own negatives, so accumulating k microbatches of b samples
trains on k problems of b, never one problem of k*b. The trainer therefore names the choice
(`[loss] negatives`): "microbatch" is this wrapper around `ClipLoss` / `SigLipLoss`; "global"
(one exact problem over the global batch) needs the streaming loss and GradCache.

The losses, over a contrastive problem of N pairs with L2-normalized embeddings x_i, y_j and the
temperature t = exp(t') the model returns:
- `clip` (symmetric InfoNCE, softmax): L = 1/(2N) sum_i [CE(t x_i . Y, i) + CE(t y_i . X, i)];
- `siglip` (SigLIP's sigmoid loss): l_ij = t <x_i, y_j> + b, z_ij = +1 if i = j else -1,
  L = -(1/N) sum_i sum_j log sigmoid(z_ij l_ij), with a learnable bias b.
`LOSSES` names each with its initial temperature (and bias) and builds its microbatch form.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titan_contrastive.config import ConfigError
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
        raise ValueError(
            f"image embeddings {tuple(image_emb.shape)} and text embeddings {tuple(text_emb.shape)} must have the same "
            "shape"
        )
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


def sigmoid_loss(
    image_emb: torch.Tensor,
    text_emb: torch.Tensor,
    logit_scale: torch.Tensor,
    logit_bias: torch.Tensor,
    first_row: int = 0,
    num_pairs: int | None = None,
) -> torch.Tensor:
    """SigLIP's loss of the rows `image_emb` (global rows first_row, first_row + 1, ...) against all
    columns `text_emb`: -(1/num_pairs) sum over these rows and all columns of log sigmoid(z l).
    With the defaults (all rows, N = len) it is the dense reference, open_clip's formula;
    materialises the rows x N logits."""
    if image_emb.shape[1:] != text_emb.shape[1:]:
        raise ValueError(
            f"image embeddings {tuple(image_emb.shape)} and text embeddings {tuple(text_emb.shape)} must have the same "
            "dim"
        )
    logits = logit_scale * image_emb @ text_emb.T + logit_bias
    rows = torch.arange(first_row, first_row + len(image_emb), device=logits.device)
    signs = torch.where(rows[:, None] == torch.arange(len(text_emb), device=logits.device), 1.0, -1.0).to(logits.dtype)
    return -F.logsigmoid(signs * logits).sum() / (num_pairs or len(image_emb))


class SigLipLoss:
    """The sigmoid loss over the microbatches of all ranks of `group`: this rank's rows against
    every rank's columns (gathered with gradient), never the whole N x N on one rank.

    Each rank's loss is its rows' sum divided by its own batch (open_clip's normalization); the
    gather's backward sums every rank's gradient into the local columns and the data-parallel
    average over P ranks then gives exactly dL/dtheta of the gathered problem. The returned value
    is the mean over ranks (one scalar all-reduce), so every rank logs the problem's loss L; its
    gradient is this rank's share.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if self.world_size > 1 else 0

    def __call__(
        self, image_emb: torch.Tensor, text_emb: torch.Tensor, logit_scale: torch.Tensor, logit_bias: torch.Tensor
    ) -> torch.Tensor:
        if self.world_size == 1:
            return sigmoid_loss(image_emb, text_emb, logit_scale, logit_bias)
        columns = all_gather_with_grad(text_emb, self.group)
        local = sigmoid_loss(image_emb, columns, logit_scale, logit_bias, first_row=self.rank * len(image_emb))
        mean = local.detach().clone()
        dist.all_reduce(mean, group=self.group)
        return local + (mean / self.world_size - local.detach())  # value: L on every rank; gradient: this rank's share


@dataclass(frozen=True)
class LossSpec:
    """A contrastive loss by name: how to build its microbatch form over a DP group, and the
    temperature (and bias) a model starts from for it."""

    build: Callable[[dist.ProcessGroup | None], Callable[..., torch.Tensor]]
    init_logit_scale: float
    init_logit_bias: float | None = None
    """None: the loss has no bias (the model returns none)."""


LOSSES: dict[str, LossSpec] = {
    "clip": LossSpec(ClipLoss, init_logit_scale=math.log(1 / 0.07)),
    "siglip": LossSpec(SigLipLoss, init_logit_scale=math.log(10.0), init_logit_bias=-10.0),  # SigLIP's init
}


def build_loss_fn(name: str, group: dist.ProcessGroup | None = None) -> Callable[..., torch.Tensor]:
    """Build a loss by name; `group` is the data-parallel group whose microbatches share negatives."""
    if name not in LOSSES:
        raise ValueError(f"loss.name={name!r} is not a known loss; valid: {', '.join(LOSSES)}")
    return LOSSES[name].build(group)


class Temperature(NamedTuple):
    """The temperature (and bias) a contrastive model starts from, and which of them train."""

    init_logit_scale: float
    init_logit_bias: float | None
    learn_logit_scale: bool
    learn_logit_bias: bool


def temperature_from_config(cfg: Any, default_logit_scale: float | None = None) -> Temperature:
    """`[loss] init_logit_scale / init_logit_bias / learn_*` for a model's args; unset values come
    from the loss (`LOSSES`), or `default_logit_scale` (a pretrained family's own). A bias for a
    loss without one is a one-line error (it would be silently unused)."""
    name, loss = cfg.loss.name or "clip", cfg.loss
    spec = LOSSES[name]
    if spec.init_logit_bias is None and loss.init_logit_bias is not None:
        raise ConfigError(
            f"loss.init_logit_bias={loss.init_logit_bias}: loss.name={name!r} has no bias; "
            "use --loss.name=siglip or leave loss.init_logit_bias empty"
        )
    scale = (
        loss.init_logit_scale
        if loss.init_logit_scale is not None
        else (spec.init_logit_scale if default_logit_scale is None else default_logit_scale)
    )
    bias = spec.init_logit_bias if loss.init_logit_bias is None else loss.init_logit_bias
    return Temperature(scale, bias, loss.learn_logit_scale, loss.learn_logit_bias)
