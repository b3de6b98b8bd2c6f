"""Table files read a row at a time (`datasets/tables.py`): a JSON string's own line separators stay in it, an Arrow
file read in batches gives pyarrow's rows, a damaged file read by vl_pairs as it packs or by text pairs is still one
line naming the file, and text pairs hold each distinct text once, never the whole file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.needs import needs
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.pair_rows import read_rows
from titan_contrastive.datasets.tables import BATCH, read_table, table_rows
from titan_contrastive.datasets.vl_pairs import VLPairsDataset

ODD = "a caption\u2028with a line separator,\x85a next line and\u2029a paragraph separator"
"""Characters `str.splitlines` breaks at that JSON writes as they are (`ensure_ascii=False`)."""


def test_a_json_string_keeps_the_line_separators_json_allows_in_it(tmp_path: Path) -> None:
    rows = [{"query_text": ODD, "doc_text": f"d {i}", "query": f"q {i}", "pos": [ODD]} for i in range(3)]
    file = tmp_path / "rows.jsonl"
    file.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    text = file.read_text(encoding="utf-8")
    assert text.count("\n") == 3 and len(text.splitlines()) == 3 * 7  # what the lines were split at before
    assert read_table(file, (), "train") == (None, rows)
    data = VLPairsDataset(split="train", path=str(file), mode="t2t")
    assert len(data) == 3 and data._fields(0, 2)["query_text"] == ODD
    assert read_rows(str(file), ("query", "pos")).texts == [[f"q {i}", ODD] for i in range(3)]


def test_rows_are_read_as_they_are_iterated(tmp_path: Path) -> None:
    """The first row comes before a bad line further on is read; the CSV's header comes before any row."""
    file = tmp_path / "rows.jsonl"
    file.write_text('{"a": 1}\n\n{"a": 2}\nnot json\n')
    names, rows = table_rows(file, (), "train")
    assert names is None and next(rows) == {"a": 1} and next(rows) == {"a": 2}
    with pytest.raises(DataError, match=r"rows.jsonl:4: not a JSON line"):
        next(rows)
    table = tmp_path / "rows.tsv"
    table.write_text("x\ty\n1\t2\n3\t4\n")
    names, rows = table_rows(table, ("x", "y"), "train")
    assert names == ["x", "y"] and list(rows) == [{"x": "1", "y": "2"}, {"x": "3", "y": "4"}]
    assert read_table(table, (), "train") == (None, [["x", "y"], ["1", "2"], ["3", "4"]])  # no header named


@needs("data")
def test_an_arrow_table_read_in_batches_gives_its_rows(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 2 * BATCH + 7
    table = pa.table(
        {
            "query_text": [f"q {i}" for i in range(n)],
            "doc_text": ["d"] * n,
            "doc_negatives": [[f"n {i}"] * (i % 3) for i in range(n)],
        }
    )
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=BATCH // 3)
    assert read_table(tmp_path / "rows.parquet", (), "train") == (table.column_names, table.to_pylist())
    data = VLPairsDataset(split="train", path=str(tmp_path / "rows.parquet"), mode="t2t", hard_negatives=False)
    assert len(data) == n and data._files[0].negatives.tolist() == [i % 3 for i in range(n)]


@pytest.mark.parametrize("kind", ["jsonl", "csv", pytest.param("parquet", marks=needs("data"))])
def test_a_damaged_file_is_one_line_naming_it(tmp_path: Path, kind: str) -> None:
    """Damaged after good rows: the error comes as vl_pairs reads the file, one line naming it (and the line)."""
    file = tmp_path / f"rows.{kind}"
    good = [{"query_text": f"q {i}", "doc_text": f"d {i}"} for i in range(50)]
    if kind == "jsonl":
        file.write_text("".join(json.dumps(r) + "\n" for r in good) + '{"query_text": \n')
        says = r"rows.jsonl:51: not a JSON line"
    elif kind == "csv":
        file.write_bytes(b"query_text,doc_text\n" + b"".join(f"q {i},d {i}\n".encode() for i in range(50)) + b"\xff\n")
        says = r"rows.csv: not readable \(UnicodeDecodeError"
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(good), file)
        file.write_bytes(file.read_bytes()[:-40])
        says = r"rows.parquet: not a readable parquet file \(\w+"
    with pytest.raises(DataError, match=says):
        VLPairsDataset(split="train", path=str(file), mode="t2t")
    with pytest.raises(DataError, match=says):  # text pairs, read a row at a time too
        read_rows(str(file), ("query_text", "doc_text"))


def _passage(text: str, i: int) -> dict[str, str]:
    return {"docid": str(i), "title": "", "text": text}


def test_text_pairs_hold_each_distinct_text_once_and_never_the_whole_file(tmp_path: Path) -> None:
    """tevatron's rows of a corpus's passages, each passage the negative of many queries, in two shards: the rows are
    read one at a time and a passage read again is the text already held, so reading them takes a small part of the
    file's bytes (holding the file's rows, or a copy of each passage per row, takes more than the file)."""
    import tracemalloc

    corpus = [f"passage {i} " + "lorem ipsum " * 399 + "lorem" for i in range(4)]  # ~4.8 KB each
    rows = [
        {
            "query": f"query {i}",
            "positive_passages": [_passage(corpus[i % 4], i % 4)],
            "negative_passages": [_passage(corpus[(i + j) % 4], (i + j) % 4) for j in range(1, 6)],
        }
        for i in range(240)
    ]
    folder = tmp_path / "shards"
    folder.mkdir()
    for k, part in enumerate((rows[:120], rows[120:])):
        (folder / f"part-{k}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    size = sum(f.stat().st_size for f in folder.iterdir())
    columns = ("query", "positive_passages", "negative_passages")
    tracemalloc.start()
    try:
        read = read_rows(str(folder), columns, pooled=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [r[0] for r in read.texts] == [f"query {i}" for i in range(240)]
    assert all(row[1:] == [corpus[(i + j) % 4] for j in range(6)] for i, row in enumerate(read.texts))
    assert read.texts[0][1] is read.texts[4][1] is read.texts[200][1]  # the same text object, across the shards too
    assert size > 6_000_000 and peak < size / 8, (peak, size)
    seen: dict[str, str] = {}  # `::`-joined sources share what they read, as PairsDataset reads them
    first, second = (read_rows(str(f), columns, pooled=True, seen=seen) for f in sorted(folder.iterdir()))
    assert first.texts[0][1] is second.texts[80][1] and len(seen) == 240 + 4


def test_a_named_column_no_json_row_has_is_one_line(tmp_path: Path) -> None:
    """As a CSV's header is checked: not a bad row for every line of the file."""
    file = tmp_path / "rows.jsonl"
    file.write_text("".join(json.dumps({"query": f"q {i}", "pos": f"d {i}", "more": "x"}) + "\n" for i in range(5)))
    with pytest.raises(
        DataError, match=r"rows.jsonl: no column 'positive' \(columns: more, pos, query\); fix data.pairs_columns"
    ):
        read_rows(str(file), ("query", "positive"))
    assert read_rows(str(file), ("query", "pos")).texts == [[f"q {i}", f"d {i}"] for i in range(5)]
