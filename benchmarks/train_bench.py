"""Training throughput of {plain, +AC, +compile, +both} through run_train.sh, side by side.

    python benchmarks/train_bench.py --flavor vit_b32 --image-size 224 --nproc 1 --local-batch 256 --precision bfloat16
    python benchmarks/train_bench.py --flavor debug --image-size 0 --steps 20 --log-freq 5 --local-batch 64 \
        --precision float32 --compile-backend aot_eager --out /tmp/bench   # CPU smoke (minutes)

Each variant is a real `run_train.sh` launch (FSDP2 layout, the given precision, eval off) whose
`metrics.jsonl` gives samples/s, MFU and peak memory per log window; the first `--warmup`
windows (compilation, allocator warm-up) are dropped and the median of the rest is reported.
Variants run one after another in the same invocation so their ratios are comparable.
Writes `train_bench.json` and `train_bench.png` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {
    "plain": [],
    "+AC": ["--activation_checkpoint.mode=selective"],
    "+compile": ["--compile.enable=true"],
    "+both": ["--activation_checkpoint.mode=selective", "--compile.enable=true"],
}


def run_variant(name: str, extra: list[str], args: argparse.Namespace, dump: Path) -> dict[str, Any]:
    env = {**os.environ, "NGPU": str(args.nproc), "PYTHON": sys.executable, "LOG_RANK": "0"}
    cmd = ["./run_train.sh", f"--job.dump_folder={dump}", f"--model.flavor={args.flavor}", f"--data.image_size={args.image_size}",
           f"--training.steps={args.steps}", f"--training.local_batch_size={args.local_batch}",
           f"--training.mixed_precision_param={args.precision}", "--parallelism.data_parallel_replicate_degree=1",
           "--parallelism.data_parallel_shard_degree=-1", f"--metrics.log_freq={args.log_freq}",
           "--eval.enable=false", "--metrics.enable_tensorboard=false", f"--compile.backend={args.compile_backend}", *extra]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"variant {name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    windows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines() if '"train"' in line]
    kept = windows[args.warmup:] or windows[-1:]
    row = {"variant": name, "samples_per_s": statistics.median(w["samples_per_s"] for w in kept),
           "peak_memory_gib": max(w["peak_memory_gib"] for w in windows), "windows": len(kept),
           "final_loss": windows[-1]["loss"]}
    if "mfu" in kept[0]:
        row["mfu"] = statistics.median(w["mfu"] for w in kept)
    return row


def main() -> None:
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
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            rows.append(run_variant(name, VARIANTS[name], args, Path(tmp) / name.strip("+")))
            print(json.dumps(rows[-1]), flush=True)
    device = "cpu"
    try:
        import torch

        if torch.cuda.is_available():
            device = torch.cuda.get_device_name()
    except ImportError:
        pass
    result = {"config": vars(args), "device": device, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_bench.json").write_text(json.dumps(result, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["variant"] for r in rows]
    ax1.bar(names, [r["samples_per_s"] for r in rows])
    ax1.set(ylabel="samples/s (median)", title="throughput")
    ax2.bar(names, [r["peak_memory_gib"] for r in rows])
    ax2.set(ylabel="GiB", title="peak memory")
    fig.suptitle(f"clip/{args.flavor}, {args.precision}, FSDP2 x{args.nproc}, local batch {args.local_batch}, {device}")
    fig.tight_layout()
    fig.savefig(out / "train_bench.png", dpi=120)


if __name__ == "__main__":
    main()
