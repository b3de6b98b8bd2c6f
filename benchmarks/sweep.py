"""Throughput and memory sweeps through the real trainer: one command over a grid of config overrides.

    python -m benchmarks.sweep --grid cpu_small      # a few minutes on 2 CPU cores
    python -m benchmarks.sweep --grid gpu            # one H100
    python -m benchmarks.sweep --grid path/to/my_grid.toml --out /tmp/sweep

A grid (benchmarks/grids/*.toml) names a config, a process count, global batch sizes, base
overrides and strategies (named override lists; `{global}` is replaced by the point's global
batch). Every (strategy, global batch) point is a `run_train.sh` launch, as users launch it, whose
`metrics.jsonl` log windows give samples/s (median, min, max), MFU, the loader's share of the time
and peak memory; the first `warmup_windows` are not timed; harness.run_child adds the peak RSS of
the launch's largest process.
A point that runs out of memory is recorded as "oom", another failure as "error" with its last line,
and the sweep goes on. Writes sweep_{grid}.csv, .json and .png (samples/s and peak memory vs global
batch, one line per strategy) under --out, with the harness's metadata.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]

from benchmarks import harness

REPO = harness.REPO
GRIDS = Path(__file__).parent / "grids"
FIELDS = [
    "strategy",
    "global_batch_size",
    "status",
    "samples_per_s",
    "samples_per_s_min",
    "samples_per_s_max",
    "mfu",
    "data_share",
    "peak_memory_gib",
    "peak_reserved_gib",
    "final_loss",
    "timed_windows",
    "wall_s",
    "peak_rss_mib",
    "budget_gib",
    "planned_chunk",
    "planned_gib",
    "first_step_peak_gib",
    "detail",
]
OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "MemoryError")


def load_grid(name_or_path: str) -> dict[str, Any]:
    """A grid by name (benchmarks/grids/NAME.toml) or path; missing keys are a one-line error."""
    path = Path(name_or_path) if name_or_path.endswith(".toml") else GRIDS / f"{name_or_path}.toml"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in GRIDS.glob("*.toml")))
        raise SystemExit(f"--grid {name_or_path}: no such grid; choose one of {names} or give a .toml path")
    grid = tomllib.loads(path.read_text())
    for key in ("config", "global_batch_sizes", "strategies"):
        if key not in grid:
            raise SystemExit(f"{path}: missing key {key!r} (see benchmarks/grids/cpu_small.toml)")
    return {"name": path.stem, "nproc": 1, "base": [], "warmup_windows": 1, **grid}


def point_command(grid: dict[str, Any], strategy: dict[str, Any], global_batch: int, dump: Path) -> list[str]:
    overrides = [o.replace("{global}", str(global_batch)) for o in strategy.get("overrides", [])]
    base = [o.replace("{global}", str(global_batch)) for o in grid["base"]]
    return [
        "./run_train.sh",
        f"--job.dump_folder={dump}",
        f"--training.global_batch_size={global_batch}",
        *base,
        *overrides,
    ]


def summarize(records: list[dict[str, Any]], warmup_windows: int) -> dict[str, Any]:
    """Median and spread of samples/s over the timed log windows, MFU median, peak memory, last loss."""
    windows = [r for r in records if r.get("kind") == "train"]
    if not windows:
        return {"status": "error", "detail": "no train records in metrics.jsonl"}
    timed = windows[warmup_windows:] or windows[-1:]
    rates = harness.summary([w["samples_per_s"] for w in timed])
    row: dict[str, Any] = {
        "status": "ok",
        "samples_per_s": rates["median"],
        "samples_per_s_min": rates["min"],
        "samples_per_s_max": rates["max"],
        "peak_memory_gib": max(w["peak_memory_gib"] for w in windows),
        "final_loss": windows[-1]["loss"],
        "timed_windows": len(timed),
    }
    if all("data_share" in w for w in timed):  # the share of the window spent waiting for the loader
        row["data_share"] = harness.summary([w["data_share"] for w in timed])["median"]
    if all("mfu" in w for w in timed):
        row["mfu"] = harness.summary([w["mfu"] for w in timed])["median"]
    if any("peak_reserved_gib" in w for w in windows):
        row["peak_reserved_gib"] = max(w.get("peak_reserved_gib", 0.0) for w in windows)
    plan = next((r for r in records if r.get("kind") == "memory"), None)
    if plan is not None:  # [memory] budget_gib: the planner's choice and the first step measured against it
        row.update(
            budget_gib=plan["budget_gib"],
            planned_chunk=plan["chunk"],
            planned_gib=plan["planned_gib"],
            first_step_peak_gib=plan["peak_gib"],
        )
    return row


def classify_failure(output: str) -> dict[str, Any]:
    """ "oom" when the run died of memory, else "error" with the trainer's one-line `error:` message
    (or the last meaningful line: torchrun appends a banner of '=' after a failed rank)."""
    if any(marker in output for marker in OOM_MARKERS):
        return {"status": "oom", "detail": "out of memory"}
    lines = [line.strip() for line in output.splitlines() if line.strip().strip("=-")]
    ours = [line for line in lines if "error: " in line]
    return {"status": "error", "detail": (ours or lines or ["no output"])[-1][-300:]}


def run_point(
    grid: dict[str, Any], strategy: dict[str, Any], global_batch: int, workdir: Path, timeout: float
) -> dict[str, Any]:
    dump = workdir / f"{strategy['name']}_{global_batch}".replace(" ", "_").replace(",", "").replace("/", "_")
    env = harness.train_env(grid["nproc"], grid["config"])
    row: dict[str, Any] = {"strategy": strategy["name"], "global_batch_size": global_batch}
    try:
        out = harness.run_child(point_command(grid, strategy, global_batch, dump), cwd=REPO, env=env, timeout=timeout)
        output, code = out.stdout + out.stderr, out.returncode
        row.update(wall_s=out.wall_s, peak_rss_mib=out.peak_rss_mib)
    except subprocess.TimeoutExpired:
        output, code = f"timed out after {timeout:.0f} s", -1
        row.update(wall_s=timeout)
    metrics = dump / "metrics.jsonl"
    if code == 0 and metrics.is_file():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        row.update(summarize(records, grid["warmup_windows"]))
    else:
        row.update(classify_failure(output))
    return row


def write_results(
    grid: dict[str, Any], rows: list[dict[str, Any]], out: Path, device: str, meta: dict[str, Any] | None = None
) -> None:
    meta = meta or harness.metadata()
    payload = {
        "grid": grid["name"],
        "config": grid["config"],
        "nproc": grid["nproc"],
        "base": grid["base"],
        "device": device,
        "strategies": grid["strategies"],
    }
    title = f"{grid['name']}: {grid['config']} x{grid['nproc']} on {device}"
    harness.write_results(
        out, f"sweep_{grid['name']}", meta, payload, rows=rows, fields=FIELDS, dpi=110, figure=lambda: plot(rows, title)
    )


def plot(rows: list[dict[str, Any]], title: str):  # noqa: ANN201 - a matplotlib figure
    plt = harness.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name in dict.fromkeys(r["strategy"] for r in rows):
        ok = [r for r in rows if r["strategy"] == name and r["status"] == "ok"]
        xs = [r["global_batch_size"] for r in ok]
        (line,) = ax1.plot(xs, [r["samples_per_s"] for r in ok], marker="o", label=name)
        ax1.fill_between(
            xs,
            [r["samples_per_s_min"] for r in ok],
            [r["samples_per_s_max"] for r in ok],
            alpha=0.15,
            color=line.get_color(),
        )
        ax2.plot(xs, [r["peak_memory_gib"] for r in ok], marker="o", color=line.get_color(), label=name)
        for r in rows:
            if r["strategy"] == name and r["status"] != "ok":
                ax2.annotate(r["status"], (r["global_batch_size"], 0), color=line.get_color(), rotation=90)
    for ax, label in ((ax1, "samples/s (median; band: min-max)"), (ax2, "peak memory (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("global batch")
        ax.set_ylabel(label)
    ax1.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", default="cpu_small", help="a name in benchmarks/grids/ or a .toml path")
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per point before it counts as an error")
    args = parser.parse_args(argv)
    grid = load_grid(args.grid)
    from tqdm import tqdm

    device, meta = harness.device_name(), harness.metadata(grid=grid["name"])
    points = [(s, g) for s in grid["strategies"] for g in grid["global_batch_sizes"]]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy, global_batch in (bar := tqdm(points, desc=f"sweep {grid['name']}", unit="point")):
            bar.set_postfix_str(f"{strategy['name']} @ {global_batch}")
            rows.append(run_point(grid, strategy, global_batch, Path(tmp), args.timeout))
            bar.write(json.dumps(rows[-1]))
            write_results(grid, rows, args.out, device, meta)  # after every point: a killed sweep keeps its rows
    print(f"wrote {args.out}/sweep_{grid['name']}.csv, .json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
