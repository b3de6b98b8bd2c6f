"""benchmarks/shared_tokens_bench.py on 9,000 triplets and 2 ranks: a row per variant, each a torchrun launch that
builds the text pairs as the trainer does; sharing, no rank tokenizes much more than half the distinct texts (and its
tables hold what a rank building them alone holds, checked inside the launch), alone every rank tokenizes them all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.needs import require


@pytest.mark.slow  # ~40 s: two torchrun launches of two ranks, each loading torch and MiniLM's tokenizer
def test_shared_tokens_bench_measures_both_variants(tmp_path: Path) -> None:
    require("hf")  # the default bi_encoder's tokenizer is the MiniLM package's
    from benchmarks import shared_tokens_bench

    argv = ["--rows", "9000", "--kinds", "triplets", "--worlds", "2", "--repeats", "1", "--out", str(tmp_path)]
    shared_tokens_bench.main(argv)
    result = json.loads((tmp_path / "shared_tokens_bench.json").read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["shared", "alone"]
    assert all(r["load_s"] > 0 and 26000 < r["distinct"] <= 27000 and r["world"] == 2 for r in rows.values())
    assert rows["alone"]["tokenized"] == 1.0
    assert 0.5 <= rows["shared"]["tokenized"] < 0.6  # chunks of 4,096: the most loaded rank's share
    assert (tmp_path / "shared_tokens_bench.png").read_bytes()[:4] == b"\x89PNG"
