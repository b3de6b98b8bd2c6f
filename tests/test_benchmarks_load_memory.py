"""benchmarks/load_memory_bench.py on a few thousand rows: a row per kind, variant and size, each in a fresh process
that builds the data as the trainer does and reports its peak memory while reading the rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.needs import require


@pytest.mark.slow  # ~40 s: six fresh processes, each loading torch and a processor (CI runs the slow marker too)
def test_load_memory_bench_measures_every_kind_and_variant(tmp_path: Path) -> None:
    require("hf", "data")  # vl_pairs rows go through a tiny random Qwen2-VL folder's processor; Parquet needs pyarrow
    from benchmarks import load_memory_bench

    load_memory_bench.main(["--rows", "3000", "--repeats", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "load_memory_bench.json").read_text())
    assert [(r["kind"], r["variant"], r["rows"]) for r in result["rows"]] == [
        (kind, variant, 3000) for kind in ("csv", "vl_pairs", "parquet") for variant in ("this", "before")
    ]
    assert all(r["peak_mib"] > 0 and r["load_s"] > 0 and r["file_mib"] > 0 for r in result["rows"])
    assert result["meta"]["baseline"] == "c71de30"
    assert (tmp_path / "load_memory_bench.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow  # ~15 s: two fresh processes
def test_load_memory_bench_measures_a_json_array(tmp_path: Path) -> None:
    """`--kinds json` against the commit before a JSON array was read a row at a time."""
    require("hf", "data")
    from benchmarks import load_memory_bench

    args = ["--rows", "3000", "--repeats", "1", "--out", str(tmp_path), "--kinds", "json", "--baseline", "5549dd4"]
    load_memory_bench.main(args)
    result = json.loads((tmp_path / "load_memory_bench.json").read_text())
    assert [(r["kind"], r["variant"]) for r in result["rows"]] == [("json", "this"), ("json", "before")]
    assert all(r["peak_mib"] > 0 and r["file_mib"] > 0 for r in result["rows"])
