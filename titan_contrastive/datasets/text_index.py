"""Where each (side, text) of a table of embeddings is (`frozen.EmbeddingTable`), in a few numpy arrays.

A Python dict of the keys would be copied, page by page, into every data worker forked from the process that built
it, as the worker looks keys up: CPython counts a reference on every key it compares, so the key objects are written
to, in every worker of every rank (docs/performance.md, "A teacher file's keys in forked data workers"). Here a key
is its 128-bit BLAKE2b digest (of the side, a NUL and the text), held as two uint64 arrays sorted together with the
row each names; looking a batch of keys up hashes them and binary-searches those arrays, which forked workers only
read. Two keys share a digest with probability 2^-128 per pair (the image keys are SHA-1 digests already).

`FirstSeen` holds the same digests grown a batch at a time: which keys of a stream come for the first time, in 16
bytes a key (how `row_spool` keeps each key's first row)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["FirstSeen", "TextIndex", "digests", "hashed"]


def hashed(texts: Iterable[str]) -> tuple[np.ndarray, np.ndarray]:
    """(high, low) uint64 halves of each text's BLAKE2b-128 digest."""
    raw = b"".join(hashlib.blake2b(text.encode(), digest_size=16).digest() for text in texts)
    halves = np.frombuffer(raw, dtype=">u8").reshape(-1, 2).astype(np.uint64)
    return halves[:, 0].copy(), halves[:, 1].copy()


def digests(keys: Sequence[tuple[str, str]]) -> tuple[np.ndarray, np.ndarray]:
    """(high, low) uint64 halves of each key's BLAKE2b-128 digest (of its side, a NUL and its text)."""
    return hashed(f"{side}\0{text}" for side, text in keys)


class FirstSeen:
    """The keys seen so far as runs of their `hashed` digests sorted by the high half, each run at least twice as
    long as the next (the last two merged until it is so): a few runs, each key merged a few times, 16 bytes a key
    (32 while the longest runs merge)."""

    def __init__(self) -> None:
        self.runs: list[tuple[np.ndarray, np.ndarray]] = []

    def new(self, texts: Sequence[str]) -> np.ndarray:
        """bool [len(texts)]: which of `texts` come for the first time (not seen before, nor earlier in `texts`);
        they are seen from now on."""
        order, high, low, repeat = _sorted(*hashed(texts))  # sorted: each search starts where the last one ended
        fresh = ~repeat
        for run in self.runs:
            fresh &= _position(*run, high, low) < 0
        if fresh.any():
            self.runs.append((high[fresh], low[fresh]))
            while len(self.runs) > 1 and len(self.runs[-2][0]) < 2 * len(self.runs[-1][0]):
                (high_b, low_b), (high_a, low_a) = self.runs.pop(), self.runs.pop()
                joined = np.concatenate([high_a, high_b])
                del high_a, high_b  # each array let go as soon as it is copied: 32 bytes a key at most
                by = np.argsort(joined, kind="stable")  # two sorted runs: one merge pass
                joined = joined[by]
                lows = np.concatenate([low_a, low_b])
                del low_a, low_b
                self.runs.append((joined, lows[by]))
        out = np.zeros(len(order), dtype=bool)
        out[order] = fresh
        return out


def _sorted(high: np.ndarray, low: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(the stable order of the digests (`high`, `low`), them in that order, which of them repeat the one before):
    each key's first place comes first among its copies."""
    order = np.lexsort((low, high))
    high, low = high[order], low[order]
    repeat = np.zeros(len(order), dtype=bool)
    repeat[1:] = (high[1:] == high[:-1]) & (low[1:] == low[:-1])
    return order, high, low, repeat


def _position(sorted_high: np.ndarray, sorted_low: np.ndarray, high: np.ndarray, low: np.ndarray) -> np.ndarray:
    """int64 [len(high)]: where each digest (`high`, `low`) is in (`sorted_high`, `sorted_low`), sorted by the high
    halves; -1 where it is not."""
    if not len(sorted_high):
        return np.full(len(high), -1, dtype=np.int64)
    at = np.minimum(np.searchsorted(sorted_high, high), len(sorted_high) - 1)
    shared = sorted_high[at] == high
    found = shared & (sorted_low[at] == low)
    where = np.where(found, at, -1)
    for i in np.flatnonzero(shared & ~found):  # the high half is shared: the rest of its run
        j = at[i] + 1
        while j < len(sorted_high) and sorted_high[j] == high[i] and where[i] < 0:
            where[i] = j if sorted_low[j] == low[i] else -1
            j += 1
    return where


class TextIndex:
    """The first row of each distinct key of a table; `of` builds it, `find` looks keys up."""

    def __init__(self, high: np.ndarray, low: np.ndarray, rows: np.ndarray, sides: frozenset[str]) -> None:
        self.high, self.low, self.rows, self.sides = high, low, rows, sides

    @classmethod
    def of(cls, keys: Sequence[tuple[str, str]]) -> tuple[TextIndex, np.ndarray, np.ndarray]:
        """(the index of `keys`, one per row of the table, naming each key's first row; the rows that repeat an
        earlier key, and the first row of each) in row order."""
        high, low = digests(keys)
        return cls.from_digests(high, low, frozenset(s for s, _ in keys))

    @classmethod
    def from_digests(
        cls, high: np.ndarray, low: np.ndarray, sides: frozenset[str]
    ) -> tuple[TextIndex, np.ndarray, np.ndarray]:
        """`of`, from the keys' `digests` (row order; a table read in parts hashes each part)."""
        order, high, low, repeat = _sorted(high, low)  # equal keys in their row order
        if not repeat.any():  # each key once (a file `embed` writes): the sorted digests are the index
            none = np.empty(0, dtype=np.int64)
            return cls(high, low, order.astype(np.int64, copy=False), sides), none, none
        first = order[np.maximum.accumulate(np.where(repeat, 0, np.arange(len(order))))]  # each run's first row
        later, of_first = order[repeat], first[repeat]
        by_row = np.argsort(later, kind="stable")
        index = cls(high[~repeat], low[~repeat], order[~repeat].astype(np.int64), sides)
        return index, later[by_row], of_first[by_row]

    def find(self, keys: Sequence[tuple[str, str]]) -> np.ndarray:
        """int64 [len(keys)]: each key's row, -1 where the table has none."""
        if not keys:
            return np.empty(0, dtype=np.int64)
        at = _position(self.high, self.low, *digests(keys))
        return np.where(at >= 0, self.rows[at], -1)
