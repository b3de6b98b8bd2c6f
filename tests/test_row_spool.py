"""Rank 0's spool of the rows every rank sends (`row_spool`, how `embed_images` writes a teacher's file): on 1, 2 and 3
gloo processes, rounds of ragged chunks (a rank with none left, a round with no rows at all, keys repeated within a
chunk, across ranks and across rounds, each copy its own vector), checked against the definition written here: every
rank's rows in round then rank order, each key's first row of its block kept. The rows reach rank 0's disk as they
come (the block's file grows with each round), the other ranks keep nothing, and the folder is gone after the `with`
block, on success and on failure. `shard` hands the ranks the chunks of one process, each item once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.dist_utils import run_distributed
from tests.needs import needs
from titan_contrastive import row_spool
from titan_contrastive.row_spool import RowSpool, shard

SIDES = ["image", "image", "caption"]
WIDTH = 3


def sent(world: int) -> list[list[list[tuple[list[str], torch.Tensor | None]]]]:
    """sent[round][rank][block]: (keys, vectors [n, WIDTH] or None) of 3 rounds; each vector names its key's copy."""
    rounds: list[list[list[tuple[list[str], torch.Tensor | None]]]] = []
    for t in range(3):
        ranks = []
        for r in range(world):
            blocks = []
            for b in range(len(SIDES)):
                n = 0 if (t == 1 or (r == world - 1 and t == 2)) else (r + b + t) % 4 + 1  # round 1: no rows at all
                keys = [f"k{(r + 2 * t + i) % 5}" for i in range(n)]  # repeats within, across ranks and rounds
                rows = torch.tensor([[t, r, i + 10 * b] for i in range(n)], dtype=torch.float64)
                blocks.append((keys, rows if n else None))
            ranks.append(blocks)
        rounds.append(ranks)
    return rounds


def definition(world: int) -> tuple[list[tuple[str, int]], list[str], np.ndarray]:
    """Each block's keys in round then rank order, each key's first row kept; the blocks in order."""
    sides, keys, rows = [], [], []
    for b, side in enumerate(SIDES):
        first: dict[str, list[float]] = {}
        for ranks in sent(world):
            for blocks in ranks:
                names, vectors = blocks[b]
                for i, key in enumerate(names):
                    first.setdefault(key, vectors[i].tolist())
        sides.append((side, len(first)))
        keys += list(first)
        rows += list(first.values())
    return sides, keys, np.asarray(rows, np.float32)


def spool_rows(folder: Path, rank: int, world: int) -> tuple[list[tuple[str, int]], list[str], np.ndarray] | None:
    """What rank `rank` of `world` spools of `sent`, checking on rank 0 that each round's rows are on disk."""
    with RowSpool(SIDES, None if rank else folder, world, torch.device("cpu")) as spool:
        assert (spool.folder is None) == bool(rank) and bool(spool.files) == (rank == 0)
        held = [0] * len(SIDES)
        for ranks in sent(world):
            for b in range(len(SIDES)):
                spool.send(b, *ranks[rank][b])
                if not rank:  # the block's files hold every row kept so far: its vectors, its keys and their ends
                    for file in spool.files[b]:
                        file.flush()
                    held[b] = spool.counts[b]
                    vectors, keys, ends = (path.stat().st_size for path in spool.paths[b])
                    assert (vectors, keys, ends) == (held[b] * WIDTH * 4, spool.sizes[b], held[b] * 8)
        if rank:
            assert spool.counts == [0, 0, 0] and spool.files == []
            return None
        sides, keys, vectors = spool.rows()
        got = sides, keys.to_pylist(), np.array(vectors)
        assert isinstance(vectors, np.memmap) and str(keys.type) == "string"
    return got


def assert_rows(got: tuple[list[tuple[str, int]], list[str], np.ndarray], want: tuple) -> None:
    assert got[0] == want[0]
    assert got[1] == want[1]
    np.testing.assert_array_equal(got[2], want[2])


def _on_ranks(folder: str, world: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    got = spool_rows(Path(folder), rank, world)
    if rank == 0:
        assert_rows(got, definition(world))
        assert not list(Path(folder).iterdir())  # the spool's folder is gone


@pytest.mark.parametrize("world", [2, 3])
def test_rank_0_spools_every_rank_s_rows_in_the_order_of_one_process(tmp_path: Path, world: int) -> None:
    run_distributed(_on_ranks, world, str(tmp_path), world)


def test_one_process_spools_its_own_rows(tmp_path: Path) -> None:
    assert_rows(spool_rows(tmp_path, 0, 1), definition(1))
    assert not list(tmp_path.iterdir())


def test_a_failure_leaves_nothing_behind(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="stopped"), RowSpool(SIDES, tmp_path, 1, torch.device("cpu")) as spool:
        spool.send(0, ["a"], torch.ones(1, WIDTH))
        raise RuntimeError("stopped")
    assert not list(tmp_path.iterdir())


def test_no_rows_are_an_empty_array(tmp_path: Path) -> None:
    with RowSpool(SIDES, tmp_path, 1, torch.device("cpu")) as spool:
        spool.send(0, [], None)
        sides, keys, vectors = spool.rows()
    assert sides == [(side, 0) for side in SIDES] and keys.to_pylist() == [] and vectors.shape == (0, 0)


@pytest.mark.parametrize("n, size, world", [(0, 3, 2), (1, 3, 4), (10, 3, 2), (11, 4, 3), (12, 4, 3), (7, 7, 1)])
def test_the_ranks_chunks_are_those_of_one_process(n: int, size: int, world: int) -> None:
    """In round then rank order, the ranks' chunks are one process's chunks of `size`: each item once, in order."""
    mine = [shard(n, size, rank, world) for rank in range(world)]
    rounds = {r for _, r in mine}
    assert len(rounds) == 1
    [count] = rounds
    assert count == -(-n // (size * world))
    order = [i for t in range(count) for items, _ in mine for i in items[t * size : (t + 1) * size]]
    assert order == list(range(n))


@needs("data")
@pytest.mark.parametrize("large", [False, True])
@pytest.mark.parametrize("suffix", [".arrow", ".parquet", ".jsonl"])
def test_the_spooled_keys_write_a_file_that_reads_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str, large: bool
) -> None:
    """Keys of any UTF-8 (accents, CJK, an emoji), repeated across blocks, as `embed` writes them: the file reads
    back (`EmbeddingTable`) with each (side, key) at its first vector; past `STRING_BYTES` (forced) the keys are a
    large_string array and read the same."""
    from titan_contrastive.datasets.frozen import EmbeddingTable
    from titan_contrastive.embed import write_rows

    if large:
        monkeypatch.setattr(row_spool, "STRING_BYTES", 1)
    texts = ["café", "鍵 の 文", "🙂 smile", "plain", "café"]
    with RowSpool(["query", "document"], tmp_path, 1, torch.device("cpu")) as spool:
        for block in (0, 1):
            for start in (0, 2):
                part = texts[start : start + 3]
                spool.send(block, part, torch.tensor([[block + 1.0, start + i, 1.0] for i in range(len(part))]))
        sides, keys, vectors = spool.rows()
        assert str(keys.type) == ("large_string" if large else "string")
        write_rows(tmp_path / f"e{suffix}", sides, keys, vectors)
    table = EmbeddingTable.read(str(tmp_path / f"e{suffix}"), "loss.teacher_embeddings")
    distinct = list(dict.fromkeys(texts))
    first = {text: (0, texts.index(text)) if text in texts[:3] else (2, texts[2:].index(text)) for text in distinct}
    for block, side in enumerate(("query", "document")):
        rows = table.vectors[table.index.find([(side, text) for text in distinct])]
        assert rows.tolist() == [[block + 1.0, sum(first[text]), 1.0] for text in distinct]
    assert sides == [("query", 4), ("document", 4)] and not list(tmp_path.glob(".rows-*"))
