"""Several sources as one training set: `::`-joined paths, their upsampling factors, and how an
epoch's index maps to a source and a record in it.

Source i gives `sizes[i] = max(1, round(factor_i x len_i))` samples to each epoch, at the joined
indices `starts[i] ... starts[i] + sizes[i] - 1` (open_clip's --train-data-upsampling-factors). A
share that is not a whole number of copies is read in consecutive windows continuing from epoch to
epoch (epoch e starts at e x size_i, modulo the source's length), so over epochs every record of
the source is seen equally often. With `data.same_source_batches` the loader's sampler reads
`sizes` to draw each optimizer step's samples from one source (`loader.BlockedDistributedSampler`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from titan_contrastive.datasets.base import DataError

logger = logging.getLogger("titan_contrastive")

__all__ = ["SourceMix", "check_per_source", "joins", "split_sources"]


def split_sources(path: str, factors: Sequence[float]) -> tuple[list[str], list[float]]:
    """The parts of a `::`-joined `data.path` and one factor per part (`data.upsampling_factors`;
    empty = 1 each), or a DataError when the counts disagree or a part is empty."""
    parts = path.split("::")
    if any(not p.strip() for p in parts):
        raise DataError(f"data.path={path!r}: an empty source between '::' separators; name one source per part")
    factors = list(factors) or [1.0] * len(parts)
    if len(factors) != len(parts):
        raise DataError(
            f"data.upsampling_factors={factors}: {len(factors)} factor(s) for the {len(parts)} sources "
            f"in data.path; give one factor per '::'-joined source"
        )
    return parts, factors


def check_per_source(key: str, values: Sequence[str], parts: Sequence[str], empty: str) -> None:
    """A DataError unless `data.<key>` (`values`: a prompt per source) is empty or holds one entry per
    part of `data.path`; `empty` says what an entry "" means."""
    if values and len(values) != len(parts):
        raise DataError(
            f"data.{key}={list(values)!r}: {len(values)} prompt(s) for the {len(parts)} source(s) in data.path; "
            f"give one per '::'-joined source (\"\" for {empty}), or leave it empty for model.{key[:-1]}"
        )


def in_batch_per_source(values: Sequence[bool], parts: Sequence[str]) -> list[bool]:
    """`data.in_batch_negatives` for each part of `data.path` (empty: true for each); a DataError unless it is empty
    or holds one value per part."""
    if values and len(values) != len(parts):
        raise DataError(
            f"data.in_batch_negatives={list(values)!r}: {len(values)} value(s) for the {len(parts)} source(s) in "
            "data.path; give one per '::'-joined source (false: its queries against their own documents only), or "
            "leave it empty"
        )
    for i, part in enumerate(parts):
        named = Path(part.rstrip("/")).name.split(".")[0].endswith("no_in_batch_neg")
        if named and (not values or values[i]):
            logger.warning(
                f"{part} is named as FlagEmbedding names the files it trains without in-batch negatives, and "
                f"data.in_batch_negatives={list(values)} leaves them to its queries: give this source false to train "
                "it as FlagEmbedding does"
            )
    return list(values) or [True] * len(parts)


def joins(factors: Sequence[float]) -> bool:
    """Whether sources with these factors (one per source, `split_sources`) need a `SourceMix`: more
    than one, or one read other than exactly once per epoch."""
    return len(factors) > 1 or factors[0] != 1.0


class SourceMix:
    """The joined index space of sources of `lengths` records weighted by `factors` (module docstring)."""

    def __init__(self, lengths: Sequence[int], factors: Sequence[float]) -> None:
        self.lengths = list(lengths)
        self.sizes = [max(1, round(f * n)) for f, n in zip(factors, self.lengths)]
        self._ends = np.cumsum(self.sizes)
        self.starts = [int(e) - s for e, s in zip(self._ends, self.sizes)]
        self._offsets = np.cumsum([0, *self.lengths[:-1]]).tolist()  # each source's first record, all concatenated

    def __len__(self) -> int:
        return int(self._ends[-1])

    def following(self, index: int) -> int:
        """The joined index after `index` within its source's range (wrapping to the range's start):
        where a bad sample's substitute is read, so that it comes from the same source."""
        i = int(np.searchsorted(self._ends, index, side="right"))
        return self.starts[i] + (index - self.starts[i] + 1) % self.sizes[i]

    def locate(self, index: int, epoch: int) -> tuple[int, int]:
        """(source, record in it) of joined index `index` in epoch `epoch`."""
        i = int(np.searchsorted(self._ends, index, side="right"))
        return i, (index - self.starts[i] + epoch * self.sizes[i]) % self.lengths[i]

    def record(self, index: int, epoch: int) -> int:
        """The position of `locate(index, epoch)`'s record among all sources' records, concatenated in order."""
        source, record = self.locate(index, epoch)
        return self._offsets[source] + record
