"""benchmarks/sweep.py: a real 2-point grid through run_train.sh (plus a failing point), and its aggregation."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("sweep", REPO / "benchmarks" / "sweep.py")
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)


def test_summarize_drops_warmup_and_reports_spread() -> None:
    records = [
        {"kind": "train", "samples_per_s": s, "peak_memory_gib": m, "loss": loss, "mfu": 0.1 * s, "data_share": f}
        for s, m, loss, f in (
            (10.0, 1.0, 5.0, 0.9),
            (100.0, 2.0, 4.0, 0.01),
            (120.0, 1.5, 3.0, 0.03),
            (90.0, 1.2, 2.0, 0.02),
        )
    ]
    row = sweep.summarize([*records, {"kind": "eval", "loss": 9.0}], warmup_windows=1)
    assert row == {
        "status": "ok",
        "samples_per_s": 100.0,
        "samples_per_s_min": 90.0,
        "samples_per_s_max": 120.0,
        "peak_memory_gib": 2.0,
        "final_loss": 2.0,
        "timed_windows": 3,
        "mfu": 10.0,
        "data_share": 0.02,
    }
    assert sweep.summarize([], 1)["status"] == "error"


def test_failures_are_classified() -> None:
    assert (
        sweep.classify_failure("...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate")["status"] == "oom"
    )
    assert sweep.classify_failure("x\nerror: training.local_batch_size=0: bad\n\n") == {
        "status": "error",
        "detail": "error: training.local_batch_size=0: bad",
    }


@pytest.mark.slow  # ~20 s: keeps the default suite near 15 min; CI runs the slow marker too
def test_two_point_grid_end_to_end(tmp_path: Path) -> None:
    grid = tmp_path / "tiny.toml"
    grid.write_text("""
config = "train_configs/debug.toml"
global_batch_sizes = [32, 64]
base = ["--training.steps=4", "--metrics.log_freq=1", "--eval.enable=false", "--metrics.enable_tensorboard=false"]
warmup_windows = 1
[[strategies]]
name = "GA 32"
overrides = ["--training.local_batch_size=32"]
[[strategies]]
name = "broken"
overrides = ["--training.local_batch_size=0"]
""")
    assert sweep.main(["--grid", str(grid), "--out", str(tmp_path / "out")]) == 0
    rows = list(csv.DictReader(open(tmp_path / "out" / "sweep_tiny.csv")))
    assert [(r["strategy"], r["global_batch_size"], r["status"]) for r in rows] == [
        ("GA 32", "32", "ok"),
        ("GA 32", "64", "ok"),
        ("broken", "32", "error"),
        ("broken", "64", "error"),
    ]
    assert (
        float(rows[0]["samples_per_s"]) > 0
        and rows[0]["timed_windows"] == "3"
        and float(rows[1]["peak_memory_gib"]) > 0
    )
    assert "training.local_batch_size" in rows[2]["detail"]
    meta = json.loads((tmp_path / "out" / "sweep_tiny.json").read_text())
    assert meta["device"] == "CPU" and len(meta["rows"]) == 4
    assert (tmp_path / "out" / "sweep_tiny.png").stat().st_size > 10_000


def test_unknown_grid_is_a_one_line_error() -> None:
    with pytest.raises(SystemExit, match=r"--grid nope: no such grid; choose one of cpu_planner, cpu_small, gpu"):
        sweep.load_grid("nope")


@pytest.mark.parametrize("name", sorted(p.stem for p in sweep.GRIDS.glob("*.toml")))
def test_every_shipped_grid_point_is_a_valid_config(name: str) -> None:
    """A typo in a grid costs a GPU session its points: each point's launch arguments parse and
    validate here (the command's flags after run_train.sh, on the grid's config)."""
    from titan_contrastive.config.manager import parse_args

    grid = sweep.load_grid(name)
    for strategy in grid["strategies"]:
        for global_batch in grid["global_batch_sizes"]:
            argv = sweep.point_command(grid, strategy, global_batch, Path("/tmp/unused"))[1:]
            cfg = parse_args([f"--job.config_file={grid['config']}", *argv])
            assert cfg.training.global_batch_size == global_batch
