"""benchmarks/embed_spool_bench.py on a few thousand rows: a row per variant and size, from files of the same rows (the
benchmark stops where they differ), the spool's, the spool of keys as strs and the gather before it, each on 2 gloo
ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.needs import require


@pytest.mark.slow  # ~10 s: six gloo ranks in fresh processes, two baselines extracted (CI runs the slow marker too)
def test_embed_spool_bench_measures_the_three_hand_offs(tmp_path: Path) -> None:
    require("data")
    from benchmarks import embed_spool_bench

    embed_spool_bench.main(["--rows", "3000", "--chunk", "700", "--dim", "8", "--repeats", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "embed_spool_bench.json").read_text())
    assert [(r["variant"], r["rows"]) for r in result["rows"]] == [
        ("spool", 3000),
        ("spool_strs", 3000),
        ("gather", 3000),
    ]
    assert all(r["seconds"] > 0 and r["rank0_hwm_mib"] > 0 for r in result["rows"])
    assert (result["meta"]["baseline"], result["meta"]["spool_strs"]) == ("4d35b99", "1ba5c20")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("spool-")]  # its runs' folder is gone
    assert (tmp_path / "embed_spool_bench.png").read_bytes()[:4] == b"\x89PNG"
