"""A frozen model's embeddings in an .arrow file (`datasets/frozen.py`, `Vectors`): an uncompressed Arrow IPC file of
float32 lists is mapped, not read (every chunk's vectors lie in this process's mapping of the file, as
/proc/self/maps lists it, so the ranks and data workers of a machine read one copy), and reads as the same rows as
its .parquet twin, any row of any record batch served; `embed` writes such a file; a compressed or float64 file
is read into memory with a warning; a bad file is one line naming its row across batches; forked data workers serve
what the run's own process reads."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.needs import needs
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.frozen import TEACHER_LOGIT_SCALE, EmbeddingTable

pytestmark = needs("data")


def _mappings(file: Path) -> list[tuple[int, int]]:
    """(start, end) of each region of this process's memory mapped from `file`."""
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].strip() == str(file.resolve()):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            found.append((start, end))
    return found


def _in_file(table: EmbeddingTable, file: Path) -> bool:
    regions = _mappings(file)
    return all(
        any(a <= c.data_ptr() and c.data_ptr() + c.nbytes <= b for a, b in regions) for c in table.vectors.chunks
    )


def _feather(path: Path, texts: list[str], vectors: np.ndarray, *, chunksize: int, **options: object) -> Path:
    """A table of `texts` and their `vectors` (lists of their dtype) written by pyarrow's own Feather writer."""
    import pyarrow as pa
    import pyarrow.feather as feather

    kind = pa.list_(pa.from_numpy_dtype(vectors.dtype))
    table = pa.table({"text": texts, "embedding": pa.array(list(vectors), type=kind)})
    feather.write_feather(table, path, chunksize=chunksize, **options)
    return path


def _rows(n: int, d: int, seed: int = 0) -> tuple[list[str], np.ndarray]:
    return [f"text {i}" for i in range(n)], np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)


@needs("hf")
def test_an_arrow_file_embed_writes_is_mapped_and_reads_as_its_parquet_twin(tmp_path: Path) -> None:
    from titan_contrastive.embed import write

    texts, vectors = _rows(40, 6)
    sides = [("query", texts[:15], vectors[:15]), ("document", texts[15:], vectors[15:])]
    tables = {}
    for suffix in (".arrow", ".parquet"):
        file = tmp_path / f"e{suffix}"
        write(file, sides, {TEACHER_LOGIT_SCALE: "2.5"})
        tables[suffix] = EmbeddingTable.read(str(file), "loss.teacher_embeddings")
        assert tables[suffix].logit_scale == 2.5 and tables[suffix].sided
    arrow, parquet = tables[".arrow"], tables[".parquet"]
    assert len(arrow.vectors.chunks) == 1 and arrow.vectors.mapped and not parquet.vectors.mapped
    assert _mappings(tmp_path / "e.arrow") and _in_file(arrow, tmp_path / "e.arrow")
    assert not _mappings(tmp_path / "e.parquet")
    for i, text in enumerate(texts):
        side = "query" if i < 15 else "document"
        assert arrow.row(side, text) == parquet.row(side, text) == i
        assert torch.equal(arrow.vectors[i], torch.from_numpy(vectors[i]))
    queries, documents = arrow.find(texts[:3], texts[20:22])
    assert queries.tolist() == [0, 1, 2] and documents.tolist() == [20, 21]


def test_any_row_of_any_record_batch_is_served(tmp_path: Path) -> None:
    texts, vectors = _rows(50, 5, seed=1)
    file = _feather(tmp_path / "e.arrow", texts, vectors, chunksize=7, compression="uncompressed")
    table = EmbeddingTable.read(str(file), "loss.teacher_embeddings")
    assert len(table.vectors.chunks) == 8 and table.vectors.mapped and _in_file(table, file)
    edges = torch.tensor([[0, 6, 7, 13], [14, 48, 49, 49]])  # each batch's first and last rows
    rows = torch.cat([edges, torch.randint(0, 50, (3, 4), generator=torch.Generator().manual_seed(0))])
    assert torch.equal(table.vectors[rows], torch.from_numpy(vectors)[rows])
    assert table.vectors[torch.empty(0, dtype=torch.int64)].shape == (0, 5)
    assert [table.row("", t) for t in texts] == list(range(50))


@pytest.mark.parametrize("how", ["zstd", "float64"])
def test_a_file_read_into_memory_is_said_so(tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str) -> None:
    texts, vectors = _rows(30, 4, seed=2)
    caplog.set_level(logging.WARNING, logger="titan_contrastive")
    plain = EmbeddingTable.read(
        str(_feather(tmp_path / "plain.arrow", texts, vectors, chunksize=8, compression="uncompressed")), "k"
    )
    assert plain.vectors.mapped and not caplog.text
    stored = vectors.astype(np.float64) if how == "float64" else vectors
    options = {"compression": "zstd"} if how == "zstd" else {"compression": "uncompressed"}
    file = _feather(tmp_path / f"{how}.arrow", texts, stored, chunksize=8, **options)
    table = EmbeddingTable.read(str(file), "loss.teacher_embeddings")
    assert not table.vectors.mapped and not _in_file(table, file)
    every = torch.arange(30)
    assert torch.equal(table.vectors[every], plain.vectors[every])
    (message,) = [r.getMessage() for r in caplog.records]
    assert f"loss.teacher_embeddings={file}: its vectors are held in this process's memory" in message
    assert "write it uncompressed with float32 lists" in message and "\n" not in message


def test_a_bad_arrow_file_is_one_line_naming_its_row(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.feather as feather

    texts, vectors = _rows(16, 4, seed=3)
    zero = vectors.copy()
    zero[9] = 0
    twice = [*texts[:10], texts[2], *texts[11:]]
    cases = [
        (
            "zero",
            _feather(tmp_path / "zero.arrow", texts, zero, chunksize=4),
            "row 9's embedding is zero or not finite",
        ),
        ("twice", _feather(tmp_path / "twice.arrow", twice, vectors, chunksize=4), "rows 2 and 10 give text 'text 2'"),
    ]
    ragged = pa.array([list(v) for v in vectors[:8]] + [[*v, 1.0] for v in vectors[8:]], type=pa.list_(pa.float32()))
    feather.write_feather(pa.table({"text": texts, "embedding": ragged}), tmp_path / "ragged.arrow", chunksize=4)
    cases.append(("ragged", tmp_path / "ragged.arrow", "embeddings of 4, 5 numbers"))
    nulls = pa.array([list(v) for v in vectors[:12]] + [None] * 4, type=pa.list_(pa.float32()))
    feather.write_feather(pa.table({"text": texts, "embedding": nulls}), tmp_path / "nulls.arrow", chunksize=4)
    cases.append(("nulls", tmp_path / "nulls.arrow", "its embedding column holds list<item: float>"))
    sides = ["query"] * 7 + ["passage"] + ["document"] * 8
    feather.write_feather(
        pa.table({"text": texts, "side": sides, "embedding": pa.array(list(vectors))}), tmp_path / "side.arrow",
        chunksize=4,
    )  # fmt: skip
    cases.append(("side", tmp_path / "side.arrow", "row 7's side is 'passage'"))
    feather.write_feather(
        pa.table({"text": texts[:0], "embedding": pa.array([], pa.list_(pa.float32()))}), tmp_path / "none.arrow"
    )
    cases.append(("none", tmp_path / "none.arrow", "no rows"))
    (tmp_path / "junk.arrow").write_bytes(b"not arrow at all")
    cases.append(("junk", tmp_path / "junk.arrow", r"not a readable arrow file \(ArrowInvalid"))
    for name, file, message in cases:
        with pytest.raises(DataError) as e:
            EmbeddingTable.read(str(file), "loss.guide_embeddings")
        assert str(e.value).startswith(f"loss.guide_embeddings={file}: ") and "\n" not in str(e.value), name
        assert e.match(message), (name, str(e.value))


@needs("hf")
def test_forked_data_workers_serve_what_the_run_reads(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader

    from tests.test_frozen_embeddings import _records, _write
    from tests.test_static import ROWS, static_run

    records = _records(ROWS, width=7)
    parquet = EmbeddingTable.read(str(_write(tmp_path / "e.parquet", records)), "loss.teacher_embeddings")
    file = _write(tmp_path / "e.arrow", records)
    trainer = static_run(
        tmp_path, "--loss.symmetric=false", "--loss.distill=kl", f"--loss.teacher_embeddings={file}",
        "--training.local_batch_size=4",
    )  # fmt: skip
    data = trainer.train_set
    loader = DataLoader(data, batch_size=3, num_workers=2, collate_fn=lambda b: b, multiprocessing_context="fork")
    served = list(loader)
    assert len(served) == -(-len(data) // 3)
    for j, batch in enumerate(served):
        indices = list(range(3 * j, min(3 * j + 3, len(data))))
        assert torch.equal(batch["frozen_query"], data.__getitems__(indices)["frozen_query"])
        for i, row in enumerate(indices):
            q, p, n = ROWS[row]
            assert torch.equal(batch["frozen_query"][i], parquet.vectors[parquet.row("query", q)])
            assert torch.equal(batch["frozen_doc"][i, 0], parquet.vectors[parquet.row("document", p)])
            assert torch.equal(batch["frozen_doc"][i, 1], parquet.vectors[parquet.row("document", n)])
    trainer.metrics.close()


def test_one_record_batch_is_indexed_in_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file of one record batch (what `embed` writes) made strs `PART_ROWS` rows at a time (forced to 3): every
    text found at its row, and a repeated text with another vector named by both rows, across parts."""
    from titan_contrastive.datasets import frozen

    monkeypatch.setattr(frozen, "PART_ROWS", 3)
    texts, vectors = _rows(16, 4)
    file = _feather(tmp_path / "one.arrow", texts, vectors, chunksize=16)
    parts = frozen._read_arrow_table(file)[0]
    assert [names for names, _ in parts()] == [texts[i : i + 3] for i in range(0, 16, 3)]
    table = EmbeddingTable.read(str(file), "key")
    assert len(table.vectors.chunks) == 1
    assert table.index.find([("", text) for text in texts]).tolist() == list(range(16))
    twice = [*texts[:10], texts[2], *texts[11:]]
    with pytest.raises(DataError, match="rows 2 and 10 give text 'text 2'"):
        EmbeddingTable.read(str(_feather(tmp_path / "twice.arrow", twice, vectors, chunksize=16)), "key")
