"""Texts tokenized once each and kept unpadded: a text-pairs set's queries and documents (`pairs.PairsDataset`).

A FlagEmbedding or tevatron file names the same passages as hard negatives of many queries, and most texts are far
shorter than the length they are padded to. Tokenized and padded row by row, such a file's documents take
rows x documents x length x 8 bytes. `TokenTable` tokenizes each distinct text once, keeps its ids unpadded in one
int32 array, and pads the rows a batch asks for as the tokenizer pads them (`tokenizer.padded`): a batch is the same
int64 tensor, bit for bit, that tokenizing every text at load and padding it gave. Texts come as an iterable and are
tokenized `CHUNK` distinct texts at a time, so no list of every text's ids is ever held.

Every rank of a run reads the same rows and builds the same table. Given the ranks' `group` (a gloo group of them
all), the chunks are `CHUNK / world` texts, each rank tokenizes every `world`-th chunk, and each chunk's owner sends
its ids to the others: a run's ranks tokenize each text once between them rather than once each. What they build is
checked to be the same table (a digest of its texts and places), and a DataError ends every rank where a rank read
other texts.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable
from itertools import chain

import numpy as np
import torch
import torch.distributed as dist

from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.tokenizer import PairTokenizer, padded

__all__ = ["TokenTable"]

CHUNK = 8192
"""Distinct texts tokenized in one call (by one rank of `world`: CHUNK / world)."""


class TokenTable:
    """`texts`' token ids through `tokenizer` at `length` (each text exactly as it is tokenized: its prompt already
    before it); `table[places]` is int64 [*places.shape, length], the padded ids of the texts at those places of
    `texts`, and `len(table)` how many texts came. `group`: the ranks that build this same table from the same texts,
    each tokenizing its share (the module docstring); None: this process tokenizes them all."""

    def __init__(
        self, tokenizer: PairTokenizer, texts: Iterable[str], length: int, group: dist.ProcessGroup | None = None
    ) -> None:
        self.length, self._pad, self._left = length, tokenizer.pad_value, tokenizer.pad_left
        world, me = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
        chunk = max(1, CHUNK // world)  # every rank a share of a table of CHUNK texts
        distinct: dict[str, int] = {}
        places, waiting, sizes, digest = array("q"), [], [], hashlib.blake2b(digest_size=8)
        parts: list[tuple[list[int], np.ndarray]] = []  # the lengths and ids of the chunks this rank tokenized

        def tokenize() -> None:
            digest.update("\0".join(waiting).encode("utf-8", "surrogatepass") + b"\1")
            if len(sizes) % world == me:  # this rank's chunk
                rows = tokenizer.token_rows(waiting, length)
                ids = np.fromiter(chain.from_iterable(rows), dtype=np.int32, count=sum(map(len, rows)))
                parts.append(([len(r) for r in rows], ids))
            sizes.append(len(waiting))
            waiting.clear()

        for text in texts:
            at = distinct.get(text)
            if at is None:
                at = distinct[text] = len(distinct)
                waiting.append(text)
                if len(waiting) == chunk:
                    tokenize()
            places.append(at)
        if waiting:
            tokenize()
        del distinct
        digest.update(places)
        if group is None:
            lengths, ids = _joined(parts)
        else:
            _same_texts(group, len(places), sum(sizes), digest.digest())
            lengths, ids = _shared(group, sizes, parts)
        self._places = torch.frombuffer(places, dtype=torch.int64) if places else torch.zeros(0, dtype=torch.int64)
        self._lengths, self._starts, self._ids = lengths, lengths.cumsum(0) - lengths, ids
        self.distinct = sum(sizes)
        """How many distinct texts the table holds."""

    def __len__(self) -> int:
        return len(self._places)

    def __getitem__(self, places: torch.Tensor) -> torch.Tensor:
        text = self._places[places]
        return padded(self._ids, self._starts[text], self._lengths[text], self.length, self._pad, self._left)

    @property
    def nbytes(self) -> int:
        """The memory the table keeps."""
        return sum(t.nbytes for t in (self._places, self._lengths, self._starts, self._ids))


def _joined(parts: list[tuple[list[int], np.ndarray]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(lengths int64, ids int32) of chunks tokenized (`parts`: each one's lengths and ids), laid end to end."""
    lengths = torch.tensor([n for part in parts for n in part[0]], dtype=torch.int64)
    return lengths, torch.from_numpy(np.concatenate([part[1] for part in parts]) if parts else np.zeros(0, np.int32))


def _same_texts(group: dist.ProcessGroup, count: int, distinct: int, digest: bytes) -> None:
    """Every rank of `group` read the same texts in the same order (their count, distinct count and 8-byte digest
    agree); else a DataError on every rank, naming the first that differs."""
    mine = torch.tensor([count, distinct, int.from_bytes(digest, "big") >> 1], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    other = next((r for r, t in enumerate(every) if not torch.equal(t, every[0])), None)
    if other is not None:
        (texts, unique, _), (their_texts, their_unique, _) = every[0].tolist(), every[other].tolist()
        raise DataError(
            f"ranks 0 and {other} of the run read different texts for one token table ({texts} texts, {unique} "
            f"distinct, against {their_texts} and {their_unique}): every rank reads the same rows; keep the data "
            "files unchanged while a run reads them"
        )


def _shared(
    group: dist.ProcessGroup, sizes: list[int], parts: list[tuple[list[int], np.ndarray]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lengths int64, ids int32) of every chunk in order, each chunk tokenized by rank `chunk % world` of `group`
    (`parts`: this rank's, in order) and sent by it to the others."""
    if not sizes:
        return _joined([])
    world, me = dist.get_world_size(group), dist.get_rank(group)
    lengths, ids = [], []  # per owner: its chunks' lengths, and their ids
    for owner in range(world):
        counts = sizes[owner::world]
        sent, flat = _joined(parts) if owner == me else (torch.empty(sum(counts), dtype=torch.int64), None)
        if len(sent):  # an owner of no chunk sends nothing
            dist.broadcast(sent, group=group, group_src=owner)
        flat = torch.empty(int(sent.sum()), dtype=torch.int32) if flat is None else flat
        if len(flat):
            dist.broadcast(flat, group=group, group_src=owner)
        lengths.append(sent.split(counts))
        ids.append(flat.split([int(n.sum()) for n in lengths[-1]]))
    chunks = [(c % world, c // world) for c in range(len(sizes))]  # (owner, its k-th chunk)
    return torch.cat([lengths[o][k] for o, k in chunks]), torch.cat([ids[o][k] for o, k in chunks])
