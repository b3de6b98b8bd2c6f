"""Step time of every step kind through `Trainer.train_step`, optionally against another checkout.

    python -m benchmarks.step_kinds_bench                          # this tree
    python -m benchmarks.step_kinds_bench --compare-tree /tmp/base # A/B: this tree vs another checkout
    python -m benchmarks.step_kinds_bench --kinds accumulate --repeats 1 --warmup 1 --steps 1 --out /tmp/bench

Each (tree, kind) is measured in its own process (`--worker`, this file run as a script with the
tree's titan_contrastive first on PYTHONPATH, so it imports nothing from benchmarks/), the
(kind, tree) pairs interleaved round-robin by the harness so both trees see the same machine state;
a process builds the trainer once, runs `--warmup` steps, then times `--steps` steps (same
microbatches every step) and reports the median. Reported per kind: the median and the minimum
over repetitions of those medians, the ratio tree / compare-tree of the medians, and the peak RSS
of each tree's worker process (harness.run_child). `--threads 1` (default) takes thread scheduling
out of the noise. The kinds are the ones `tests/test_step_baseline.py` pins (clip/debug, vae/debug),
float32, one process.
Writes `step_kinds_bench.{json,csv,png}` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KINDS = {
    "accumulate": ["--training.local_batch_size=64", "--training.global_batch_size=256"],
    "gradcache": [
        "--training.local_batch_size=64",
        "--training.global_batch_size=256",
        "--gradcache.enabled=true",
        "--gradcache.chunk_sizes=16",
    ],
    "global": [
        "--training.local_batch_size=64",
        "--training.global_batch_size=256",
        "--loss.negatives=global",
        "--loss.stream_chunk_size=128",
    ],
    "pixel": [
        "--model.name=vae",
        "--data.dataset=emoji",
        "--training.local_batch_size=16",
        "--training.global_batch_size=32",
    ],
}


def worker(kind: str, warmup: int, steps: int, threads: int) -> None:
    """Runs in the tree on PYTHONPATH; prints one JSON line of step times."""
    import torch

    from titan_contrastive.config import parse_args
    from titan_contrastive.train import Trainer

    with tempfile.TemporaryDirectory() as dump:
        trainer = Trainer(
            parse_args(
                [
                    "--metrics.enable_tensorboard=false",
                    "--eval.enable=false",
                    f"--job.dump_folder={dump}",
                    f"--training.steps={warmup + steps}",
                    *KINDS[kind],
                ]
            )
        )
        torch.set_num_threads(threads)  # after the trainer's own choice
        local = trainer.cfg.training.local_batch_size
        batches = [
            trainer.train_set.__getitems__(list(range(j * local, (j + 1) * local))) for j in range(trainer.ga_steps)
        ]
        times = []
        for i in range(warmup + steps):
            start = time.perf_counter()
            trainer.train_step(batches)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        trainer.metrics.close()
    print(json.dumps({"kind": kind, "times": times}))


def measure(tree: Path, kind: str, args: argparse.Namespace) -> tuple[float, float | None]:
    """The median step time of one worker process on `tree`, and that process's peak RSS (MiB)."""
    from benchmarks import harness

    env = {**os.environ, "PYTHONPATH": str(tree), "CUDA_VISIBLE_DEVICES": ""}
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        kind,
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--threads",
        str(args.threads),
    ]
    out = harness.run_child(cmd, env=env, cwd=tree, check=True)
    return statistics.median(json.loads(out.stdout.strip().splitlines()[-1])["times"]), out.peak_rss_mib


def plot(rows: list[dict], trees: list[str], device: str):  # noqa: ANN201 - a matplotlib figure
    from benchmarks import harness

    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(trees)
    for i, name in enumerate(trees):
        ax.bar([k + i * width for k in range(len(rows))], [r[f"{name}_ms"] for r in rows], width, label=name)
    ax.set_xticks([k + width * (len(trees) - 1) / 2 for k in range(len(rows))], [r["kind"] for r in rows])
    ax.set_ylabel("median step time (ms)")
    ax.set_title(f"train_step per step kind ({device})", fontsize=8)
    ax.legend()
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--compare-tree", type=Path, help="another checkout of titan_contrastive (e.g. the commit before a change)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per measuring process")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.warmup, args.steps, args.threads)
    from benchmarks import harness  # the driver only: a worker runs with another tree on its path

    trees = {"this": REPO, **({"compare": args.compare_tree.resolve()} if args.compare_tree else {})}
    pairs = {f"{kind}/{name}": (kind, name) for kind in args.kinds for name in trees}
    runs = harness.round_robin(
        {key: (lambda kind=kind, name=name: measure(trees[name], kind, args)) for key, (kind, name) in pairs.items()},
        args.repeats,
        warmup=0,
        rss=False,
        keep_values=True,
        log=print,
    )
    medians = {k: {t: [v[0] for v in runs[f"{k}/{t}"].values] for t in trees} for k in args.kinds}
    rows = []
    for kind, by_tree in medians.items():
        row = {
            "kind": kind,
            **{f"{t}_ms": statistics.median(v) * 1e3 for t, v in by_tree.items()},
            **{f"{t}_min_ms": min(v) * 1e3 for t, v in by_tree.items()},
            **{f"{t}_peak_rss_mib": max((v[1] or 0.0) for v in runs[f"{kind}/{t}"].values) for t in trees},
        }
        if "compare" in by_tree:
            row["ratio"] = row["this_ms"] / row["compare_ms"]
        rows.append(row)
    meta = harness.metadata(
        "cpu",
        compare_tree=str(trees.get("compare", "")) or None,
        compare_commit=harness.git_commit(trees["compare"]) if "compare" in trees else None,
    )
    device = f"CPU, {os.cpu_count()} cores, torch {meta['torch']}, {args.threads} thread(s) per process"
    payload = {
        "device": device,
        "repeats": args.repeats,
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": args.threads,
        "medians_s": medians,
    }
    harness.write_results(
        args.out, "step_kinds_bench", meta, payload, rows=rows, figure=lambda: plot(rows, list(trees), device)
    )
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
