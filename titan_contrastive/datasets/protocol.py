"""The interface every dataset gives the loader, the steps and evaluation.

Why a Protocol and not a base class: the bundled sets are in-memory tensors, and the other
sources (shards, files, Hugging Face datasets) do not share their storage; what the rest of the code
may rely on is this list, nothing else.

Batches (`__getitems__`) are dicts of tensors whose dim 0 is the batch, except the packed
`pixel_values` of `ModelSpec.layout = PACKED_PATCHES`: the model reads the keys its spec names
(`ModelSpec.input_keys`), `index` is every sample's position in the split, `label` (image sets)
its class, and `mask` (masked images) its real pixels. A sample's content is a function of
(seed, epoch, index) alone, never of its batch, rank or worker: that makes rank-count invariance
and exact resumption possible (`datasets.loader`). Optional: `source_sizes`, the samples per epoch of
each `::`-joined source in index order (`mixing.SourceMix`), which `data.same_source_batches` reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

__all__ = ["Dataset", "ZeroShotDataset"]


@runtime_checkable
class Dataset(Protocol):
    name: str
    split: str
    """"train" or "test"."""
    source: str
    """Where the data was read from (logged at start)."""
    full: bool
    """The complete official split (True) or a bundled subset."""
    image_shape: tuple[int, int, int] | None
    """(C, H, W) of the largest image a batch holds (what the model is sized for); None: text only."""
    tokenizer: Any
    """What tokenized the texts; its `vocab_size` sizes the text tower."""
    class_names: list[str] | None
    """Zero-shot evaluation (a `ZeroShotDataset`) when set, else retrieval recall."""
    recall_ks: tuple[int, ...]
    recall_direction: str
    """Retrieval evaluation: recall@k of the first tower's items against the second's, named
    `{recall_direction}_r@{k}` (e.g. image_to_text_r@1)."""

    def __len__(self) -> int: ...

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose per-sample randomness `__getitems__` draws."""

    def __getitems__(self, indices: Sequence[int]) -> dict[str, Tensor]:
        """The batch of these samples (see the module docstring)."""


@runtime_checkable
class ZeroShotDataset(Dataset, Protocol):
    """A dataset whose captions come from class names, for zero-shot classification."""

    templates: list[str]
    """Caption templates ("a photo of a {}."); the classifier averages a class over all of them."""

    def encode_text(self, texts: list[str]) -> Tensor:
        """Tokenize free text exactly as the captions are."""
