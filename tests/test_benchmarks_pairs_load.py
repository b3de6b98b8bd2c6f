"""benchmarks/pairs_load_bench.py on a couple of thousand rows: a row per kind and variant, each in a fresh process
that builds the text pairs as the trainer does; the token table holds less than the padded ids, and far less where
passages repeat."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.needs import require


@pytest.mark.slow  # ~40 s: four fresh processes, each loading torch and MiniLM's tokenizer (CI runs the slow marker)
def test_pairs_load_bench_measures_both_kinds_and_variants(tmp_path: Path) -> None:
    require("hf")  # the default bi_encoder's tokenizer is the MiniLM package's
    from benchmarks import pairs_load_bench

    pairs_load_bench.main(["--rows", "2048", "--repeats", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "pairs_load_bench.json").read_text())
    rows = {(r["kind"], r["variant"]): r for r in result["rows"]}
    assert list(rows) == [(kind, variant) for kind in ("flag", "triplets") for variant in ("this", "before")]
    assert all(r["load_s"] > 0 and r["batch_ms"] > 0 and r["file_mib"] > 0 for r in result["rows"])
    assert rows[("flag", "this")]["tokens_mib"] * 20 < rows[("flag", "before")]["tokens_mib"]
    assert rows[("triplets", "this")]["tokens_mib"] * 2 < rows[("triplets", "before")]["tokens_mib"]
    assert result["meta"]["baseline"] == "4c6e351"
    assert (tmp_path / "pairs_load_bench.png").read_bytes()[:4] == b"\x89PNG"
