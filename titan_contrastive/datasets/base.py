"""The in-memory image-text dataset shared by every source, and the data error type.

Why in memory and map-style: the bundled sets are a few MB, so a batch is one tensor gather
(`__getitems__`) instead of B Python calls and a collate; map-style keeps the sample order under
the control of the sampler, which is what makes resumption and rank-count invariance exact.

Why a counter-based hash for per-sample randomness: the caption template and the flip of sample
`i` in epoch `e` must not depend on which rank or worker loads it, nor on what else is in its
batch, so that 1 process x 16 samples and 2 processes x 8 see identical data. A stateful RNG
cannot give that; `sample_hash(seed, epoch, stream, i)` can, vectorized over the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from titan_contrastive.batching import FROZEN_DOCS, FROZEN_QUERIES
from titan_contrastive.datasets.image_keys import image_key, view_key
from titan_contrastive.datasets.packing import pack_images, pad_to_batch, resize_each
from titan_contrastive.datasets.tokenizer import ByteTokenizer

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64 increment
STREAM_TEMPLATE = 0
STREAM_FLIP = 1
STREAM_SIZE = 2
STREAM_VIEW = 3


class DataError(ValueError):
    """Bad data or data settings. The message is one line: the file or field, the bad value, the fix."""


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer: a bijection on uint64 with full avalanche (uint64 products wrap)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def sample_hash(seed: int, epoch: int, stream: int, indices: np.ndarray) -> np.ndarray:
    """64 random bits per index, a pure function of (seed, epoch, stream, index)."""
    key = np.array([seed & _MASK64], dtype=np.uint64)
    for part in (epoch, stream):
        key = _mix64(key ^ np.uint64((part + _GOLDEN) & _MASK64))
    return _mix64(key ^ (indices.astype(np.uint64) + np.uint64(_GOLDEN)))


def view_ids(seed: int, epoch: int, indices: Sequence[int], views: int) -> np.ndarray:
    """int64 [len(indices)]: which of its image's `views` stored views each sample is served in `epoch`
    (`datasets.image_keys.view_key`), a pure function of (seed, epoch, index)."""
    bits = sample_hash(seed, epoch, STREAM_VIEW, np.asarray(indices, dtype=np.int64))
    return (bits % np.uint64(views)).astype(np.int64)


class ImageTextDataset:
    """Images, labels and caption subjects held as tensors; `__getitems__` returns a whole batch.

    A sample's caption is `templates[t].format(subjects[text_ids[i]])`. All (template, subject)
    pairs are tokenized once up front, so a batch's text is a gather, not a tokenizer call. In the
    train split `t` is drawn per (seed, epoch, index); in the test split it is always 0, which is
    also the caption that `captions()` returns for retrieval evaluation.

    A `datasets.protocol.ZeroShotDataset` (a `Dataset` when `class_names` is None); also labels
    (int64 [N]), subjects, seed, epoch.
    """

    def __init__(
        self,
        *,
        name: str,
        split: str,
        images: torch.Tensor,
        labels: torch.Tensor,
        text_ids: torch.Tensor,
        subjects: Sequence[str],
        templates: Sequence[str],
        mean: Sequence[float],
        std: Sequence[float],
        class_names: list[str] | None,
        seed: int,
        hflip: bool,
        context_length: int,
        source: str,
        full: bool,
        tokenizer: Any = None,
    ) -> None:
        if images.dtype != torch.uint8 or images.ndim != 4 or not len(images) == len(labels) == len(text_ids):
            raise ValueError(f"{name}: images must be uint8 [N,C,H,W] with one label and text id per image")
        self.name = name
        self.split = split
        self.recall_ks = (1, 5)
        self.recall_direction = "image_to_text"
        self.seed = seed
        self.epoch = 0
        self.hflip = hflip
        self.source = source
        self.full = full
        self.class_names = class_names
        self.templates = list(templates)
        self.subjects = list(subjects)
        self.tokenizer = tokenizer or ByteTokenizer(context_length)  # a family's own (CaptionTokenizer), else bytes
        self.image_shape: tuple[int, int, int] = tuple(images.shape[1:])  # type: ignore[assignment]
        self._images = images
        self._size = 0  # 0: native size (see `resize`)
        self._layout = "batch"  # or "packed" (see `pack_patches`) or "masked" (see `serve_masked`)
        self._patch_size = 0
        self._sizes: list[int] = []
        self.labels = labels.long()
        self._text_ids = text_ids.long()
        channels = self.image_shape[0]
        mean_t = torch.tensor(mean, dtype=torch.float32).view(channels, 1, 1)
        std_t = torch.tensor(std, dtype=torch.float32).view(channels, 1, 1)
        # (x / 255 - mean) / std as one multiply-add on the uint8 -> float32 batch
        self._scale = 1.0 / (255.0 * std_t)
        self._shift = -mean_t / std_t
        # [num_templates, num_subjects, context_length]
        self._tokens = torch.stack(
            [self.tokenizer.encode([t.format(s) for s in self.subjects]) for t in self.templates]
        )
        self._frozen: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # `carry_frozen`
        self.views = 0
        """Stored views per image a train sample is served one of (`carry_frozen` of a file of several); 0: none."""

    def carry_frozen(self, table: Any) -> None:
        """Serve a frozen model's embeddings beside each sample (`datasets.frozen`, an image-text
        `EmbeddingTable`): `frozen_query` [B, d] of its image as stored (whatever flip it is served
        with) and `frozen_doc` [B, d] of the caption it is served with. With a file of several views
        per image (`table.views`), a train sample is served one of its image's views (`view_ids`),
        flipped when the view's number is odd, and that view's embedding. Every image and caption is
        looked up here, so a file that misses one is a DataError before any compute."""
        table.check_image_text()
        keys, where = [image_key(x) for x in self._images], [str(i) for i in range(len(self))]
        served = table.views if self.split == "train" and self.hflip else 0
        each = [[view_key(key, v) for key in keys] for v in range(served)] or [keys]  # [views or 1][N]
        images = torch.stack([table.lookup("image", view_keys, where) for view_keys in each])
        captions = table.lookup("caption", self.caption_texts()).view(len(self.templates), len(self.subjects))
        self._frozen, self.views = (table.vectors, images, captions), served

    def caption_texts(self) -> list[str]:
        """Every caption the split may serve: each template of each subject."""
        return [t.format(s) for t in self.templates for s in self.subjects]

    def fixed_view(self, indices: Sequence[int]) -> tuple[dict[str, Any], list[str], list[str]]:
        """The samples as evaluation serves them (no flip, the first template), their images' keys, and the
        captions they may serve (each template of their subjects): what a frozen model embeds ahead of training
        (`embed_images`)."""
        flip, split, self.hflip, self.split = self.hflip, self.split, False, "test"
        try:
            batch = self.__getitems__(indices)
        finally:
            self.hflip, self.split = flip, split
        subjects = [self.subjects[s] for s in self._text_ids[torch.as_tensor(list(indices))].tolist()]
        texts = [t.format(subject) for subject in subjects for t in self.templates]
        return batch, [image_key(self._images[i]) for i in indices], texts

    def view(self, indices: Sequence[int], view: int) -> tuple[dict[str, Any], list[str]]:
        """The samples at their images' stored view `view` (flipped when `view` is odd; the first template), and the
        views' keys (`view_key`): what a frozen model embeds ahead of training for a file of several views
        (`embed_images --views`)."""
        if not (self.hflip and self.split == "train"):
            raise DataError(
                f"{self.name}: its views are flips, and this split is served unflipped; write one view (no --views), "
                "or turn data.augment on"
            )
        batch = self.__getitems__(indices, views=np.full(len(indices), view, dtype=np.int64))
        return batch, [view_key(image_key(self._images[i]), view) for i in indices]

    def __len__(self) -> int:
        return len(self.labels)

    def __repr__(self) -> str:
        return (
            f"ImageTextDataset({self.name}/{self.split}: {len(self)} samples, image {self.image_shape}, "
            f"source {self.source})"
        )

    def resize(self, size: int) -> None:
        """Serve images resized (bilinear) to size x size; 0 keeps the native size. Why: large
        flavors have patch sizes the small native images do not divide (ViT-B/32 wants 224)."""
        if size < 0:
            raise DataError(f"data.image_size={size}: must be 0 (native size) or a positive size in pixels")
        channels = self.image_shape[0]
        self._size = size
        self.image_shape = (channels, size, size) if size else tuple(self._images.shape[1:])  # type: ignore[assignment]

    def _mixed_sizes(self, sizes: Sequence[int], multiple: int, what: str) -> list[int]:
        """The validated resolutions to mix (`data.image_sizes`, else the current size)."""
        example = [multiple * k for k in (2, 3, 4)]
        if not sizes and self.image_shape[1] % multiple:
            raise DataError(
                f"{self.name} images are {self.image_shape[1]} px, not a multiple of the model's {what} {multiple}; "
                f"set data.image_sizes (e.g. {example}) or data.image_size to a multiple of {multiple}"
            )
        sizes = list(sizes) or [self.image_shape[1]]
        bad = [s for s in sizes if s < multiple or s % multiple]
        if bad:
            raise DataError(
                f"data.image_sizes={sizes}: {bad} are not positive multiples of the model's {what} {multiple}; "
                f"use sizes like {example}"
            )
        return sorted(set(sizes))

    def pack_patches(self, patch_size: int, sizes: Sequence[int] = ()) -> None:
        """Serve Qwen-VL-style packed patches instead of [B, C, H, W] images: `pixel_values`
        [total_patches, C·p·p] and `image_grid_thw` [B, 3], each image at one of `sizes` (square,
        in pixels; empty = the current size). Train: the size of sample i is drawn per (seed,
        epoch, i); test: sizes[i % len(sizes)], so evaluation covers every resolution."""
        self._sizes = self._mixed_sizes(sizes, patch_size, "patch size")
        self._layout, self._patch_size = "packed", patch_size
        self.image_shape = (self.image_shape[0], self._sizes[-1], self._sizes[-1])

    def serve_masked(self, multiple: int, sizes: Sequence[int] = ()) -> None:
        """Serve images in [-1, 1] at mixed sizes (chosen like `pack_patches`), zero-padded to the
        largest into `image` [B, C, S, S], with `mask` [B, 1, S, S] = 1 on real pixels (the vae
        family's masked pixel loss). Sizes must be multiples of `multiple` (the downsampling)."""
        self._sizes = self._mixed_sizes(sizes, multiple, "downsampling factor")
        self._layout = "masked"
        self._scale = torch.full_like(self._scale, 1 / 127.5)
        self._shift = torch.full_like(self._shift, -1.0)
        self.image_shape = (self.image_shape[0], self._sizes[-1], self._sizes[-1])

    @property
    def processed(self) -> bool:
        """Whether batches come from a model's processor (`serve_processed`) rather than as tensors."""
        return self._layout == "processed"

    def serve_processed(self, process: Any, sizes: Sequence[int] = ()) -> None:
        """Serve `process(images, captions)` of each batch (the qwen_vl family's processor): uint8 HWC
        images, each at one of `sizes` (chosen like `pack_patches`; empty = the native size), and
        their captions as text."""
        self._sizes = self._mixed_sizes(sizes, 1, "size") if sizes else []
        self._layout, self._process = "processed", process

    @property
    def image_sizes(self) -> list[int]:
        """The resolutions packed batches mix (empty when images are served as [B, C, H, W])."""
        return list(self._sizes)

    def _image_size_ids(self, idx: np.ndarray) -> np.ndarray:
        if self.split != "train":
            return idx % len(self._sizes)
        return (sample_hash(self.seed, self.epoch, STREAM_SIZE, idx) % np.uint64(len(self._sizes))).astype(np.int64)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose per-sample randomness `__getitems__` draws."""
        self.epoch = epoch

    def _template_ids(self, idx: np.ndarray) -> np.ndarray:
        if self.split != "train":
            return np.zeros(len(idx), dtype=np.int64)
        return (sample_hash(self.seed, self.epoch, STREAM_TEMPLATE, idx) % np.uint64(len(self.templates))).astype(
            np.int64
        )

    def __getitems__(self, indices: Sequence[int], views: np.ndarray | None = None) -> dict[str, torch.Tensor]:
        """The batch dict: image float32 [B,C,H,W] (normalized), text int64 [B,L], label int64 [B], index int64 [B];
        with `pack_patches`, pixel_values float32 [total_patches, C·p·p] and image_grid_thw int64 [B, 3]
        instead of image; with `serve_masked`, image in [-1, 1] zero-padded and mask float32 [B, 1, H, W].
        `views`: each sample's stored view (flipped when odd), else `carry_frozen`'s draw or the sample's own flip."""
        idx_np = np.asarray(indices, dtype=np.int64)
        idx = torch.from_numpy(idx_np)
        images = self._images[idx]
        if views is None and self.views and self.hflip:
            views = view_ids(self.seed, self.epoch, idx_np, self.views)
        if self.hflip:
            bits = sample_hash(self.seed, self.epoch, STREAM_FLIP, idx_np) >> np.uint64(63)
            flip = torch.from_numpy((bits if views is None else views % 2).astype(np.bool_))
            images = torch.where(flip.view(-1, 1, 1, 1), images.flip(-1), images)
        template = torch.from_numpy(self._template_ids(idx_np))
        pixels = images.float().mul_(self._scale).add_(self._shift)
        text = {"text": self._tokens[template, self._text_ids[idx]], "label": self.labels[idx], "index": idx}
        if self._frozen is not None:
            vectors, images_at, captions_at = self._frozen
            text[FROZEN_QUERIES] = vectors[
                images_at[torch.from_numpy(views) if views is not None and self.views else 0, idx]
            ]
            text[FROZEN_DOCS] = vectors[captions_at[template, self._text_ids[idx]]]
        if self._layout == "processed":
            chosen = images.float()
            if self._sizes:
                chosen = resize_each(chosen, np.asarray(self._sizes)[self._image_size_ids(idx_np)])
            arrays = [np.ascontiguousarray(x.round().clamp(0, 255).byte().permute(1, 2, 0).numpy()) for x in chosen]
            captions = [
                self.templates[t].format(self.subjects[s])
                for t, s in zip(template.tolist(), self._text_ids[idx].tolist())
            ]
            return {**self._process(arrays, captions), **{k: v for k, v in text.items() if k != "text"}}
        if self._layout == "packed":
            pixel_values, grid = pack_images(
                pixels, np.asarray(self._sizes)[self._image_size_ids(idx_np)], self._patch_size
            )
            return {"pixel_values": pixel_values, "image_grid_thw": grid, **text}
        if self._layout == "masked":
            resized = resize_each(pixels, np.asarray(self._sizes)[self._image_size_ids(idx_np)])
            image, mask = pad_to_batch(resized, size=self._sizes[-1])
            return {"image": image, "mask": mask, **text}
        if self._size and self._size != images.shape[-1]:
            pixels = F.interpolate(
                pixels,
                size=(self._size, self._size),
                mode="bilinear",
                align_corners=False,
                antialias=self._size < images.shape[-1],
            )
        return {"image": pixels, **text}

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """One sample, unbatched; the same values it has inside any batch (packed: all its patch rows)."""
        if self._layout in ("packed", "processed"):
            batch = self.__getitems__([index])
            whole = ("pixel_values",) if self._layout == "packed" else ("pixel_values", "image_grid_thw")
            return {k: v if k.endswith(whole) else v[0] for k, v in batch.items()}
        return {key: value[0] for key, value in self.__getitems__([index]).items()}

    def captions(self, indices: Sequence[int]) -> list[str]:
        """Template-0 captions (what the test split tokenizes), for retrieval evaluation and logs."""
        return [
            self.templates[0].format(self.subjects[i])
            for i in self._text_ids[torch.as_tensor(indices, dtype=torch.long)].tolist()
        ]

    def encode_text(self, texts: list[str]) -> torch.Tensor:
        """Tokenize free text (e.g. zero-shot class prompts) exactly as the captions are."""
        return self.tokenizer.encode(texts)
