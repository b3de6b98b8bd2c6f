"""Step time of every step kind through `Trainer.train_step`, optionally against another checkout.

    python benchmarks/step_kinds_bench.py                          # this tree
    python benchmarks/step_kinds_bench.py --compare-tree /tmp/base # A/B: this tree vs another checkout

Each (tree, kind) is measured in its own process (`--worker`), alternating trees per repetition
so both see the same machine state; a process builds the trainer once, runs `--warmup` steps, then
times `--steps` steps (same microbatches every step) and reports the median. Reported per kind:
the median and the minimum over repetitions of those medians, and the ratio tree / compare-tree
of the medians. `--threads 1` (default) takes thread scheduling out of the noise. The kinds are the
ones `tests/test_step_baseline.py` pins (clip/debug, vae/debug), float32, one process.
Writes `step_kinds_bench.{json,csv,png}` under `--out`.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KINDS = {
    "accumulate": ["--training.local_batch_size=64", "--training.global_batch_size=256"],
    "gradcache": ["--training.local_batch_size=64", "--training.global_batch_size=256", "--gradcache.enabled=true",
                  "--gradcache.chunk_sizes=16"],
    "global": ["--training.local_batch_size=64", "--training.global_batch_size=256", "--loss.negatives=global",
               "--loss.stream_chunk_size=128"],
    "pixel": ["--model.name=vae", "--data.dataset=emoji", "--training.local_batch_size=16", "--training.global_batch_size=32"],
}


def worker(kind: str, warmup: int, steps: int, threads: int) -> None:
    """Runs in the tree on PYTHONPATH; prints one JSON line of step times."""
    import torch

    from titan_contrastive.config import parse_args
    from titan_contrastive.train import Trainer

    with tempfile.TemporaryDirectory() as dump:
        trainer = Trainer(parse_args(["--metrics.enable_tensorboard=false", "--eval.enable=false", f"--job.dump_folder={dump}",
                                      f"--training.steps={warmup + steps}", *KINDS[kind]]))
        torch.set_num_threads(threads)  # after the trainer's own choice
        local = trainer.cfg.training.local_batch_size
        batches = [trainer.train_set.__getitems__(list(range(j * local, (j + 1) * local))) for j in range(trainer.ga_steps)]
        times = []
        for i in range(warmup + steps):
            start = time.perf_counter()
            trainer.train_step(batches)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        trainer.metrics.close()
    print(json.dumps({"kind": kind, "times": times}))


def measure(tree: Path, kind: str, args: argparse.Namespace) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, __file__, "--worker", kind, "--warmup", str(args.warmup), "--steps", str(args.steps),
                          "--threads", str(args.threads)],
                         env=env, cwd=tree, capture_output=True, text=True, check=True)
    return statistics.median(json.loads(out.stdout.strip().splitlines()[-1])["times"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare-tree", type=Path, help="another checkout of titan_contrastive (e.g. the commit before a change)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per measuring process")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.warmup, args.steps, args.threads)
    trees = {"this": REPO, **({"compare": args.compare_tree.resolve()} if args.compare_tree else {})}
    medians: dict[str, dict[str, list[float]]] = {k: {t: [] for t in trees} for k in args.kinds}
    for rep in range(args.repeats):
        for kind in args.kinds:
            for name, tree in trees.items():
                medians[kind][name].append(measure(tree, kind, args))
                print(f"repeat {rep + 1}/{args.repeats} {kind:10s} {name:7s} {medians[kind][name][-1] * 1e3:8.1f} ms", flush=True)
    import torch

    rows = []
    for kind, by_tree in medians.items():
        row = {"kind": kind, **{f"{t}_ms": statistics.median(v) * 1e3 for t, v in by_tree.items()},
               **{f"{t}_min_ms": min(v) * 1e3 for t, v in by_tree.items()}}
        if "compare" in by_tree:
            row["ratio"] = row["this_ms"] / row["compare_ms"]
        rows.append(row)
    device = f"CPU, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} thread(s) per process"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_kinds_bench.json").write_text(json.dumps({"device": device, "date": time.strftime("%Y-%m-%d"),
                                                                "repeats": args.repeats, "steps": args.steps, "rows": rows,
                                                                "medians_s": medians}, indent=1) + "\n")
    with open(args.out / "step_kinds_bench.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(trees)
    for i, name in enumerate(trees):
        ax.bar([k + i * width for k in range(len(rows))], [r[f"{name}_ms"] for r in rows], width, label=name)
    ax.set_xticks([k + width * (len(trees) - 1) / 2 for k in range(len(rows))], [r["kind"] for r in rows])
    ax.set_ylabel("median step time (ms)")
    ax.set_title(f"train_step per step kind ({device})", fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "step_kinds_bench.png", dpi=120)
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
