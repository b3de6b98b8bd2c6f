"""benchmarks/qwen_vl_chunks.py on CPU: its quick run (GradCache chunks and token budgets of a tiny random Qwen2-VL
through the trainer's own step) and its --gpu mode on a tiny model (what `gpu_session.sh 8` runs at 2B on an H100)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.needs import require


@pytest.mark.slow  # a benchmark's run end to end, ~2 s: the default suite's time (CI runs the slow marker too)
def test_qwen_vl_chunks_quick_measures_every_chunk_and_the_budget_bounds_its_tokens(tmp_path: Path) -> None:
    """benchmarks/qwen_vl_chunks.py --quick: a tiny random Qwen2-VL through the trainer's own step, fixed GradCache
    chunks, token budgets and the plain step on one batch of mixed image sizes; per chunk its tokens and the bytes
    it saves for backward; a budget's chunks stay within it, and every variant trains to the same loss."""
    require("hf")
    from benchmarks import qwen_vl_chunks

    qwen_vl_chunks.main(["--quick", "--out", str(tmp_path)])  # in this process
    saved = json.loads((tmp_path / "qwen_vl_chunks.json").read_text())
    rows = {r["variant"]: r for r in saved["rows"]}
    assert list(rows) == ["chunks of 2", "chunks of 3", "<= 40 tokens", "<= 80 tokens", "plain"]
    batch = saved["config"]["batch"]
    assert len({tuple(g) for g in saved["batch"]["patch_grids"]}) == 3  # 28, 56 and 112 px in one batch
    for name, row in rows.items():
        assert row["status"] == "ok" and row["median_s"] > 0 and row["chunks"] >= 1, name
        assert row["tokens_min"] > 0 and row["visual_tokens_min"] > 0 and row["saved_mib_min"] > 0, name
        assert row["saved_mib_min"] <= row["saved_mib_median"] <= row["saved_mib_max"], name
        assert sum(row["samples_per_chunk"]) == batch and row["chunks_repeatable"], name
        assert len(row["per_chunk"]) == row["chunks"] and row["rss_growth_mib"] is not None, name
    for size in (2, 3):
        assert rows[f"chunks of {size}"]["samples_per_chunk"] == [size] * (batch // size)
    for budget in (40, 80):
        row = rows[f"<= {budget} tokens"]
        assert row["chunk_tokens"] == budget and row["tokens_max"] <= budget
        assert all(c["tokens"] <= budget for c in row["per_chunk"])
    assert rows["plain"]["chunks"] == 1 and rows["plain"]["saved_mib_max"] > rows["<= 40 tokens"]["saved_mib_max"]
    assert max(saved["loss_spread"]) < 1e-4  # GradCache is exact: every variant trains the same model alike
    assert (tmp_path / "qwen_vl_chunks.png").read_bytes()[:4] == b"\x89PNG"
    assert len(list(csv.DictReader(open(tmp_path / "qwen_vl_chunks.csv")))) == 5


@pytest.mark.slow  # a benchmark's run end to end, ~4 s: the default suite's time (CI runs the slow marker too)
def test_qwen_vl_chunks_gpu_mode_runs_on_cpu_with_a_tiny_model(tmp_path: Path) -> None:
    """benchmarks/qwen_vl_chunks.py --gpu (what gpu_session.sh 8 runs at 2B on an H100) on CPU: a tiny random
    Qwen2-VL with LoRA, plain and GradCache with a token budget, the batch doubled from 4 to --max-batch 8."""
    require("hf")
    from benchmarks import qwen_vl_chunks

    cmd = ["--gpu", "--size", "tiny", "--device", "cpu", "--image-sizes", "28", "56", "--chunk-tokens", "40"]
    qwen_vl_chunks.main([*cmd, "--start-batch", "4", "--max-batch", "8", "--repeats", "1", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "qwen_vl_chunks_gpu.json").read_text())
    for mode in ("plain", "gradcache"):
        rows = [r for r in saved["rows"] if r["mode"] == mode]
        assert [(r["batch"], r["status"]) for r in rows] == [(4, "ok"), (8, "ok")], rows
        assert all(r["samples_per_s"] > 0 and r["peak_rss_mib"] > 0 for r in rows)
    for row in (r for r in saved["rows"] if r["mode"] == "gradcache"):
        assert row["chunks"] >= 1 and 0 < row["tokens_max"] <= 40 and row["saved_mib_max"] > 0
    summary = saved["summary"]
    assert summary["largest_batch"] == {"plain": 8, "gradcache": 8}
    assert summary["stop"] == {"plain": "max batch 8", "gradcache": "max batch 8"}
    assert saved["layout"] == "single" and saved["lora_targets"] == ["q_proj", "v_proj"]
    assert 0 < saved["trainable_params"] < saved["params"]
    assert (tmp_path / "qwen_vl_chunks_gpu.png").read_bytes()[:4] == b"\x89PNG"
