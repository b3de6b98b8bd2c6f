"""The user's image-caption data (CSV, webdataset shards, Hugging Face datasets) as a `Dataset`.

Order of operations in `__getitems__`, per sample: read the record from its source -> decode
with Pillow -> crop (train: random-resized, from (seed, epoch, index); eval: central) -> then,
per batch, normalize and tokenize. A sample's pixels and tokens are a function of (seed, epoch,
index) alone, as for the bundled sets, so the loader's rank-count invariance and exact resume hold.

Bad samples (an image that does not decode, a missing caption, an unreadable file or shard) are
skipped: the slot takes the next good sample in source order, so batches keep their size (the
step's shapes and the DP arithmetic depend on it) and the substitute is the same in every run,
which keeps resumption exact. Each skip is returned under `BAD_SAMPLES` in the batch; the loader
takes it out, counts it by reason, logs it and stops the run past `data.max_bad_fraction`
(`datasets.bad_samples`). Shards that indexing left out or cut short were logged when the source
was opened; they are listed in `shard_losses` and counted as `bad_shards`.

A source that reads negative captions (`sources.Source.num_negatives` = k > 0) gives each sample
k hard negatives, served as `neg` [B, k, L] token ids tokenized like the captions: the steps add
them to the text columns of each image's problem (`batching.with_negatives`). A substituted slot
takes the substitute's negatives with its caption.
"""

from __future__ import annotations

import functools
import io
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from titan_contrastive.batching import FROZEN_DOCS, FROZEN_QUERIES, NEGATIVES
from titan_contrastive.datasets.bad_samples import BAD_SAMPLES
from titan_contrastive.datasets.base import DataError, view_ids
from titan_contrastive.datasets.image_keys import image_key, view_key, view_rng
from titan_contrastive.datasets.image_transforms import (
    CROP_RATIO,
    OPENAI_MEAN,
    OPENAI_STD,
    Normalize,
    decode_crop_resize,
    decode_image,
    decode_reduced,
    random_resized_box,
    sample_rng,
)
from titan_contrastive.datasets.naflex import NaFlexImages
from titan_contrastive.datasets.sources import BadSample, Record, Source
from titan_contrastive.datasets.vl_items import carried, image_text_keys

logger = logging.getLogger("titan_contrastive")
MAX_SUBSTITUTES = 64
"""Consecutive bad records after which a batch gives up (the data is broken, not noisy)."""


class FileImageTextDataset:
    """A `datasets.protocol.Dataset` over a `sources.Source`: image [B,3,S,S] float32 (uint8 after
    `serve_uint8`), text [B,L] int64, index [B] int64, with negative captions `neg` [B, k, L] int64
    (and BAD_SAMPLES, a list of skipped records). Retrieval evaluation (recall@1/5/10 both ways)
    when it is the eval split; `class_names` is None."""

    def __init__(
        self,
        *,
        name: str,
        split: str,
        source: Source,
        tokenizer: Any,
        image_size: int,
        seed: int,
        augment: bool,
        mean: Sequence[float] = OPENAI_MEAN,
        std: Sequence[float] = OPENAI_STD,
    ) -> None:
        if image_size < 1:
            raise DataError(
                f"data.image_size={image_size}: {name} images come in all sizes; set the square training size "
                "in pixels (e.g. 224 for clip/vit_b32)"
            )
        self.name, self.split, self.source, self.full = name, split, source.location, True
        self.image_shape: tuple[int, int, int] = (3, image_size, image_size)
        self.tokenizer = tokenizer
        self.class_names = None
        self.recall_ks = (1, 5, 10)
        self.recall_direction = "image_to_text"
        self.seed, self.epoch, self.train = seed, 0, augment and split == "train"
        self._source = source
        self.source_sizes: list[int] | None = getattr(source, "sizes", None)
        """Samples per epoch of each `::`-joined source (`data.same_source_batches`); None: one source."""
        self.shard_losses = list(getattr(source, "losses", []))
        """What indexing left out of the source (`sources.ShardLoss`), for the data line and `bad_shards` metrics."""
        self.normalize = Normalize(mean, std)
        self.uint8_pixels = False
        """`serve_uint8`: images leave the loader as uint8, for `normalize.apply` on the device."""
        self.num_negatives = getattr(source, "num_negatives", 0)
        self._process: Any = None  # `serve_processed`
        self._naflex: NaFlexImages | None = None  # `serve_naflex`
        self._whole, self._mode = False, "bicubic"  # `resize`
        self._frozen: Any = None  # `carry_frozen`
        self.views = 0
        """Stored views per image a train sample is served one of (`carry_frozen` of a file of several); 0: none."""
        if self.num_negatives and split == "train":
            logger.info(
                f"{name}: {self.num_negatives} negative caption(s) per sample in {source.location}: each image's "
                f"problem has the batch's captions and {self.num_negatives} hard negatives per image as columns"
            )

    def __len__(self) -> int:
        return len(self._source)

    def __repr__(self) -> str:
        return f"FileImageTextDataset({self.name}/{self.split}: {len(self)} samples from {self.source})"

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self._source, "set_epoch"):
            self._source.set_epoch(epoch)

    def resize(self, size: int, *, whole: bool = False, mode: str = "bicubic") -> None:
        """Serve size x size images (the trainer passes `data.image_size`), resized with `mode`; evaluation reads
        the central square, or with `whole` the whole image squashed (a model folder's processor: hf_clip)."""
        if size < 1:
            raise DataError(f"data.image_size={size}: set the square training size in pixels for {self.name} data")
        self.image_shape = (3, size, size)
        self._whole, self._mode = whole, mode

    def normalize_as(self, mean: Sequence[float], std: Sequence[float]) -> None:
        """Normalize with a model folder's image statistics (hf_clip) instead of OpenAI's."""
        self.normalize = Normalize(mean, std)

    def pack_patches(self, patch_size: int, sizes: Sequence[int] = ()) -> None:
        raise DataError(
            f"data.dataset={self.name!r} serves [B, 3, S, S] images; the vlm family's packed patches are "
            "served by the bundled sets only; use model.name=clip"
        )

    serve_masked = pack_patches

    def item_keys(self, image: str, caption: str, negatives: Sequence[str] = ()) -> tuple[str, str, list[str]]:
        """Served through a processor: the (query, document, negative captions') keys of a sample whose image is keyed
        `image` in a file of a frozen model's embeddings (`vl_items.image_text_keys`)."""
        return image_text_keys(self._process.kinds, self._process.templates, image, caption, negatives)

    @property
    def processed(self) -> bool:
        """Whether batches come from a model's processor (`serve_processed`) rather than as tensors."""
        return self._process is not None

    @property
    def naflex(self) -> bool:
        """Whether `image` is SigLIP 2's patches, mask and grids (`serve_naflex`) rather than a tensor."""
        return self._naflex is not None

    def serve_naflex(self, naflex: NaFlexImages) -> None:
        """Serve `image` as SigLIP 2's NaFlex patches (`datasets.naflex`): each crop (eval: each whole image)
        at its own aspect ratio, normalized with `normalize`."""
        self._naflex = naflex

    def serve_uint8(self) -> None:
        """Serve `image` as uint8 [B, 3, S, S], not normalized: the step normalizes it on its device with
        `normalize.apply` (a quarter of the bytes to pin and copy; the same values once normalized)."""
        self.uint8_pixels = True

    def serve_processed(self, process: Any, sizes: Sequence[int] = ()) -> None:
        """Serve `process(images, captions)` of each batch instead of tensors: the images decoded at their
        native resolution (uint8 HWC), the model's processor resizing them (the qwen_vl family)."""
        if sizes:
            raise DataError(
                f"data.image_sizes={list(sizes)}: {self.name} data is served at each image's own resolution "
                "(the processor's min_pixels / max_pixels bound it); leave data.image_sizes empty"
            )
        if self.num_negatives and not getattr(process, "negatives", False):
            raise DataError(
                f"{self.name} data serves negative captions, hard negatives of text documents: with this family "
                "they need data.retrieval_mode=i2t (images query captions), or data.hard_negatives=false"
            )
        self._process = process

    def _read(
        self, index: int, bad: list[BadSample], decode: Callable[[Any], Any] = decode_image
    ) -> tuple[Any, Record]:
        """The record at `index`, or the next good one in source order (of its own source, when several are
        joined; each bad one appended to `bad`), with `decode(its image)`."""
        j = index
        for _ in range(MAX_SUBSTITUTES):
            try:
                record = self._source.read(j)
            except BadSample as e:
                bad.append(e)
            else:
                try:
                    return decode(record.image), record
                except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
                    bad.append(BadSample("undecodable_image", record.where, record.key, f"{type(e).__name__}: {e}"))
            mix = getattr(self._source, "mix", None)  # joined sources: the substitute comes from the same one
            j = mix.following(j) if mix is not None else (j + 1) % len(self._source)
        raise DataError(
            f"{bad[-1].where}: {MAX_SUBSTITUTES} bad samples in a row from sample {index} (last: {bad[-1]}); "
            "the data is damaged: check the files or rebuild the shards"
        )

    def _rng(self, index: int, data: Any, view: int | None) -> np.random.Generator | None:
        """The generator of a train crop of the image `data` in sample `index`'s slot: its own (fresh for each image
        tried), or with `view` the stored view's of the image (`view_rng`); None in evaluation."""
        if not self.train:
            return None
        return sample_rng(self.seed, self.epoch, index) if view is None else view_rng(image_key(data), view)

    def _pixels(self, index: int, data: Any, *, size: int, view: int | None = None) -> np.ndarray:
        """Sample `index`'s crop (`_rng`'s) of the image `data`, uint8."""
        rng = self._rng(index, data, view)
        return decode_crop_resize(data, size, train=self.train, rng=rng, whole=self._whole, mode=self._mode)

    def _patches(self, index: int, data: Any, view: int | None = None) -> tuple[torch.Tensor, tuple[int, int]]:
        """Sample `index`'s NaFlex patches and grid (`serve_naflex`): of its train crop (`_rng`'s; the image's own
        aspect ratio times 3/4 to 4/3; a large JPEG decoded at reduced scale), or of the whole image, decoded at full
        scale, in evaluation."""
        if not self.train:
            image = decode_image(data)
            return self._naflex.sample(image, (0, 0, *image.size), self.normalize)
        rng = self._rng(index, data, view)
        image = data if isinstance(data, Image.Image) else Image.open(io.BytesIO(data))
        shape = image.width / image.height
        ratio = (shape * CROP_RATIO[0], shape * CROP_RATIO[1])
        box = random_resized_box(*image.size, rng, ratio)
        height, width = self._naflex.size_of(box)
        image, box = decode_reduced(image, box, width, height)
        return self._naflex.sample(image, box, self.normalize, (height, width))

    def __getitems__(self, indices: Sequence[int]) -> dict[str, Any]:
        views = view_ids(self.seed, self.epoch, indices, self.views) if self.views and self.train else None
        batch, records = self._served(indices, views)
        if self._frozen is not None:
            batch |= self._frozen_of(records, views)
        return batch

    def _served(
        self, indices: Sequence[int], views: Sequence[int] | None = None
    ) -> tuple[dict[str, Any], list[Record]]:
        """The batch of these samples (with `views`: each train crop the stored view's, `_rng`) and the records it was
        made of (a bad sample's substitute in its slot)."""
        if self._process is not None:
            return self._processed(indices)
        size = self.image_shape[-1]
        images, records, bad = [], [], []
        read = self._patches if self._naflex else functools.partial(self._pixels, size=size)
        for slot, index in enumerate(indices):
            view = None if views is None else int(views[slot])
            image, record = self._read(int(index), bad, functools.partial(read, int(index), view=view))
            images.append(image)
            records.append(record)
        if self._naflex:
            image = self._naflex.batch(images)
        else:
            pixels = np.stack(images) if images else np.empty((0, size, size, 3), dtype=np.uint8)
            image = self.normalize.channels_first(pixels) if self.uint8_pixels else self.normalize(pixels)
        batch = {
            "image": image,
            "text": self.tokenizer.encode([r.caption for r in records]),
            "index": torch.as_tensor(list(indices), dtype=torch.long),
            BAD_SAMPLES: bad,
        }
        if self.num_negatives:
            negatives = [text for r in records for text in r.negatives]
            batch[NEGATIVES] = self.tokenizer.encode(negatives).view(len(indices), self.num_negatives, -1)
        return batch, records

    def _processed(self, indices: Sequence[int]) -> tuple[dict[str, Any], list[Record]]:
        images, records, bad = [], [], []
        for index in indices:
            image, record = self._read(int(index), bad)
            images.append(np.asarray(image.convert("RGB")))
            records.append(record)
        captions = [r.caption for r in records]
        negatives = [text for r in records for text in r.negatives] if self.num_negatives else ()
        batch = self._process(images, captions, negatives)
        return {**batch, "index": torch.as_tensor(list(indices), dtype=torch.long), BAD_SAMPLES: bad}, records

    def carry_frozen(self, table: Any, probe: int = 16) -> None:
        """Serve a frozen model's embeddings beside each sample (`datasets.frozen`, an image-text `EmbeddingTable`):
        `frozen_query` [B, d] of its image as stored (whatever crop it is served), `frozen_doc` [B, d] of its
        caption, or [B, 1 + k, d] with its negative captions. Served through a processor (`serve_processed`), of
        its query and its document instead, from a file of `query` and `document` rows (`item_keys`). The first
        `probe` samples are looked up here, before any compute; a sample the file misses later is a DataError when
        its batch is made."""
        if self._process is not None:
            table.check_sides(
                ("query", "document"), "image-text data through a processor looks up each query and document"
            )
        else:
            table.check_image_text()
        self._frozen, self.views = table, table.views if self.train else 0
        bad: list[BadSample] = []
        probed = range(min(probe, len(self)))
        views = view_ids(self.seed, self.epoch, probed, self.views) if self.views and self.train else None
        self._frozen_of([self._read(i, bad)[1] for i in probed], views)

    def _frozen_of(self, records: Sequence[Record], views: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
        """`frozen_query` and `frozen_doc` of the records (`carry_frozen`), with `views` of each image's view."""
        table, where = self._frozen, [f"{r.where} {r.key}" for r in records]
        if self._process is not None:
            keys = [self.item_keys(image_key(r.image), r.caption, r.negatives) for r in records]
            return carried(table, [q for q, _, _ in keys], [[d, *negs] for _, d, negs in keys], where)
        keys = [image_key(r.image) for r in records]
        if views is not None:
            keys = [view_key(key, int(v)) for key, v in zip(keys, views)]
        images = table.lookup("image", keys, where)
        captions = table.lookup("caption", [r.caption for r in records], where)
        docs = table.vectors[captions]
        if self.num_negatives:
            negatives = table.lookup(
                "caption",
                [t for r in records for t in r.negatives],
                [w for w in where for _ in range(self.num_negatives)],
            )
            docs = torch.cat([docs[:, None], table.vectors[negatives].view(len(records), self.num_negatives, -1)], 1)
        return {FROZEN_QUERIES: table.vectors[images], FROZEN_DOCS: docs}

    def fixed_view(self, indices: Sequence[int]) -> tuple[dict[str, Any], list[str], list[str]]:
        """The samples as evaluation serves them (the central crop, or the whole image), their images' keys, and the
        caption texts they serve (with their negatives): what a frozen model embeds ahead of training
        (`embed_images`)."""
        train, self.train = self.train, False
        try:
            batch, records = self._served(indices)
        finally:
            self.train = train
        texts = [text for r in records for text in (r.caption, *r.negatives)]
        return batch, [image_key(r.image) for r in records], texts

    def view(self, indices: Sequence[int], view: int) -> tuple[dict[str, Any], list[str]]:
        """The samples at their images' stored view `view` (the train crop `view_rng` draws), and the views' keys
        (`view_key`): what a frozen model embeds ahead of training for a file of several views (`embed_images
        --views`)."""
        if self._process is not None or not self.train:
            raise DataError(
                f"{self.name}: several views per image are train crops (data.augment=true) served as tensors; write "
                "one view (no --views), or turn data.augment on"
            )
        batch, records = self._served(indices, [view] * len(indices))
        return batch, [view_key(image_key(r.image), view) for r in records]

    def __getitem__(self, index: int) -> dict[str, Any]:
        batch = self.__getitems__([index])
        # packed patches (`serve_processed`: `pixel_values`, `query_pixel_values`, ...): all of the sample's rows
        packed = ("pixel_values", "image_grid_thw")  # a text side's are empty
        if self._naflex:  # NaFlex patches: the sample's row of each
            batch["image"] = {k: v[0] for k, v in batch["image"].items()}
            packed = ("image",)
        return {k: v if k == BAD_SAMPLES or k.endswith(packed) else v[0] for k, v in batch.items()}

    def captions(self, indices: Sequence[int]) -> list[str]:
        """The captions of these samples (logs, inspection)."""
        return [self._source.read(int(i)).caption for i in indices]

    def encode_text(self, texts: list[str]) -> torch.Tensor:
        return self.tokenizer.encode(texts)
