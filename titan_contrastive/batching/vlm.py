"""VLM-aware chunking (seed 000, sections 5 and 6).

Qwen-VL-style processors pack the patches of all images of a batch into one tensor:
`pixel_values` is [total_patches, ...], not [batch, ...], and `image_grid_thw` [num_images, 3]
gives each image's (t, h, w) grid, so image i owns t*h*w consecutive rows. Splitting such a
batch on dim 0 cuts images apart; `split_vlm_inputs` cuts on image boundaries instead.
(Unpacking a retrieval batch into query / positive / negative sides is a data concern:
`titan_contrastive.datasets.retrieval.unpack_batch`.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .inputs import BatchError, split_inputs, take_chunks

__all__ = ["IMAGE_FIELDS", "split_vlm_inputs", "take_vlm_chunks"]

IMAGE_FIELDS = ("pixel_values", "image_grid_thw")
"""The entries of a packed image batch: the patches and each image's (t, h, w) grid."""


def split_vlm_inputs(
    inputs: Any, chunk_size: int, images_per_sample: Sequence[int] | Tensor | None = None
) -> list[Any]:
    """Chunks of `chunk_size` samples; packed `pixel_values` split by `image_grid_thw` patch counts.

    Without both `pixel_values` and `image_grid_thw` (text only, CLIP-style [B, C, H, W] images, a
    plain Tensor) every tensor is split on dim 0. With them, the sample count is the batch size
    of `input_ids` (or the number of images); each sample has one image unless
    `images_per_sample` says otherwise.
    """
    if not isinstance(inputs, Mapping) or inputs.get("pixel_values") is None or inputs.get("image_grid_thw") is None:
        return split_inputs(inputs, chunk_size, "inputs")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise BatchError(f"chunk size {chunk_size!r}: must be an integer >= 1")
    grid: Tensor = inputs["image_grid_thw"]
    pixels: Tensor = inputs["pixel_values"]
    patches = grid.long().prod(dim=1)  # t*h*w per image
    if int(patches.sum()) != pixels.shape[0]:
        raise BatchError(
            f"image_grid_thw gives {int(patches.sum())} patches (sum of t*h*w) "
            f"but pixel_values has {pixels.shape[0]} rows"
        )
    ids = inputs.get("input_ids")
    if ids is not None:
        samples = ids.shape[0]
    else:
        samples = len(images_per_sample) if images_per_sample is not None else len(grid)
    counts = torch.as_tensor(images_per_sample if images_per_sample is not None else [1] * samples, dtype=torch.long)
    if len(counts) != samples or int(counts.sum()) != len(grid):
        raise BatchError(
            f"{len(grid)} images (image_grid_thw rows) for {samples} samples: pass images_per_sample "
            f"(one count per sample, summing to {len(grid)}) when samples do not have exactly one image each"
            if images_per_sample is None
            else f"images_per_sample has {len(counts)} entries summing to {int(counts.sum())}; "
            f"need {samples} entries summing to {len(grid)}"
        )
    image_end = torch.cumsum(counts, 0)  # images of samples [0, s) are grid rows [0, image_end[s-1])
    patch_end = torch.cumsum(patches, 0)
    batch_keys = {
        k
        for k, v in inputs.items()
        if isinstance(v, Tensor) and k not in IMAGE_FIELDS and v.dim() and v.shape[0] == samples
    }
    odd = [k for k, v in inputs.items() if isinstance(v, Tensor) and k not in IMAGE_FIELDS and k not in batch_keys]
    if odd:
        raise BatchError(
            f"tensors {odd} have no batch dimension of {samples} samples; "
            "only pixel_values and image_grid_thw may be packed"
        )
    chunks = []
    for start in range(0, samples, chunk_size):
        stop = min(start + chunk_size, samples)
        img0 = int(image_end[start - 1]) if start else 0
        img1 = int(image_end[stop - 1])
        px0 = int(patch_end[img0 - 1]) if img0 else 0
        px1 = int(patch_end[img1 - 1]) if img1 else 0
        chunk = {k: (v[start:stop] if k in batch_keys else v) for k, v in inputs.items()}
        chunk["image_grid_thw"] = grid[img0:img1]
        chunk["pixel_values"] = pixels[px0:px1]
        chunks.append(chunk)
    return chunks


def take_vlm_chunks(inputs: Any, order: Tensor, sizes: Sequence[int], what: str = "input") -> list[Any]:
    """`batching.take_chunks` (chunks of a permutation of the samples) for packed inputs too: with
    `pixel_values` and `image_grid_thw` (one image per sample), each chunk gets its samples' patch
    rows, image after image in the chunk's order; anything else goes to `take_chunks`."""
    if not isinstance(inputs, Mapping) or inputs.get("pixel_values") is None or inputs.get("image_grid_thw") is None:
        return take_chunks(inputs, order, sizes, what)
    grid: Tensor = inputs["image_grid_thw"]
    pixels: Tensor = inputs["pixel_values"]
    patches = grid.long().prod(dim=1)
    if int(patches.sum()) != pixels.shape[0]:
        raise BatchError(
            f"{what}: image_grid_thw gives {int(patches.sum())} patches but pixel_values has {pixels.shape[0]} rows"
        )
    samples = len(grid)
    rest = {k: v for k, v in inputs.items() if k not in IMAGE_FIELDS}
    starts = torch.cumsum(patches, 0) - patches
    chunks = take_chunks({**rest, "image_grid_thw": grid}, order, list(sizes), what) if rest else None
    out, at = [], 0
    for i, size in enumerate(sizes):
        rows = order[at : at + size].tolist()
        at += size
        if any(not 0 <= r < samples for r in rows):
            raise BatchError(f"{what}: sample rows {rows} outside the batch of {samples} images")
        pixel_rows = torch.cat([torch.arange(int(starts[r]), int(starts[r] + patches[r])) for r in rows])
        chunk = dict(chunks[i]) if chunks is not None else {"image_grid_thw": grid[rows]}
        chunk["pixel_values"] = pixels.index_select(0, pixel_rows.to(pixels.device))
        out.append(chunk)
    return out
