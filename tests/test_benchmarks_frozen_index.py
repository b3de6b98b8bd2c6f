"""benchmarks/frozen_index_bench.py on a few thousand rows: a row per variant and size (the writes', checked to hold
the same rows; the reads', each lookup checked at its row), each in a fresh process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.needs import require


@pytest.mark.slow  # ~12 s: five fresh processes and a baseline extracted (CI runs the slow marker too)
def test_frozen_index_bench_measures_the_writes_and_the_reads(tmp_path: Path) -> None:
    require("data")
    from benchmarks import frozen_index_bench

    frozen_index_bench.main(
        ["--rows", "3000", "--dim", "8", "--lookups", "500", "--repeats", "1", "--out", str(tmp_path)]
    )
    result = json.loads((tmp_path / "frozen_index_bench.json").read_text())
    assert [(r["variant"], r["rows"]) for r in result["rows"]] == [
        (variant, 3000) for variant in ("write", "write_before", "indexed", "whole", "before")
    ]
    assert all(r["seconds"] > 0 and r["index_mib"] > 0 for r in result["rows"])
    assert all((r["lookup_s"] is None) == r["variant"].startswith("write") for r in result["rows"])
    assert result["meta"]["baseline"] == "8a390a2"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("index-")]  # its runs' folder is gone
    assert (tmp_path / "frozen_index_bench.png").read_bytes()[:4] == b"\x89PNG"
