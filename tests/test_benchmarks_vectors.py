"""benchmarks/table_vectors_bench.py on a small table: a row per file, each rank's memory and times measured; the
mapped files add less private memory to a rank than the one read into it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.needs import require


@pytest.mark.slow  # 10-12 s of the default suite's time
def test_table_vectors_bench_measures_each_file(tmp_path: Path) -> None:
    require("data", "hf")
    from benchmarks import table_vectors_bench

    table_vectors_bench.main(
        ["--rows", "40000", "--dim", "64", "--ranks", "2", "--lookups", "5", "--out", str(tmp_path)]
    )
    rows = json.loads((tmp_path / "table_vectors_bench.json").read_text())["rows"]
    assert [r["file"] for r in rows] == [
        ".parquet",
        ".arrow (embed: one record batch)",
        ".arrow (Feather, 64K-row batches)",
    ]
    assert all(r["ranks"] == 2 and r["read_s"] > 0 and r["us_per_row"] > 0 for r in rows)
    assert all(r["private_mib"] < rows[0]["private_mib"] - 5 for r in rows[1:])  # the vectors are 9.8 MiB
    assert (tmp_path / "table_vectors_bench.png").read_bytes()[:4] == b"\x89PNG"
