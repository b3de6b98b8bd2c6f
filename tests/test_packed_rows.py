"""Rows packed into one bytes object and an array of ends (`datasets/packed_rows.py`): every value comes back as
it went in, a value JSON cannot hold names its row, and the sources that keep table rows (CSV image-text files,
vl_pairs rows) hold no Python object per row, which is what lets forked DataLoader workers read them without copying
them (`benchmarks/worker_memory_bench.py` measures the workers' memory)."""

from __future__ import annotations

import gc
import json
import math
import tracemalloc
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.needs import needs
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.image_folder import ImageFolderZeroShot
from titan_contrastive.datasets.packed_rows import PackedRows, Unpackable, packable
from titan_contrastive.datasets.sources import CsvSource
from titan_contrastive.datasets.vl_pairs import VLPairsDataset

ROWS: list[Any] = [
    {"query_text": "naïve café 東京 🙂", "doc_image": None, "doc_negatives": ["a", "", "b\tc"]},
    ["a\ud800b", "", None, True, False, 0, -3, 2**70, 1.5, -0.0, math.inf, -math.inf],
    [[1, [2, [3, []]]], {"k": {"nested": [None]}}],
    "one string",
    None,
    7,
]


def test_rows_come_back_as_they_went_in() -> None:
    rows = PackedRows(ROWS)
    assert len(rows) == len(ROWS)
    assert list(rows) == ROWS
    assert [rows[j - len(ROWS)] for j in range(len(ROWS))] == ROWS
    assert rows[1][1] == "" and rows[1][4] is False and isinstance(rows[1][8], float)
    assert math.copysign(1, rows[1][9]) == -1
    nan = PackedRows([[float("nan")], (1, (2, 3))])
    assert math.isnan(nan[0][0]) and nan[1] == [1, [2, 3]]  # a tuple comes back as a list
    assert rows[0] is not rows[0]  # a fresh object each time: no row is kept as an object
    for bad in (len(ROWS), -len(ROWS) - 1):
        with pytest.raises(IndexError, match=f"row {bad} of {len(ROWS)}"):
            rows[bad]
    assert rows[np.int64(2)] == ROWS[2] and rows[torch.tensor(-1)] == ROWS[-1]  # a sampler's integers
    for bad in (slice(0, 2), 1.0, torch.tensor(1.0)):
        with pytest.raises(TypeError, match="one row at a time"):
            rows[bad]  # type: ignore[index]
    empty = PackedRows(iter(()))
    assert len(empty) == 0 and list(empty) == [] and empty.nbytes == 0
    assert rows.nbytes == sum(
        len(json.dumps(r, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")) for r in ROWS
    ) + 8 * len(ROWS)


def test_a_value_json_cannot_hold_names_its_row() -> None:
    for bad in (b"bytes", {(1, 2): "a tuple key"}, [1, {2}], object()):
        assert not packable(bad)
        with pytest.raises(Unpackable, match="^row 2: ") as e:
            PackedRows(["fine", ["also"], bad])
        assert e.value.row == 2 and e.value.value is bad
    assert all(packable(v) for v in ROWS)
    assert PackedRows([{1: "an int key", None: 0}])[0] == {"1": "an int key", "null": 0} and packable({1: None})


def _objects(root: object) -> int:
    """How many objects `root` holds, itself included (classes, modules and functions left out)."""
    seen: set[int] = set()
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)):
            continue
        seen.add(id(obj))
        todo.extend(gc.get_referents(obj))
    return len(seen)


def _csv(folder: Path, rows: int) -> Path:
    folder.mkdir()
    lines = ["filepath\ttitle\tneg"] + [f"img/{i}.png\ta caption {i}\tanother caption {i}" for i in range(rows)]
    (folder / "rows.tsv").write_text("\n".join(lines) + "\n")
    return folder / "rows.tsv"


def _jsonl(folder: Path, rows: int) -> Path:
    folder.mkdir()
    lines = [
        json.dumps({"query_text": f"q {i}", "doc_text": f"d {i}", "doc_negatives": [f"n {i}"]}) for i in range(rows)
    ]
    (folder / "rows.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "rows.jsonl"


def test_sources_of_table_rows_hold_no_object_per_row(tmp_path: Path) -> None:
    """10 rows or 1,000 (images of a zero-shot folder too): the same objects (a list of rows would hold a thousand
    more); each row still reads back."""
    csv = [CsvSource(str(_csv(tmp_path / f"csv{n}", n)), negative_keys=["neg"]) for n in (10, 1000)]
    assert _objects(csv[0]) == _objects(csv[1])
    (tmp_path / "csv10" / "img").mkdir()
    (tmp_path / "csv10" / "img" / "9.png").write_bytes(b"the image's bytes")
    record = csv[0].read(9)
    assert (record.image, record.caption, record.negatives) == (
        b"the image's bytes",
        "a caption 9",
        ("another caption 9",),
    )
    assert record.key == "row 11" and record.where == str(tmp_path / "csv10" / "img" / "9.png")
    pairs = [VLPairsDataset(split="train", path=str(_jsonl(tmp_path / f"vl{n}", n)), mode="t2t") for n in (10, 1000)]
    assert _objects(pairs[0]) == _objects(pairs[1])
    assert len(pairs[1]) == 1000 and pairs[1].num_negatives == 1
    assert pairs[1]._fields(0, 999) == {"query_text": "q 999", "doc_text": "d 999", "doc_negatives": ["n 999"]}
    folders = []
    for n in (10, 1000):  # a zero-shot folder of two classes: its image paths
        for i in range(n):
            image = tmp_path / f"zs{n}" / f"class_{i % 2}" / f"{i}.png"
            image.parent.mkdir(parents=True, exist_ok=True)
            image.touch()
        folders.append(
            ImageFolderZeroShot(str(tmp_path / f"zs{n}"), names_file="", templates=["{}"], tokenizer=None, image_size=8)
        )
    assert _objects(folders[0]) == _objects(folders[1]) and len(folders[1]) == 1000
    assert folders[1]._files[999] == str(tmp_path / "zs1000" / "class_1" / "999.png")


def test_sources_pack_each_row_as_they_read_it(tmp_path: Path) -> None:
    """Loading 10,000 rows allocates little more than the packed rows themselves at its peak: neither the file's text
    nor its rows as objects are ever held whole (Python's allocations, traced)."""
    csv, jsonl = str(_csv(tmp_path / "csv", 10_000)), str(_jsonl(tmp_path / "vl", 10_000))
    made = (
        lambda: CsvSource(csv, negative_keys=["neg"]),
        lambda: VLPairsDataset(split="train", path=jsonl, mode="t2t"),
    )
    for make in made:
        tracemalloc.start()
        try:
            source = make()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        rows = source._rows if isinstance(source, CsvSource) else source._files[0].rows
        assert len(rows) == 10_000 and rows[-1][1] in ("a caption 9999", "d 9999")
        assert peak < 2 * rows.nbytes + 2**19, (type(source).__name__, peak, rows.nbytes)


@needs("data")
def test_vl_pairs_refuses_a_value_it_cannot_keep_in_one_line(tmp_path: Path) -> None:
    """A text stored as bytes in a Parquet column (images may be, `held_images`): the row and the column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = pa.array([None, b"a"], type=pa.binary())
    pq.write_table(pa.table({"query_text": texts, "doc_image": ["x.png", "y.png"]}), tmp_path / "rows.parquet")
    with pytest.raises(
        DataError, match=r"rows.parquet: row 2: query_text holds a bytes; .* lists of them and numbers$"
    ):
        VLPairsDataset(split="train", path=str(tmp_path / "rows.parquet"), mode="t2i")
