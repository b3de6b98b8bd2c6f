"""benchmarks/corpus_load_bench.py on a thousand rows: a row per variant and corpus size, each in a fresh process that
builds the text pairs as the trainer does (each baseline's, JSON lines and Parquet, with the package of its commit);
rows of ids and their corpus, JSON lines or Parquet, tokenize exactly the texts the rows of texts hold, whatever
passages the corpus holds besides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.needs import require


@pytest.mark.slow  # ~40 s: five fresh processes, each loading torch and MiniLM's tokenizer (CI runs the slow marker)
def test_corpus_load_bench_measures_each_variant_and_corpus_size(tmp_path: Path) -> None:
    require("hf")  # the default bi_encoder's tokenizer is the MiniLM package's
    require("data")  # the Parquet corpus (pyarrow)
    from benchmarks import corpus_load_bench

    corpus_load_bench.main(["--rows", "1024", "--factors", "4", "--repeats", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "corpus_load_bench.json").read_text())
    rows = {(r["variant"], r["factor"]): r for r in result["rows"]}
    assert list(rows) == [("texts", 0), ("ids", 4), ("ids_before", 4), ("parquet", 4), ("parquet_before", 4)]
    assert all(r["load_s"] > 0 and r["peak_mib"] > 0 and r["rows_mib"] > 0 for r in result["rows"])
    assert len({r["tokens_mib"] for r in result["rows"]}) == 1  # the same texts tokenized
    assert (
        rows[("parquet", 4)]["corpus_mib"] == rows[("parquet_before", 4)]["corpus_mib"] < rows[("ids", 4)]["corpus_mib"]
    )
    assert rows[("ids", 4)]["corpus_mib"] == rows[("ids_before", 4)]["corpus_mib"]
    assert result["meta"]["baseline"] == "f5d75db" and result["meta"]["ids_baseline"] == "748b4d7"
    assert (tmp_path / "corpus_load_bench.png").read_bytes()[:4] == b"\x89PNG"
