"""Rows of (side, key, vector) that every rank of a job computes chunk by chunk, gathered by rank 0 and spooled to its
disk as they come, so that no process holds the vectors: how `python -m titan_contrastive.embed_images` writes a
teacher's file of any size.

The file's rows come in blocks (the images at one view, the captions; the queries, the documents), each of one side.
Each round every rank `send`s a block's keys and vectors [n, d] of the chunk it computed (none where it has no chunk
left); rank 0 gathers them through the device in rank order and appends each key's first row of the block to the
block's file in a hidden folder beside the output. When rank r computes chunks r, r + W, r + 2W, ... of the items
(`shard`), the rows arrive in the order one process computes them, so W ranks write the file one process writes.
The keys go to the folder too (their UTF-8 bytes and where each ends): rank 0 holds only their digests, 16 bytes a key
(`text_index.FirstSeen`). `rows()` gives the blocks' sides and sizes, the kept keys as an Arrow string array and their
vectors as one float32 [N, d] array, both mapped from disk; leaving the `with` block removes the folder, whether the
file was written or not."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from titan_contrastive.datasets.text_index import FirstSeen

__all__ = ["RowSpool", "shard"]

FILES = ("f32", "keys", "ends")
"""Each block's files: its vectors (float32), its keys' UTF-8 bytes, where each key's bytes end (int64)."""
STRING_BYTES = 1 << 31
"""Keys of this many bytes or more are a large_string array (64-bit offsets); fewer, a string array."""


def shard(n: int, size: int, rank: int, world: int) -> tuple[list[int], int]:
    """(the items rank `rank` of `world` computes: chunks rank, rank + world, ... of `n` items in chunks of `size`; the
    rounds every rank takes, one chunk a round)."""
    starts = range(rank * size, n, world * size)
    return [i for start in starts for i in range(start, min(start + size, n))], -(-n // (size * world))


class RowSpool:
    """Rank 0's files of the rows every rank sends, one set per block of `sides` (each block's side, in the file's
    order), in a hidden folder in `folder`; the other ranks pass `folder=None` and keep nothing."""

    def __init__(self, sides: Sequence[str], folder: Path | None, world: int, device: torch.device) -> None:
        self.sides, self.world, self.device = list(sides), world, device
        self.seen = [FirstSeen() for _ in self.sides]
        self.counts, self.sizes = [0] * len(self.sides), [0] * len(self.sides)  # rows and key bytes kept per block
        self.width = 0
        self.folder = None if folder is None else tempfile.TemporaryDirectory(dir=folder, prefix=".rows-")
        self.paths = [] if self.folder is None else [self._path(b) for b in range(len(sides))]
        self.files = [[open(path, "wb") for path in paths] for paths in self.paths]  # closed by rows() or __exit__

    def _path(self, block: int) -> list[Path]:
        return [Path(self.folder.name) / f"{block}.{kind}" for kind in FILES]

    def __enter__(self) -> RowSpool:
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self._close()
        if self.folder is not None:
            self.folder.cleanup()

    def _close(self) -> None:
        for file in (file for files in self.files for file in files):
            file.close()

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
        """Each key's first row of `block`, from `parts` (keys, vectors) in order, onto the block's files."""
        vector_file, key_file, end_file = self.files[block]
        for keys, vectors in parts:
            new = self.seen[block].new(keys)
            if not new.any():
                continue
            self.width = vectors.shape[1]
            kept = vectors if new.all() else vectors[torch.from_numpy(new)]
            vector_file.write(memoryview(np.ascontiguousarray(kept.cpu().numpy(), dtype=np.float32)))
            named = [key.encode() for key, fresh in zip(keys, new.tolist()) if fresh]
            ends = self.sizes[block] + np.cumsum([len(key) for key in named], dtype=np.int64)
            key_file.write(b"".join(named))
            end_file.write(memoryview(ends))
            self.counts[block] += len(named)
            self.sizes[block] = int(ends[-1])

    def block(self, block: int) -> np.ndarray:
        """The vectors of `block` kept so far [n, d] float32, mapped from its file (rank 0, before `rows()`)."""
        self.files[block][0].flush()
        return self._mapped(self.paths[block][0], self.counts[block])

    def _mapped(self, path: Path, n: int) -> np.ndarray:
        shape = (n, self.width)
        return np.memmap(path, np.float32, "r", shape=shape) if n else np.zeros(shape, np.float32)

    def rows(self) -> tuple[list[tuple[str, int]], Any, np.ndarray]:
        """(each block's side and its number of rows, the rows' keys (a pyarrow string array over the mapped key
        file: large_string past 2 GiB of keys), their vectors [N, d] float32 mapped from disk), in block order; on rank
        0 only, after the last round."""
        import pyarrow as pa

        self._close()
        self.seen = []  # the digests, no longer needed
        n, size = sum(self.counts), sum(self.sizes)
        offsets = np.zeros(n + 1, dtype=np.int32 if size < STRING_BYTES else np.int64)  # the blocks' ends, joined
        at, base = 1, 0
        for (_, _, ends), count, length in zip(self.paths, self.counts, self.sizes):
            if count:
                np.add(np.memmap(ends, np.int64, "r"), base, out=offsets[at : at + count], casting="unsafe")
            at, base = at + count, base + length
            ends.unlink()
        for k in (0, 1):  # the blocks one after another: one file of vectors, one of keys
            with open(self.paths[0][k], "ab") as joined:
                for files in self.paths[1:]:
                    with open(files[k], "rb") as part:
                        shutil.copyfileobj(part, joined, 1 << 24)
                    files[k].unlink()
        data = pa.memory_map(str(self.paths[0][1])).read_buffer() if size else pa.py_buffer(b"")
        kind = pa.StringArray if offsets.dtype == np.int32 else pa.LargeStringArray
        keys = kind.from_buffers(n, pa.py_buffer(offsets), data)
        sides = [(side, count) for side, count in zip(self.sides, self.counts)]
        return sides, keys, self._mapped(self.paths[0][0], n)
