"""Masked pixel loss through a VAE decoder, decoded all at once (v0) or in chunks (seed 003).

    loss = Σ_i Σ_{c,h,w} m_i[h,w] · ℓ(x̂_i[c,h,w], x_i[c,h,w])  /  (C · Σ_i Σ_{h,w} m_i[h,w])

with x̂ = decode(latents) cropped to the padded image size, both sides mapped from [-1, 1] to
[0, 1] and clamped, ℓ = squared (l2/mse) or absolute (l1) difference, and m the per-pixel mask of
padded variable-size images (`datasets.packing.pad_to_batch` builds both). The denominator
depends only on the masks, so it is known before any decoding; below 1e-3 (nothing to score)
the loss is an exact zero that keeps a zero-gradient path to the latents instead of a NaN,
without a host sync.

Modes, order of operations:
- "v0": decode the whole padded batch, one masked sum (the reference for the other modes).
- "chunked": for each chunk of `chunk_size` images decode, add the chunk's masked sum to the
  numerator; one division at the end. What this frees: the *transient* forward buffers of the
  decoder (only one chunk's exist at a time). What it does not: every chunk's graph stays alive
  until the caller's `backward()`, so the activations saved for backward are the same as v0's.
  Peak memory drops to chunk/N of v0's only without a backward (evaluation) or when transient
  buffers dominate.
- "per_chunk_backward": each chunk is decoded from a detached leaf copy of its latents and
  backpropagated at once (numerator_c / denominator — exact, as the denominator is fixed), which
  frees its graph and accumulates the decoder's parameter gradients (if trainable) and the
  leaf's latent gradient. The returned loss injects the cached latent gradients into the
  upstream graph (GradCache's surrogate), so one caller `backward()` reaches the encoder. Peak
  activation memory is one chunk's. Decoder gradients land in `.grad` during the call.

The numerator is accumulated in at least float32, not in the latent dtype: a bf16 running sum
loses the small chunk terms. `PIXEL_LOSS_USE_V0=1` forces v0 whatever the
argument; `PIXEL_LOSS_DEBUG=1` logs one line per call and rank.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "MIN_DENOMINATOR",
    "PixelLossMode",
    "PixelLossOptions",
    "calculate_chunk_size",
    "compute_pixel_loss",
    "compute_pixel_loss_v0",
    "masked_error_sum",
]

logger = logging.getLogger("titan_contrastive")
MIN_DENOMINATOR = 1e-3
PixelLossMode = Literal["v0", "chunked", "per_chunk_backward"]
Decode = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class PixelLossOptions:
    """`compute_pixel_loss`'s keywords, as a model carries them in its args (`VAEArgs.pixel_loss`,
    set from `[pixel_loss]`). The defaults are `compute_pixel_loss`'s."""

    mode: PixelLossMode = "chunked"
    loss_type: str = "l2"
    chunk_size: int = 2
    adaptive: bool = True
    empty_cache_every: int = 0

    def kwargs(self, decode_chunk: int | None = None) -> dict[str, Any]:
        """The keywords for one call; `decode_chunk` fixes the images per decode (adaptive off)."""
        options = self if decode_chunk is None else dataclasses.replace(self, chunk_size=decode_chunk, adaptive=False)
        return dataclasses.asdict(options)


def calculate_chunk_size(
    num_images: int, max_h: int, max_w: int, base_chunk_size: int = 2, adaptive: bool = True
) -> int:
    """Images per decode: a megapixel rule (≥ 1 MP → 1, ≥ 0.25 MP → 2, else 4) when
    `adaptive`, else `base_chunk_size`; never more than `num_images`, never less than 1."""
    if base_chunk_size < 1:
        raise ValueError(f"pixel_loss.chunk_size={base_chunk_size}: must be an integer >= 1")
    if not adaptive:
        size = base_chunk_size
    else:
        megapixels = max_h * max_w / 1e6
        size = 1 if megapixels >= 1.0 else 2 if megapixels >= 0.25 else 4
    return max(1, min(size, num_images))


def _check(latents: Tensor, images: Tensor, masks: Tensor, loss_type: str) -> None:
    if loss_type.lower() not in ("l1", "l2", "mse"):
        raise ValueError(f"pixel_loss.loss_type={loss_type!r}: choose l1, l2 or mse")
    if (
        images.ndim != 4
        or masks.ndim != 4
        or masks.shape[1] != 1
        or masks.shape[0] != images.shape[0]
        or masks.shape[2:] != images.shape[2:]
    ):
        raise ValueError(
            f"images must be [N, C, H, W] and masks [N, 1, H, W] of the same N, H, W; got {list(images.shape)} and "
            f"{list(masks.shape)}"
        )
    if latents.shape[0] != images.shape[0]:
        raise ValueError(f"{latents.shape[0]} latents for {images.shape[0]} images; pass one latent per image")


def masked_error_sum(pred: Tensor, images: Tensor, masks: Tensor, loss_type: str) -> Tensor:
    """Σ m · ℓ over a chunk, in at least float32; pred is cropped to the images' padded size."""
    if pred.shape[2] < images.shape[2] or pred.shape[3] < images.shape[3] or pred.shape[1] != images.shape[1]:
        raise ValueError(
            f"decoded images {list(pred.shape)} are smaller than (or have other channels than) the targets "
            f"{list(images.shape)}"
        )
    acc = torch.promote_types(pred.dtype, torch.float32)
    pred01 = (pred[:, :, : images.shape[2], : images.shape[3]].to(acc) * 0.5 + 0.5).clamp(0, 1)
    gt01 = (images.to(acc) * 0.5 + 0.5).clamp(0, 1)
    diff = (pred01 - gt01).square() if loss_type.lower() in ("l2", "mse") else (pred01 - gt01).abs()
    return (diff * masks.to(acc)).sum()


def _finish(numerator: Tensor, denominator: Tensor) -> Tensor:
    """numerator / denominator, or an exact 0 (with a zero gradient) when nothing is masked in."""
    ok = denominator > MIN_DENOMINATOR
    return torch.where(ok, numerator / denominator.clamp_min(MIN_DENOMINATOR), numerator * 0)


def compute_pixel_loss_v0(
    latents: Tensor, images: Tensor, masks: Tensor, decode: Decode, loss_type: str = "l2"
) -> Tensor:
    """Decode every latent at once, one masked mean: the reference for the other modes."""
    _check(latents, images, masks, loss_type)
    numerator = masked_error_sum(decode(latents), images, masks, loss_type)
    return _finish(numerator, masks.to(numerator.dtype).sum() * images.shape[1])


class _InjectGradient(torch.autograd.Function):
    """Returns `value`; backward hands `grad_out · cached` to `latents` (the GradCache surrogate,
    without the cancellation error of value + <z, g> - <z, g>.detach())."""

    @staticmethod
    def forward(ctx, latents: Tensor, value: Tensor, cached: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(cached)
        return value.clone()

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        (cached,) = ctx.saved_tensors
        return (grad_out * cached).to(cached.dtype), None, None


def compute_pixel_loss(
    latents: Tensor,
    images: Tensor,
    masks: Tensor,
    decode: Decode,
    *,
    loss_type: str = "l2",
    mode: PixelLossMode = "chunked",
    chunk_size: int = 2,
    adaptive: bool = True,
    empty_cache_every: int = 0,
    backward_scale: float = 1.0,
) -> Tensor:
    """The masked pixel loss of `decode(latents)` against `images` ([-1, 1], padded) under `masks`.

    Same value and gradients as `compute_pixel_loss_v0` in every mode (see the module docstring).
    `empty_cache_every` > 0 calls `torch.cuda.empty_cache()` every that many chunks (CUDA only).
    `backward_scale` (per_chunk_backward): the factor the caller will multiply the returned loss
    by before `backward()` (e.g. 1/accumulation steps), applied to the in-call decoder backward.
    """
    if os.environ.get("PIXEL_LOSS_USE_V0", "0") == "1":
        mode = "v0"
    if mode not in ("v0", "chunked", "per_chunk_backward"):
        raise ValueError(f"pixel_loss.mode={mode!r}: choose v0, chunked or per_chunk_backward")
    if mode == "v0":
        loss = compute_pixel_loss_v0(latents, images, masks, decode, loss_type)
        chunk, chunks = len(latents), 1
    else:
        _check(latents, images, masks, loss_type)
        chunk = calculate_chunk_size(len(latents), images.shape[2], images.shape[3], chunk_size, adaptive)
        chunks = -(-len(latents) // chunk)
        acc = torch.promote_types(latents.dtype, torch.float32)
        denominator = masks.to(acc).sum() * images.shape[1]
        numerator = torch.zeros((), dtype=acc, device=latents.device)
        cached = torch.zeros_like(latents) if mode == "per_chunk_backward" else None
        for k, start in enumerate(range(0, len(latents), chunk)):
            rows = slice(start, start + chunk)
            if cached is None:  # chunked: keep the graph, free the forward's transient buffers
                numerator = numerator + masked_error_sum(decode(latents[rows]), images[rows], masks[rows], loss_type)
            else:  # per_chunk_backward: backpropagate this chunk now, keep only gradients
                leaf = latents[rows].detach().requires_grad_(latents.requires_grad)
                part = masked_error_sum(decode(leaf), images[rows], masks[rows], loss_type)
                if part.requires_grad:
                    (_finish(part, denominator) * backward_scale).backward()
                if leaf.grad is not None and backward_scale != 0:  # scale 0: the caller drops this loss
                    cached[rows] = leaf.grad / backward_scale
                numerator = numerator + part.detach()
            if empty_cache_every and (k + 1) % empty_cache_every == 0 and latents.is_cuda:
                torch.cuda.empty_cache()
        loss = _finish(numerator, denominator)
        if cached is not None and latents.requires_grad:
            loss = _InjectGradient.apply(latents, loss, cached)
    if os.environ.get("PIXEL_LOSS_DEBUG", "0") == "1":
        rank = dist.get_rank() if dist.is_initialized() else 0
        logger.info(
            f"[pixel loss] rank {rank} mode {mode} images {len(latents)} resolution "
            f"{images.shape[2]}x{images.shape[3]} "
            f"chunk {chunk} chunks {chunks} denominator {masks.sum().item() * images.shape[1]:.1f} loss "
            f"{loss.item():.6g}"
        )
    return loss
