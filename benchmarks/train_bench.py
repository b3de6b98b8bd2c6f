"""Training throughput of {plain, +AC, +compile, +both} through run_train.sh, side by side.

    python -m benchmarks.train_bench --flavor vit_b32 --image-size 224 --nproc 1 --local-batch 256 --precision bfloat16
    python -m benchmarks.train_bench --flavor debug --image-size 0 --steps 20 --log-freq 5 --local-batch 64 \
        --precision float32 --compile-backend aot_eager --out /tmp/bench   # CPU smoke (minutes)

Each variant is a real `run_train.sh` launch (FSDP2 layout, the given precision, eval off) whose
`metrics.jsonl` gives samples/s, MFU and peak memory per log window; the first `--warmup`
windows (compilation, allocator warm-up) are dropped and the median (min, max) of the rest is
reported, with the peak RSS of the launch's largest process (harness.run_child). Variants run one
after another in the same invocation so their ratios are comparable (`--repeats` > 1: round-robin,
the median over repeats of each launch's median). Writes `train_bench.{json,csv,png}` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import harness

REPO = harness.REPO
VARIANTS = {
    "plain": [],
    "+AC": ["--activation_checkpoint.mode=selective"],
    "+compile": ["--compile.enable=true"],
    "+both": ["--activation_checkpoint.mode=selective", "--compile.enable=true"],
}


def run_variant(name: str, extra: list[str], args: argparse.Namespace, dump: Path) -> dict[str, Any]:
    env = harness.train_env(args.nproc)
    cmd = [
        "./run_train.sh",
        f"--job.dump_folder={dump}",
        f"--model.flavor={args.flavor}",
        f"--data.image_size={args.image_size}",
        f"--training.steps={args.steps}",
        f"--training.local_batch_size={args.local_batch}",
        f"--training.mixed_precision_param={args.precision}",
        "--parallelism.data_parallel_replicate_degree=1",
        "--parallelism.data_parallel_shard_degree=-1",
        f"--metrics.log_freq={args.log_freq}",
        "--eval.enable=false",
        "--metrics.enable_tensorboard=false",
        f"--compile.backend={args.compile_backend}",
        *extra,
    ]
    out = harness.run_child(cmd, cwd=REPO, env=env)
    if out.returncode != 0:
        raise SystemExit(f"variant {name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    windows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines() if '"train"' in line]
    kept = windows[args.warmup :] or windows[-1:]
    rates = harness.summary([w["samples_per_s"] for w in kept])
    row = {
        "variant": name,
        "samples_per_s": rates["median"],
        "samples_per_s_min": rates["min"],
        "samples_per_s_max": rates["max"],
        "peak_memory_gib": max(w["peak_memory_gib"] for w in windows),
        "windows": len(kept),
        "final_loss": windows[-1]["loss"],
        "wall_s": out.wall_s,
        "peak_rss_mib": out.peak_rss_mib,
    }
    if "mfu" in kept[0]:
        row["mfu"] = statistics.median(w["mfu"] for w in kept)
    return row


def plot(rows: list[dict[str, Any]], args: argparse.Namespace, device: str):  # noqa: ANN201 - a matplotlib figure
    plt = harness.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["variant"] for r in rows]
    ax1.bar(names, [r["samples_per_s"] for r in rows])
    ax1.set(ylabel="samples/s (median)", title="throughput")
    ax2.bar(names, [r["peak_memory_gib"] for r in rows])
    ax2.set(ylabel="GiB", title="peak memory")
    fig.suptitle(f"clip/{args.flavor}, {args.precision}, FSDP2 x{args.nproc}, local batch {args.local_batch}, {device}")
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="vit_b32")
    parser.add_argument("--image-size", type=int, default=224, help="data.image_size (0 = native 28x28)")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--local-batch", type=int, default=256)
    parser.add_argument("--precision", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--log-freq", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="log windows to drop before taking the median")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=1, help="launches per variant, interleaved round-robin")
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        launches = iter(range(10**9))  # a fresh dump folder per launch

        def launch(name: str) -> dict[str, Any]:
            row = run_variant(name, VARIANTS[name], args, Path(tmp) / f"{name.strip('+')}_{next(launches)}")
            print(json.dumps(row), flush=True)
            return row

        runs = harness.round_robin(
            {name: (lambda name=name: launch(name)) for name in args.variants},
            args.repeats,
            warmup=0,
            rss=False,
            keep_values=True,
        )
    rows = []
    for name, m in runs.items():
        launched = m.values
        row = (
            dict(launched[0])
            if len(launched) == 1
            else {
                "variant": name,
                "repeats": len(launched),
                **{
                    k: statistics.median(r[k] for r in launched)
                    for k in ("samples_per_s", "mfu", "wall_s")
                    if k in launched[0]
                },
                "samples_per_s_min": min(r["samples_per_s"] for r in launched),
                "samples_per_s_max": max(r["samples_per_s"] for r in launched),
                "peak_memory_gib": max(r["peak_memory_gib"] for r in launched),
                "peak_rss_mib": max(r["peak_rss_mib"] or 0.0 for r in launched),
                "launches": launched,
            }
        )
        rows.append(row)
    device = harness.device_name()
    fields = [
        "variant",
        "repeats",
        "samples_per_s",
        "samples_per_s_min",
        "samples_per_s_max",
        "mfu",
        "peak_memory_gib",
        "peak_rss_mib",
        "windows",
        "final_loss",
        "wall_s",
    ]
    harness.write_results(
        args.out,
        "train_bench",
        harness.metadata(),
        {"config": vars(args), "device": device},
        rows=rows,
        fields=fields,
        figure=lambda: plot(rows, args, device),
    )


if __name__ == "__main__":
    main()
