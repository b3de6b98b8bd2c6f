"""A teacher file's index written beside it (`datasets/frozen_index.py`, `index_embeddings`): `embed`'s writer leaves
FILE.index beside a .parquet or .arrow file, and a run reading the file maps it (the file's keys neither hashed nor its
vectors checked: the reader's own check is made to fail) and finds every (side, text) at the row the file read and
checked whole gives, the same sides and views; a file written by anything else, with repeated texts and no side
column, is indexed by the command; a file changed since its index is read whole with a warning; a damaged index, or
one of another table, is one line naming it and the fix; a bad file writes neither it nor an index; forked processes
look keys up in the mapped index."""

from __future__ import annotations

import logging
import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.needs import needs
from titan_contrastive.datasets import frozen, frozen_index
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.frozen import EmbeddingTable
from titan_contrastive.index_embeddings import main

pytestmark = needs("data")

TEXTS = ["a cat", " a dog ", "été à Zürich", "猫", "a cat#1"]


def _written(out: Path, views: int = 0) -> tuple[list[tuple[str, str]], np.ndarray]:
    """A file as `embed` (queries, documents) or, with `views`, `embed_images` (images and their views, captions)
    writes it: its (side, text) keys in row order and their vectors."""
    from titan_contrastive.embed import write

    if views:
        blocks = [("image", []), ("image", [f"{k:040x}" for k in range(6)])]  # a block of none: the spool's can be
        blocks += [("image", [f"{k:040x}#{v}" for k in range(6)]) for v in range(views)]
        blocks += [("caption", TEXTS)]
    else:
        blocks = [("query", TEXTS), ("document", []), ("document", TEXTS[::-1] + ["another"])]
    rng = np.random.default_rng(len(blocks))
    sides = [(side, texts, rng.standard_normal((len(texts), 5)).astype(np.float32)) for side, texts in blocks]
    write(out, sides)
    keys = [(side, text.strip()) for side, texts, _ in sides for text in texts]
    return keys, np.concatenate([v for _, _, v in sides])


def _same(a: EmbeddingTable, b: EmbeddingTable, keys: list[tuple[str, str]]) -> None:
    """`a` and `b` find each key (and a missing one) at the same row, hold the same vectors, sides and views."""
    probe = keys + [("query", "absent"), ("document", "a cat#2"), ("image", "f" * 40)]
    got, want = a.index.find(probe), b.index.find(probe)
    assert np.array_equal(got, want) and (got[len(keys) :] == -1).all()
    assert (a.sided, a.views, a.index.sides, a.dim) == (b.sided, b.views, b.index.sides, b.dim)
    assert torch.equal(a.vectors[torch.arange(len(a.vectors))], b.vectors[torch.arange(len(b.vectors))])


def _refuse_check(monkeypatch: pytest.MonkeyPatch) -> None:
    def checked(*args: object) -> None:
        raise AssertionError("the file was hashed and checked, not its index mapped")

    monkeypatch.setattr(EmbeddingTable, "_checked", classmethod(checked))


@pytest.mark.parametrize("suffix", [".arrow", ".parquet"])
@pytest.mark.parametrize("views", [0, 2])
def test_the_writer_leaves_an_index_that_a_run_maps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str, views: int
) -> None:
    out = tmp_path / f"teacher{suffix}"
    keys, vectors = _written(out, views)
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name, out.name + ".index"]
    whole = EmbeddingTable.read(str(out), "loss.teacher_embeddings", indexed=False)
    assert whole.views == views and whole.sided
    _refuse_check(monkeypatch)
    table = EmbeddingTable.read(str(out), "loss.teacher_embeddings")
    _same(table, whole, keys)
    for key in keys:
        assert table.row(*key) == keys.index(key)  # each key's first row
        assert torch.equal(table.vectors[table.row(*key)], torch.from_numpy(vectors[keys.index(key)]))
    assert not table.index.high.flags.writeable and not table.index.rows.flags.writeable  # the file's pages
    assert len(table.index.rows) == len(set(keys)) == len(keys)  # the writer's keys: each once


def test_a_file_written_elsewhere_is_indexed_by_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    file = tmp_path / "api.parquet"
    texts = ["x", "y", " x", "z", "y"]  # no side column; a repeated text with the same vector (float64, ragged types)
    rows = [[1.0, 2.0], [0.0, 3.0], [1.0, 2.0], [4.0, 4.0], [0.0, 3.0]]
    pq.write_table(
        pa.table({"text": texts, "embedding": pa.array(rows, pa.list_(pa.float64()))}), file, row_group_size=2
    )
    monkeypatch.setattr(frozen, "INDEX_HINT_ROWS", 3)
    with caplog.at_level(logging.WARNING, logger="titan_contrastive"):
        whole = EmbeddingTable.read(str(file), "loss.guide_embeddings")
    assert f"write its index once: python -m titan_contrastive.index_embeddings {file}" in caplog.text
    assert main([str(file)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {file}.index: 3 keys (no side) of 5 rows"
    caplog.clear()
    with monkeypatch.context() as patched:
        _refuse_check(patched)
        with caplog.at_level(logging.WARNING, logger="titan_contrastive"):
            table = EmbeddingTable.read(str(file), "loss.guide_embeddings")
    assert not caplog.text  # indexed: no hint
    _same(table, whole, [("", t.strip()) for t in texts])
    assert [table.row("", t) for t in ("x", "y", "z")] == [0, 1, 3] and not table.sided


def test_a_changed_file_is_read_whole_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "teacher.arrow"
    _written(out)
    index = out.with_name("teacher.arrow.index")
    kept = index.read_bytes()
    keys, _ = _written(tmp_path / "other.arrow", views=1)
    os.replace(tmp_path / "other.arrow", out)  # another table under the old name; the old index beside it
    index.write_bytes(kept)
    with caplog.at_level(logging.WARNING, logger="titan_contrastive"):
        table = EmbeddingTable.read(str(out), "loss.teacher_embeddings")
    assert f"{index} is stale" in caplog.text and "python -m titan_contrastive.index_embeddings" in caplog.text
    _same(table, EmbeddingTable.read(str(out), "k", indexed=False), keys)
    stat = out.stat()
    os.utime(out, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # the same bytes, touched
    assert main([str(out)]) == 0 and frozen_index.load(out) is not None
    os.utime(out, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="titan_contrastive"):
        assert frozen_index.load(out) is None
    assert "is stale" in caplog.text


def test_a_damaged_index_is_one_line_naming_it(tmp_path: Path) -> None:
    import pyarrow as pa

    out = tmp_path / "teacher.arrow"
    _written(out)
    index = frozen_index.index_path(out)
    saved = frozen_index.load(out)
    fix = f"write it again: python -m titan_contrastive.index_embeddings {out}"
    index.write_bytes(b"not arrow at all")
    with pytest.raises(DataError, match=f"loss.teacher_embeddings={out}: its index {index} is not readable") as e:
        EmbeddingTable.read(str(out), "loss.teacher_embeddings")
    assert fix in str(e.value) and "\n" not in str(e.value)
    with pa.ipc.new_file(str(index), pa.schema([("high", pa.uint64())])) as writer:
        writer.write_batch(pa.record_batch([pa.array([1], pa.uint64())], names=["high"]))
    with pytest.raises(DataError, match="is not an index of version 1") as e:
        EmbeddingTable.read(str(out), "k")
    assert fix in str(e.value)
    frozen_index.save(out, frozen_index.Saved(saved.index, saved.rows + 1, saved.dim, True, 0), out)
    with pytest.raises(
        DataError, match=f"names {saved.rows + 1} rows of 5 numbers where the file has {saved.rows} of 5"
    ):
        EmbeddingTable.read(str(out), "k")
    table = EmbeddingTable.read(str(out), "k", indexed=False)  # the file itself is sound
    assert len(table.vectors) == saved.rows


def test_a_bad_file_writes_no_index(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from titan_contrastive.embed import write

    out = tmp_path / "teacher.arrow"
    vectors = np.ones((3, 4), dtype=np.float32)
    vectors[1] = 0
    with pytest.raises(DataError, match=f"--out={out}: row 1's embedding is zero or not finite"):
        write(out, [("query", ["a", "b", "c"], vectors)])
    assert not list(tmp_path.iterdir())  # neither the file, nor its index, nor a temporary one
    good = tmp_path / "good.parquet"
    write(good, [("query", ["a"], np.ones((1, 4), dtype=np.float32))])
    good.with_name("good.parquet.index").unlink()
    for argv, why in (
        ([str(good), str(tmp_path / "t.jsonl")], "t.jsonl: not an existing .parquet or .arrow file"),
        ([str(tmp_path / "missing.arrow")], "missing.arrow: not an existing"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1 and err.startswith("error: FILE=")
    assert not good.with_name("good.parquet.index").exists()  # nothing indexed before every FILE was found
    import pyarrow as pa

    pa.ipc.new_file(str(out), pa.schema([("text", pa.string())])).close()
    assert main([str(out)]) == 2
    assert "the embeddings file needs text and embedding" in capsys.readouterr().err
    assert not frozen_index.index_path(out).exists()


def test_forked_processes_look_keys_up_in_the_mapped_index(tmp_path: Path) -> None:
    out = tmp_path / "teacher.arrow"
    keys, _ = _written(out)
    table = EmbeddingTable.read(str(out), "k")
    fork = multiprocessing.get_context("fork")
    got, sent = fork.Pipe(duplex=False)
    child = fork.Process(target=lambda: sent.send(table.index.find(keys).tolist()))
    child.start()
    found = got.recv()
    child.join()
    assert child.exitcode == 0 and found == [keys.index(key) for key in keys]
