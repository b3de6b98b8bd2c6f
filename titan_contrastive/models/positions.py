"""A checkpoint's position tables at the run's sizes (`[model] init_from` with another `data.image_size` or
`data.context_length`), so a checkpoint trained at one resolution starts a run at another: tuning at a
higher resolution than the pretraining's, as CLIP's 336 px models were made from 224 px ones, or training at
lower resolutions and shorter captions first, as CLIPA does, or captions longer than 77 tokens, as Long-CLIP.

Images: the class token's row is kept; the g x g patch rows, a grid over the image, are resized to S/p x S/p
with bicubic interpolation (`align_corners=False`). Growing, that is transformers' own
`interpolate_pos_encoding`, so the run's first embeddings equal `get_image_features(...,
interpolate_pos_encoding=True)`; shrinking, the resize is antialiased (each output row a weighted mean over its
footprint, as timm and open_clip resize).

Captions: the text tower is causal and pools at the EOS, so positions after a caption's EOS never reach its
embedding. A shorter context keeps the table's first L rows: a caption of at most L tokens gets the checkpoint's
own embedding. A longer one is Long-CLIP's knowledge-preserved stretching: the first `KEEP` rows (20, where
CLIP's positions are well trained) are kept, and the n - 20 others are stretched over the L - 20 new ones,
row j reading the old table linearly at 20 + (j - 20)(n - 20)/(L - 20) (past the last row, the last
difference continues). At L = 4n - 60 (248 for 77) that is Long-CLIP's own table; captions of at most 20
tokens keep the checkpoint's embedding.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from titan_contrastive.models.weights import WeightsError

if TYPE_CHECKING:
    from titan_contrastive.models.clip.args import CLIPArgs

__all__ = ["KEEP", "fit_positions", "resize_positions", "stretch_positions", "unstretchable"]

logger = logging.getLogger("titan_contrastive")
KEY = "visual.positional_embedding"
TEXT_KEY = "text.positional_embedding"
KEEP = 20
"""Text positions Long-CLIP's stretching keeps as they are."""


def resize_positions(table: Tensor, grid: int, prefix: int = 1) -> Tensor:
    """[prefix + g·g, w] -> [prefix + grid·grid, w]: the class row (`prefix` 1; SigLIP has none), then the patch
    grid resized (see the module)."""
    side = math.isqrt(table.shape[0] - prefix)
    if side * side != table.shape[0] - prefix:
        raise WeightsError(
            f"a position table of {table.shape[0]} rows is not {prefix} class row(s) and a square grid of patches; "
            "it cannot be resized"
        )
    if side == grid:
        return table
    dtype = table.dtype if table.dtype in (torch.float32, torch.float64) else torch.float32
    patches = table[prefix:].to(dtype).T.reshape(1, -1, side, side)
    resized = F.interpolate(patches, size=(grid, grid), mode="bicubic", align_corners=False, antialias=grid < side)
    return torch.cat([table[:prefix], resized.reshape(-1, grid * grid).T.to(table.dtype)])


def unstretchable(n: int) -> str | None:
    """Why a text table of `n` learnt positions cannot be stretched; None where it can (n >= KEEP + 2)."""
    if n >= KEEP + 2:
        return None
    return f"{n} learnt text positions are too few to stretch (Long-CLIP keeps {KEEP} and stretches the rest)"


def stretch_positions(table: Tensor, length: int, keep: int = KEEP) -> Tensor:
    """[n, w] -> [length, w], length > n > keep + 1: the first `keep` rows, then the others stretched linearly
    (see the module)."""
    n = table.shape[0]
    dtype = table.dtype if table.dtype in (torch.float32, torch.float64) else torch.float32
    old = table.to(dtype)
    at = keep + torch.arange(length - keep, dtype=torch.float64) * (n - keep) / (length - keep)
    below = at.floor().long().clamp(max=n - 2)
    frac = (at - below).to(dtype).unsqueeze(1)
    stretched = old[below] + frac * (old[below + 1] - old[below])
    return torch.cat([table[:keep], stretched.to(table.dtype)])


def fit_positions(state: dict[str, Tensor], args: CLIPArgs) -> dict[str, Tensor]:
    """`StateDictAdapter.fit` of the clip family: `state` with its image position table resized to `args`' patch
    grid and its text table cut or stretched to `args.context_length` (each change logged); as it is where they
    fit."""
    state = dict(state)
    table, grid = state.get(KEY), args.image_size // args.patch_size
    if table is not None and table.shape[0] != 1 + grid * grid:
        state[KEY] = resize_positions(table, grid)
        side = math.isqrt(table.shape[0] - 1)
        logger.info(
            f"model.init_from: {KEY} resized from {side}x{side} to {grid}x{grid} patches for {args.image_size} px "
            "images"
        )
    text = state.get(TEXT_KEY)
    n, length = (0, 0) if text is None else (text.shape[0], args.context_length)
    if n > length:
        state[TEXT_KEY] = text[:length]
        logger.info(
            f"model.init_from: {TEXT_KEY} cut from {n} to {length} positions (captions that fit embed as in the "
            "checkpoint)"
        )
    elif n < length:
        if why := unstretchable(n):
            raise WeightsError(
                f"data.context_length={length}: the checkpoint's {why}; set data.context_length to at most {n}"
            )
        state[TEXT_KEY] = stretch_positions(text, length)
        logger.info(
            f"model.init_from: {TEXT_KEY} stretched from {n} to {length} positions (Long-CLIP: the first {KEEP} "
            "kept, the rest stretched)"
        )
    return state
