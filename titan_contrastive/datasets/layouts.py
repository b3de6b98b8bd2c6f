"""How a model family takes its images: the data layout its spec names (`ModelSpec.layout`).

A layout does two things, both the family's business rather than the trainer's:
- `prepare(dataset, args, image_sizes, family)`: ask the dataset to serve batches the way the
  model reads them (at the flavor's patch size or downsampling factor, at the mixed resolutions
  of `[data] image_sizes`), or refuse settings the family cannot read;
- `split(batch, chunk_size)`: cut a batch into chunks of samples for GradCache and the
  global-negatives re-forward, without cutting a sample apart.

IMAGES: [B, C, H, W] at one size (clip, bi_encoder's text pairs); PACKED_PATCHES: Qwen-VL-style
`pixel_values` [total_patches, C·p·p] + `image_grid_thw`, cut on image boundaries (vlm);
MASKED_IMAGES: [-1, 1] images zero-padded to the largest size with a pixel `mask` (vae); PROCESSED:
uint8 images and texts through the family's own processor (`args.processor()`: qwen_vl's token
ids and packed patches per side at native resolution), cut on image boundaries (`split_sides`).
FOLDER_IMAGES: [B, 3, S, S] at the model folder's size, resized with its processor's filter, normalized with
its mean and std, evaluated on the central square or the whole image squashed as its processor does
(`args.image_size`, `resample`, `image_mean`, `image_std`, `whole_image`: hf_clip), from the user's image-text
files; for SigLIP 2 (`args.max_num_patches`), `image` is its processor's NaFlex patches, mask and grids
(`datasets.naflex`).
A processor whose `refusal` is set takes only data that serves both sides (`serves_sides`:
`vl_pairs`), not image-text rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from titan_contrastive.batching import split_inputs, split_sides, split_vlm_inputs
from titan_contrastive.config import ConfigError
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.image_transforms import FILTERS
from titan_contrastive.datasets.naflex import NaFlexImages

__all__ = ["FOLDER_IMAGES", "IMAGES", "MASKED_IMAGES", "PACKED_PATCHES", "PROCESSED", "DataLayout"]


def _one_size(dataset: Any, args: Any, image_sizes: Sequence[int], family: str) -> None:
    if image_sizes:
        raise ConfigError(
            f"data.image_sizes={list(image_sizes)}: mixed resolutions need a family that reads packed patches "
            f"or masks (model.name=vlm or vae); {family} takes one size: set data.image_size instead"
        )


def _packed(dataset: Any, args: Any, image_sizes: Sequence[int], family: str) -> None:
    dataset.pack_patches(args.patch_size, image_sizes)


def _processed(dataset: Any, args: Any, image_sizes: Sequence[int], family: str) -> None:
    if not hasattr(dataset, "serve_processed"):
        raise ConfigError(f"{family} reads images through its processor; {type(dataset).__name__} does not serve them")
    process = args.processor()
    if getattr(process, "refusal", "") and not getattr(dataset, "serves_sides", False):
        raise DataError(process.refusal)  # image-text rows fill one side with the image, the other with the caption
    dataset.serve_processed(process, image_sizes)


def _folder_images(dataset: Any, args: Any, image_sizes: Sequence[int], family: str) -> None:
    _one_size(dataset, args, image_sizes, family)
    if not hasattr(dataset, "normalize_as"):
        raise DataError(
            f"data.dataset={getattr(dataset, 'name', type(dataset).__name__)!r}: {family} reads RGB photos "
            "normalized with its folder's mean and std; use your own image-text data (data.dataset = csv, "
            "webdataset, hf, synthetic)"
        )
    dataset.resize(args.image_size, whole=args.whole_image, mode=FILTERS[args.resample])
    dataset.normalize_as(args.image_mean, args.image_std)
    if args.max_num_patches:  # SigLIP 2: its processor's patches of each picture at its own aspect ratio
        dataset.serve_naflex(NaFlexImages(args.patch_size, args.max_num_patches, args.resample))


def _masked(dataset: Any, args: Any, image_sizes: Sequence[int], family: str) -> None:
    dataset.serve_masked(args.downsample, image_sizes)


@dataclass(frozen=True)
class DataLayout:
    name: str
    prepare: Callable[[Any, Any, Sequence[int], str], None]
    """(dataset, the flavor's args, `[data] image_sizes`, family name) -> None; a ConfigError or
    DataError when the family cannot read those settings."""
    split: Callable[[Any, int], list[Any]]
    """(batch, chunk size) -> chunks of at most that many samples."""


IMAGES = DataLayout("images", _one_size, split_inputs)
PACKED_PATCHES = DataLayout("packed_patches", _packed, split_vlm_inputs)
MASKED_IMAGES = DataLayout("masked_images", _masked, split_inputs)
PROCESSED = DataLayout("processed", _processed, split_sides)
FOLDER_IMAGES = DataLayout("folder_images", _folder_images, split_inputs)
