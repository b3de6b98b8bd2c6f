"""benchmarks/worker_memory_bench.py on a few thousand rows: a row per kind, variant and size, each in a fresh
process that builds the data as the trainer does and draws one epoch through two workers it samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.needs import require


@pytest.mark.slow  # ~40 s: eight fresh processes with two data workers each (CI runs the slow marker too)
def test_worker_memory_bench_measures_every_kind_and_variant(tmp_path: Path) -> None:
    require("hf")  # the vl_pairs rows go through a tiny random Qwen2-VL folder's processor
    from benchmarks import worker_memory_bench

    worker_memory_bench.main(["--rows", "2048", "--batch", "256", "--repeats", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "worker_memory_bench.json").read_text())
    assert [(r["kind"], r["variant"], r["rows"]) for r in result["rows"]] == [
        (kind, variant, 2048) for kind in ("csv", "vl_pairs") for variant in ("this", "unfrozen", "before")
    ]
    assert all(r["batches"] == 8 and r["epoch_s"] > 0 and r["load_s"] > 0 for r in result["rows"])
    assert all(r["worker_mib"] > 0 and r["build_mib"] > 0 for r in result["rows"])
    assert result["meta"]["baseline"] == "cd47137" and result["meta"]["workers"] == 2
    assert (tmp_path / "worker_memory_bench.png").read_bytes()[:4] == b"\x89PNG"
    two = ["--kinds", "csv", "--variants", "before", "this", "--out", str(tmp_path / "two")]
    worker_memory_bench.main(["--rows", "2048", "--batch", "256", "--repeats", "1", *two])
    result = json.loads((tmp_path / "two" / "worker_memory_bench.json").read_text())
    assert [(r["kind"], r["variant"]) for r in result["rows"]] == [("csv", "before"), ("csv", "this")]
