"""The trainer's own step on one GPU: plain, GradCache, global negatives and accumulation side by side
at one global batch, with MFU, peak memory, the host syncs each step makes, and the trainer end to end.

    python -m benchmarks.step_gpu_bench --out DIR                          # GPU: vit_b32 224 px bf16
    python -m benchmarks.step_gpu_bench --flavor debug --image-size 0 --precision float32 --batch 64 \\
        --chunk 24 --scale 128 --steps 2 --e2e-steps 4 --variants plain gradcache global --out /tmp/bench  # CPU

Each variant is one child process that builds `Trainer` from `train_configs/debug.toml` plus the
variant's overrides (model, precision, batch, step kind), takes its microbatches from the training
set once (pinned on CUDA), and times `Trainer.train_step` over `--steps` steps after `--warmup`
(CUDA-synchronized; median). It then runs one more step under CUDA's sync debug mode and records
every synchronizing call by its call site (`components.host_syncs.sync_sites`), and,
with `--e2e-steps`, `Trainer.train()` for that many more steps through the real data loader and
logging (samples/s of the logged windows after the first); with `--profile`, one more step traced
(`_kernel_profile.kernel_times`: milliseconds by kernel family, the top kernels, and `busy_share`,
kernel time over the untraced step's wall time). The variants at `--batch`:
plain (one microbatch), gradcache (`--chunk` samples per forward), global (microbatches of `--chunk`,
negatives over the whole batch), accumulate (microbatches of `--chunk`, microbatch negatives); at each
`--scale` batch: global with microbatches of `--chunk` (one warm-up, two timed steps; the trainer is
built for one microbatch and its step given all of them, so batches beyond the dataset's size run).
At most 8 distinct microbatches are held (pinned); a step cycles through them. Each child is
killed at `--timeout`, and none starts once `--time-budget` is spent. JSON after every variant (a time limit loses
only the row in flight); CSV and PNG at the end. Writes `step_gpu_bench_{cuda,cpu}.{json,csv,png}`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DISTINCT = 8  # microbatches of real samples held pinned; a step cycles through them (a 64K batch of 224 px
# float32 images would be 38 GB of host memory; the values do not change the work)


def variants(args: argparse.Namespace) -> dict[str, list[str]]:
    b, c = args.batch, args.chunk
    table = {
        "plain": [f"--training.local_batch_size={b}"],
        "gradcache": [f"--training.local_batch_size={b}", "--gradcache.enabled=true", f"--gradcache.chunk_sizes={c}"],
        "global": [f"--training.local_batch_size={c}", "--loss.negatives=global"],
        "accumulate": [f"--training.local_batch_size={c}"],
    }
    table = {name: [f"--training.global_batch_size={b}", *o] for name, o in table.items()}
    table = {name: [*o, *args.override] for name, o in table.items()}
    rows = {name: table[name] for name in args.variants}
    for n in args.scale:
        # built for one microbatch (the bundled sets hold fewer samples than a 16K-64K batch, which the trainer
        # refuses); the step then takes all n / c microbatches, which is all a global-negatives step reads
        rows[f"global@{n}"] = [f"--training.global_batch_size={c}", f"--training.local_batch_size={c}"]
        rows[f"global@{n}"] += ["--loss.negatives=global", *args.override]
    for name in args.compile:
        rows[f"{name}+compile"] = [*table[name], "--compile.enable=true"]
    return rows


def common(args: argparse.Namespace, dump: str, total_steps: int) -> list[str]:
    return [
        "--job.config_file=train_configs/debug.toml",
        f"--job.dump_folder={dump}",
        f"--model.flavor={args.flavor}",
        f"--data.image_size={args.image_size}",
        f"--training.mixed_precision_param={args.precision}",
        f"--training.device={args.device}",
        f"--training.steps={total_steps}",
        f"--data.num_workers={args.num_workers}",
        f"--metrics.log_freq={args.log_freq}",
        "--metrics.enable_tensorboard=false",
        "--eval.enable=false",
    ]


def worker(name: str, overrides: list[str], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from titan_contrastive.components.host_syncs import sync_sites
    from titan_contrastive.components.metrics import device_peak_tflops
    from titan_contrastive.config import parse_args
    from titan_contrastive.train import Trainer

    cuda = args.device == "cuda"
    bare = args.warmup + args.steps + (1 if cuda else 0)
    with tempfile.TemporaryDirectory() as dump:
        start = time.perf_counter()
        trainer = Trainer(parse_args([*common(args, dump, bare + args.e2e_steps), *overrides]))
        build_s = time.perf_counter() - start
        local, device = trainer.cfg.training.local_batch_size, trainer.device
        count = int(name.split("@")[1].split("+")[0]) // local if "@" in name else trainer.ga_steps
        global_batch, staged = count * local, []
        for j in range(min(count, DISTINCT)):
            batch = trainer.train_set.__getitems__([(j * local + i) % len(trainer.train_set) for i in range(local)])
            staged.append({k: v.pin_memory() if cuda and torch.is_tensor(v) else v for k, v in batch.items()})
        batches = [staged[j % len(staged)] for j in range(count)]

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize(device)

        times = []
        for i in range(args.warmup + args.steps):
            sync()
            start = time.perf_counter()
            trainer.train_step(batches)
            sync()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        row: dict[str, Any] = {"variant": name, "global_batch": global_batch, "build_s": build_s}
        row["step_s"] = statistics.median(times)
        row["step_min_s"] = min(times)
        row["samples_per_s"] = global_batch / row["step_s"]
        peak = device_peak_tflops(device, 0.0)
        flops = trainer.model_args.flops_per_sample()
        row["mfu"] = row["samples_per_s"] * flops / (peak * 1e12) if peak and flops else None
        if cuda:
            row["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            row["sync_sites"] = dict(sync_sites(lambda: trainer.train_step(batches)).most_common())
            sync()
            row["syncs"] = sum(row["sync_sites"].values())
        if args.profile:  # one more step, traced: where its time goes by kernel family
            from benchmarks._kernel_profile import STEP_FAMILIES, kernel_times

            row["profile"] = kernel_times(lambda: trainer.train_step(batches), device, STEP_FAMILIES, top=40)
            row["busy_share"] = row["profile"]["total_ms"] / (row["step_s"] * 1e3)
        if args.e2e_steps:
            start = time.perf_counter()
            trainer.train()
            row["e2e_wall_s"] = time.perf_counter() - start
            logged = [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
            windows = [r for r in logged if "samples_per_s" in r][1:]
            rates = [r["samples_per_s"] for r in windows]
            row["e2e_samples_per_s"] = statistics.median(rates) if rates else None
            shares = [r["data_share"] for r in windows if "data_share" in r]
            row["e2e_data_share"] = statistics.median(shares) if shares else None
            if rates:
                row["e2e_over_bare"] = row["e2e_samples_per_s"] / row["samples_per_s"]
        trainer.metrics.close()
    return row


def plot(rows: list[dict[str, Any]], title: str) -> Any:
    from benchmarks import harness

    ok = [r for r in rows if r.get("samples_per_s")]
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(range(len(ok)), [r["samples_per_s"] for r in ok], label="bare train_step")
    e2e = [(i, r["e2e_samples_per_s"]) for i, r in enumerate(ok) if r.get("e2e_samples_per_s")]
    if e2e:
        ax.scatter(*zip(*e2e), color="k", zorder=3, label="trainer end to end")
    ax.set_xticks(range(len(ok)), [r["variant"] for r in ok], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("samples/s")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="vit_b32")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--precision", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--scale", type=int, nargs="*", default=[4096, 16384], help="global batches for global@N")
    kinds = ["plain", "gradcache", "global", "accumulate"]
    parser.add_argument("--variants", nargs="*", default=kinds, choices=kinds)
    parser.add_argument("--compile", nargs="*", default=[], choices=kinds, help="these also with --compile.enable=true")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--e2e-steps", type=int, default=0, help="then Trainer.train() for this many steps")
    parser.add_argument("--e2e", nargs="*", default=["plain", "global"], help="variants run end to end")
    parser.add_argument("--log-freq", type=int, default=5)
    parser.add_argument(
        "--profile", action="store_true", help="trace one more step: time by kernel family (CPU: by operator)"
    )
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=240, help="seconds per variant")
    parser.add_argument("--time-budget", type=float, default=3600, help="seconds for all variants (then skipped)")
    parser.add_argument(
        "--override", action="append", default=[], help="one more trainer override for every variant (repeatable)"
    )
    parser.add_argument("--tag", default="", help="suffix of the result files' name")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        name, overrides = args.worker[0], json.loads(args.worker[1])
        print(json.dumps(worker(name, overrides, args)))
        return
    import subprocess

    from benchmarks import harness

    meta = harness.metadata(args.device, benchmark_args={k: v for k, v in vars(args).items() if k != "out"})
    name = f"step_gpu_bench_{'cuda' if args.device == 'cuda' else 'cpu'}{'_' + args.tag if args.tag else ''}"
    rows: list[dict[str, Any]] = []
    passthrough = list(argv if argv is not None else sys.argv[1:])
    start = time.perf_counter()
    for variant, overrides in variants(args).items():
        e2e = args.e2e_steps if variant.split("+")[0] in args.e2e else 0  # not global@N: built for one microbatch
        cmd = [sys.executable, "-m", "benchmarks.step_gpu_bench", *passthrough, f"--e2e-steps={e2e}"]
        if "@" in variant:  # the scaling rows: long steps, fewer of them
            cmd += ["--warmup=1", f"--steps={min(args.steps, 2)}"]
        cmd += ["--worker", variant, json.dumps(overrides)]
        timeout = min(args.timeout, args.time_budget - (time.perf_counter() - start))
        if timeout < 20:
            rows.append({"variant": variant, "status": "skipped", "detail": "--time-budget spent"})
            continue
        try:
            child = harness.run_child(cmd, cwd=REPO, timeout=timeout)
            if child.returncode == 0:
                row = json.loads(child.stdout.strip().splitlines()[-1])
            else:
                tail = (child.stdout + child.stderr).strip().splitlines()[-3:]
                row = {"variant": variant, "status": "error", "detail": " | ".join(tail)[-600:]}
            row["peak_rss_mib"], row["wall_s"] = child.peak_rss_mib, child.wall_s
        except subprocess.TimeoutExpired:
            row = {"variant": variant, "status": "error", "detail": f"timed out after {timeout:.0f} s"}
        row["overrides"] = overrides
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("sync_sites", "profile")}), flush=True)
        if "profile" in row:
            print(json.dumps(row["profile"]["families_ms"]), flush=True)
        harness.write_json(args.out / f"{name}.json", meta, {"variants": rows})
    base = next((r for r in rows if r["variant"].startswith("plain") and "step_s" in r), None)
    for row in rows:
        if base and "step_s" in row and row["global_batch"] == base["global_batch"]:
            row["time_over_plain"] = row["step_s"] / base["step_s"]
    flat = [
        {
            **{k: v for k, v in r.items() if k not in ("sync_sites", "overrides", "profile")},
            **{f"ms {k}": v for k, v in r.get("profile", {}).get("families_ms", {}).items()},
        }
        for r in rows
    ]
    title = f"{args.flavor} {args.precision}, train_step per variant ({meta['device']}, {meta['date'][:10]})"
    harness.write_results(args.out, name, meta, {"variants": rows}, rows=flat, figure=lambda: plot(rows, title))
    for row in flat:
        print(row)


if __name__ == "__main__":
    main()
