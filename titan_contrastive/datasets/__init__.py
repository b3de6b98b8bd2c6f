"""Datasets (their interface: `protocol.Dataset`), the data layouts families read, retrieval
batches, and the data-parallel loader.

`build_dataset(name, split, ...)` loads a whole split into memory (nothing is downloaded:
the data comes from `path`, an installed Debian package, or the bundle in
titan_contrastive/assets); `build_dataloader(dataset, ...)` returns this rank's endless,
resumable stream of batch dicts {image, text, label, index}.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from titan_contrastive.datasets.base import DataError, ImageTextDataset
from titan_contrastive.datasets.emoji import build_emoji
from titan_contrastive.datasets.fashion_mnist import build_fashion_mnist
from titan_contrastive.datasets.loader import BlockedDistributedSampler, EpochLoader, build_dataloader
from titan_contrastive.datasets.protocol import Dataset, ZeroShotDataset
from titan_contrastive.datasets.tokenizer import ByteTokenizer, CaptionTokenizer, PairTokenizer
from titan_contrastive.datasets.wordnet import build_wordnet

__all__ = [
    "DATASETS",
    "SPLITS",
    "BlockedDistributedSampler",
    "ByteTokenizer",
    "DataError",
    "Dataset",
    "EpochLoader",
    "ImageTextDataset",
    "PairTokenizer",
    "ZeroShotDataset",
    "build_dataloader",
    "build_dataset",
]

_BUILDERS: dict[str, Callable[..., Dataset]] = {
    "fashion_mnist": build_fashion_mnist,
    "emoji": build_emoji,
    "wordnet": build_wordnet,
}
TOKENIZED_BY_MODEL = ("wordnet",)  # datasets that tokenize with the model family's tokenizer
DATASETS: tuple[str, ...] = tuple(_BUILDERS)
SPLITS: tuple[str, ...] = ("train", "test")


def build_dataset(
    name: str,
    split: str,
    *,
    path: str = "",
    seed: int = 0,
    context_length: int = 32,
    augment: bool = True,
    image_size: int = 0,
    tokenizer: Any = None,
    hard_negatives: bool = True,
    frozen: Any = None,
    group: Any = None,
) -> Dataset:
    """One split of a dataset, in memory. `seed` drives the per-sample randomness of the train
    split (caption template, flips when `augment`); the test split is deterministic.
    `image_size` > 0 serves images resized to that square size. `tokenizer`: the model family's
    own tokenizer, for the text-pair datasets that use one (wordnet); `hard_negatives`: whether
    they serve their mined negatives (data.hard_negatives); `frozen`: a frozen model's embeddings of
    their texts (`datasets.frozen.EmbeddingTable`), served beside them; `group`: the ranks that each build this
    same split, sharing the tokenization of text pairs (`token_table.TokenTable`), None: alone."""
    if name not in _BUILDERS:
        raise DataError(f"data.dataset={name!r}: unknown dataset; choose one of {', '.join(DATASETS)}")
    if split not in SPLITS:
        raise DataError(f"split={split!r}: unknown split; choose one of {', '.join(SPLITS)}")
    if name in TOKENIZED_BY_MODEL:
        return _BUILDERS[name](
            split,
            path=path,
            context_length=context_length,
            tokenizer=tokenizer,
            hard_negatives=hard_negatives,
            frozen=frozen,
            group=group,
        )
    if tokenizer is not None and not isinstance(tokenizer, CaptionTokenizer):
        raise DataError(
            f"data.dataset={name!r} is image-text with its own tokenizer, but the model family brings a "
            f"pretrained text tokenizer; use a text-pair dataset ({', '.join(TOKENIZED_BY_MODEL)})"
        )
    dataset = _BUILDERS[name](
        split, path=path, seed=seed, context_length=context_length, augment=augment, tokenizer=tokenizer
    )
    dataset.resize(image_size)
    return dataset
