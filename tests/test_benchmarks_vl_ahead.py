"""benchmarks/vl_teacher_ahead_bench.py on a few rows: a row per variant, the file of the embedded items, and the
first step taught from the file giving the running teacher's loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.needs import require


@pytest.mark.slow  # a benchmark's run end to end, ~3 s: the default suite's time (CI runs the slow marker too)
def test_vl_teacher_ahead_bench_times_each_variant(tmp_path: Path) -> None:
    require("hf", "data")
    from benchmarks import vl_teacher_ahead_bench

    vl_teacher_ahead_bench.main(
        ["--rows", "12", "--batch", "4", "--steps", "1", "--teacher-size", "small", "--out", str(tmp_path)]
    )
    result = json.loads((tmp_path / "vl_teacher_ahead_bench.json").read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["alone", "running", "ahead"]
    assert all(r["step_s"] > 0 and r["batch_s"] > 0 for r in rows.values())
    assert rows["running"]["teacher_items_per_epoch"] == 12 * 4 and result["file_items"] == 24  # the negatives: rows'
    assert result["first_loss_rel_diff"] < 1e-5 and result["first_loss"]["alone"] != result["first_loss"]["ahead"]
    assert (tmp_path / "vl_teacher_ahead_bench.png").read_bytes()[:4] == b"\x89PNG"
