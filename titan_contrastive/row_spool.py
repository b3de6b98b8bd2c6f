"""Rows of (side, key, vector) that every rank of a job computes chunk by chunk, gathered by rank 0 and spooled to its
disk as they come, so that no process holds the vectors: how `python -m titan_contrastive.embed_images` writes a
teacher's file of any size.

The file's rows come in blocks (the images at one view, the captions; the queries, the documents), each of one side.
Each round every rank `send`s a block's keys and vectors [n, d] of the chunk it computed (none where it has no chunk
left); rank 0 gathers them through the device in rank order and appends each key's first row of the block to the
block's file in a hidden folder beside the output. When rank r computes chunks r, r + W, r + 2W, ... of the items
(`shard`), the rows arrive in the order one process computes them, so W ranks write the file one process writes.
`rows()` gives the blocks' sides and sizes, the kept keys and their vectors as one float32 [N, d] array mapped from
disk; leaving the `with` block removes the folder, whether the file was written or not."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["RowSpool", "shard"]


def shard(n: int, size: int, rank: int, world: int) -> tuple[list[int], int]:
    """(the items rank `rank` of `world` computes: chunks rank, rank + world, ... of `n` items in chunks of `size`; the
    rounds every rank takes, one chunk a round)."""
    starts = range(rank * size, n, world * size)
    return [i for start in starts for i in range(start, min(start + size, n))], -(-n // (size * world))


class RowSpool:
    """Rank 0's files of the rows every rank sends, one per block of `sides` (each block's side, in the file's order),
    in a hidden folder in `folder`; the other ranks pass `folder=None` and keep nothing."""

    def __init__(self, sides: Sequence[str], folder: Path | None, world: int, device: torch.device) -> None:
        self.sides, self.world, self.device = list(sides), world, device
        self.keys: list[list[str]] = [[] for _ in self.sides]
        self.seen: list[set[str]] = [set() for _ in self.sides]
        self.width = 0
        self.folder = None if folder is None else tempfile.TemporaryDirectory(dir=folder, prefix=".rows-")
        self.paths = [] if self.folder is None else [Path(self.folder.name) / f"{b}.f32" for b in range(len(sides))]
        self.files = [open(path, "wb") for path in self.paths]  # closed by rows() or __exit__

    def __enter__(self) -> RowSpool:
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, trace: TracebackType | None) -> None:
        for file in self.files:
            file.close()
        if self.folder is not None:
            self.folder.cleanup()

    def send(self, block: int, keys: Sequence[str], vectors: torch.Tensor | None) -> None:
        """This rank's rows of `block` this round, `keys` and their `vectors` [n, d] (None: no rows). Every rank calls
        it each round for the same blocks in the same order."""
        local = torch.zeros(0, 0, device=self.device) if vectors is None else vectors.float()
        if self.world == 1:
            self._append(block, [(list(keys), local)])
            return
        first = dist.get_rank() == 0
        sizes = torch.tensor([len(local), local.shape[1]], device=local.device)
        every = [torch.empty_like(sizes) for _ in range(self.world)]
        dist.all_gather(every, sizes)
        counts, widths = zip(*(part.tolist() for part in every))
        named: list[list[str]] | None = [[] for _ in range(self.world)] if first else None
        dist.gather_object(list(keys), named, dst=0)
        if not max(counts):
            return
        padded = local.new_zeros(max(counts), max(widths))
        if len(local):
            padded[: len(local)] = local
        parts = [torch.empty_like(padded) for _ in range(self.world)] if first else None
        dist.gather(padded, parts, dst=0)
        if first:
            self._append(block, [(named[r], parts[r][: counts[r]]) for r in range(self.world)])

    def _append(self, block: int, parts: Sequence[tuple[list[str], torch.Tensor]]) -> None:
        """Each key's first row of `block`, from `parts` (keys, vectors) in order, onto the block's file."""
        seen, kept = self.seen[block], self.keys[block]
        for keys, vectors in parts:
            take = [i for i, key in enumerate(keys) if not (key in seen or seen.add(key))]
            if take:
                self.width = vectors.shape[1]
                kept += [keys[i] for i in take]
                self.files[block].write(vectors[take].cpu().numpy().astype(np.float32, copy=False).tobytes())

    def block(self, block: int) -> np.ndarray:
        """The vectors of `block` kept so far [n, d] float32, mapped from its file (rank 0, before `rows()`)."""
        self.files[block].flush()
        return self._mapped(self.paths[block], len(self.keys[block]))

    def _mapped(self, path: Path, n: int) -> np.ndarray:
        shape = (n, self.width)
        return np.memmap(path, np.float32, "r", shape=shape) if n else np.zeros(shape, np.float32)

    def rows(self) -> tuple[list[tuple[str, int]], list[str], np.ndarray]:
        """(each block's side and its number of rows, the rows' keys, their vectors [N, d] float32 mapped from disk),
        in block order; on rank 0 only, after the last round."""
        for file in self.files:
            file.close()
        with open(self.paths[0], "ab") as joined:  # the blocks one after another: one array
            for path in self.paths[1:]:
                with open(path, "rb") as part:
                    shutil.copyfileobj(part, joined, 1 << 24)
                path.unlink()
        vectors = self._mapped(self.paths[0], sum(len(keys) for keys in self.keys))
        return (
            [(side, len(keys)) for side, keys in zip(self.sides, self.keys)],
            [k for keys in self.keys for k in keys],
            vectors,
        )
