"""VLM-aware chunking (seed 000, sections 5 and 6).

Qwen-VL-style processors pack the patches of all images of a batch into one tensor:
`pixel_values` is [total_patches, ...], not [batch, ...], and `image_grid_thw` [num_images, 3]
gives each image's (t, h, w) grid, so image i owns t*h*w consecutive rows. Splitting such a
batch on dim 0 cuts images apart; `split_vlm_inputs` cuts on image boundaries instead.
(Unpacking a retrieval batch into query / positive / negative sides is a data concern:
`titan_contrastive.datasets.retrieval.unpack_batch`.)
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .inputs import BatchError, batch_size, split_inputs, take_chunks

__all__ = ["IMAGE_FIELDS", "interleave_images", "split_sides", "split_vlm_inputs", "take_vlm_chunks"]

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


def _packed_groups(inputs: Mapping[str, Any]) -> list[str]:
    """The prefixes of the packed image groups in `inputs`: "" for `pixel_values` + `image_grid_thw`,
    "query_" for `query_pixel_values` + `query_image_grid_thw`, and so on."""
    return [
        key[: -len("pixel_values")]
        for key, value in inputs.items()
        if key.endswith("pixel_values")
        and isinstance(value, Tensor)
        and inputs.get(f"{key[:-12]}image_grid_thw") is not None
    ]


def take_vlm_chunks(inputs: Any, order: Tensor, sizes: Sequence[int], what: str = "input") -> list[Any]:
    """`batching.take_chunks` (chunks of a permutation of the samples) for packed inputs too: each
    packed group (`pixel_values` + `image_grid_thw`, or per side `query_pixel_values` +
    `query_image_grid_thw`, ...) holds its samples' images sample after sample, the same number m each
    (m = 1; 0 for a side without images; k for k hard negative images each) or, where the group has
    `{group}image_counts` [samples], that many each (rows of several retrieval modes); each chunk gets
    its samples' grid and patch rows in the chunk's order; the other tensors (the counts too) are
    batch-major. Without a packed group this is `take_chunks`."""
    groups = _packed_groups(inputs) if isinstance(inputs, Mapping) else []
    if not groups:
        return take_chunks(inputs, order, sizes, what)
    packed = {f"{g}{f}" for g in groups for f in IMAGE_FIELDS}
    rest = {k: v for k, v in inputs.items() if k not in packed}
    samples = len(order)
    rows: dict[str, tuple[Tensor, Tensor, Tensor, Tensor]] = {}
    for g in groups:
        grid, pixels = inputs[f"{g}image_grid_thw"], inputs[f"{g}pixel_values"]
        patches = grid.long().prod(dim=1)
        if int(patches.sum()) != pixels.shape[0]:
            raise BatchError(
                f"{what}: {g}image_grid_thw gives {int(patches.sum())} patches but {g}pixel_values has "
                f"{pixels.shape[0]} rows"
            )
        counts = inputs.get(f"{g}image_counts")
        if counts is None:
            if samples and len(grid) % samples:
                raise BatchError(
                    f"{what}: {len(grid)} images in {g}image_grid_thw for {samples} samples; the same number each, "
                    f"or each sample's in {g}image_counts"
                )
            counts = torch.full((samples,), len(grid) // samples if samples else 0, dtype=torch.long)
        elif len(counts) != samples or int(counts.sum()) != len(grid):
            raise BatchError(
                f"{what}: {g}image_counts gives {len(counts)} samples and {int(counts.sum())} images, the batch "
                f"{samples} and {len(grid)}"
            )
        counts = counts.long().cpu()
        rows[g] = (torch.cumsum(patches, 0) - patches, patches, torch.cumsum(counts, 0) - counts, counts)
    chunks = take_chunks(rest, order, list(sizes), what) if rest else [{} for _ in sizes]
    out, at = [], 0
    for chunk, size in zip(chunks, sizes):
        members = order[at : at + size].tolist()
        at += size
        chunk = dict(chunk)
        for g in groups:
            grid, pixels = inputs[f"{g}image_grid_thw"], inputs[f"{g}pixel_values"]
            if not len(grid):  # a side without images
                chunk[f"{g}image_grid_thw"], chunk[f"{g}pixel_values"] = grid, pixels
                continue
            starts, sizes_, first, counts = rows[g]
            images = [int(first[r]) + i for r in members for i in range(int(counts[r]))]
            index = [torch.arange(int(starts[j]), int(starts[j] + sizes_[j])) for j in images]
            chunk[f"{g}image_grid_thw"] = grid[images]
            rows_of = torch.cat(index) if index else torch.zeros(0, dtype=torch.long)  # a chunk of none: empty
            chunk[f"{g}pixel_values"] = pixels.index_select(0, rows_of.to(pixels.device))
        out.append(chunk)
    return out


def split_sides(inputs: Any, chunk_size: int) -> list[Any]:
    """Consecutive chunks of `chunk_size` samples (the last may be smaller) of a batch whose packed
    groups are per side (`query_pixel_values` + `query_image_grid_thw`, `doc_...`, `neg_...`; the same
    number of images per sample, or none): `take_vlm_chunks` in batch order, each image's patches kept
    whole. Without a packed group this is `split_inputs`."""
    groups = _packed_groups(inputs) if isinstance(inputs, Mapping) else []
    if not groups:
        return split_inputs(inputs, chunk_size, "inputs")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise BatchError(f"chunk size {chunk_size!r}: must be an integer >= 1")
    packed = {f"{g}{f}" for g in groups for f in IMAGE_FIELDS}
    rest = {k: v for k, v in inputs.items() if k not in packed and isinstance(v, Tensor)}
    samples = batch_size(rest, "inputs") if rest else max(len(inputs[f"{g}image_grid_thw"]) for g in groups)
    sizes = [min(chunk_size, samples - start) for start in range(0, samples, chunk_size)]
    return take_vlm_chunks(inputs, torch.arange(samples), sizes, "inputs")


def interleave_images(pixels: Tensor, grid: Tensor, neg_pixels: Tensor, neg_grid: Tensor) -> tuple[Tensor, Tensor]:
    """The packed images of the documents and their hard negatives in `with_negatives`' order: document by
    document, its image then its k negatives' (patch rows and grid rows alike). Every document with an image
    has k negatives with one each (a row's negatives are of its documents' kind), so rows without (rows of
    another mode, `[data] retrieval_modes`) change nothing: their documents have none to place."""
    b = len(grid)
    k = len(neg_grid) // b
    both = torch.cat([grid, neg_grid])
    order = torch.cat([torch.arange(b).unsqueeze(1), b + torch.arange(b * k).view(b, k)], 1).flatten()
    patches = both.long().prod(-1).tolist()  # a host read, as the vision tower's own (it sizes its attention)
    starts = list(itertools.accumulate(patches, initial=0))
    rows = torch.cat([torch.arange(starts[i], starts[i] + patches[i]) for i in order.tolist()])
    return torch.cat([pixels, neg_pixels]).index_select(0, rows.to(pixels.device)), both[order.to(both.device)]
