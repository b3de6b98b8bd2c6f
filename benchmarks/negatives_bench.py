"""What hard negatives cost the loss: the streamed objective (global negatives' PyTorch path) and the
dense one, forward + backward of the loss alone, at N queries with k hard negatives each, i.e.
N (1 + k) columns, for several k side by side in one process (interleaved rounds, medians).

    python -m benchmarks.negatives_bench                      # N = 2048, d = 512, k = 0 1 3 7
    python -m benchmarks.negatives_bench --n 4096 --ks 0 1 --objective oneway

Prediction (benchmarks/NOTES.md): the streamed softmax loss forms the N x N(1 + k) logits twice,
8 N^2 (1 + k) d FLOPs, so its time should grow as 1 + k. Before timing, each k's streamed
gradients are checked against the dense float64 objective. Writes `negatives_bench.{json,csv,png}`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks import harness
from titan_contrastive.losses import InfoNCE, split_documents
from titan_contrastive.losses.base import columns
from titan_contrastive.steps.global_negatives import StreamingClipStep

SCALE = 1 / 0.07


def problem(n: int, k: int, d: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit queries [n, d] and per-sample documents [n, 1 + k, d] (positive first), as leaves."""
    gen = torch.Generator().manual_seed(seed)
    zx = F.normalize(torch.randn(n, d, generator=gen, dtype=torch.float64), dim=-1)
    zy = F.normalize(torch.randn(n, 1 + k, d, generator=gen, dtype=torch.float64), dim=-1)
    return zx.to(dtype).requires_grad_(), zy.to(dtype).requires_grad_()


def streamed(objective: InfoNCE, zx: torch.Tensor, zy: torch.Tensor, chunk: int) -> torch.Tensor:
    step = StreamingClipStep(stream_chunk_size=chunk, fixed_scale=SCALE, kernel="pytorch", objective=objective)
    return step(lambda _: (zx * 1, zy * 1, None), [None])


def dense(objective: InfoNCE, zx: torch.Tensor, zy: torch.Tensor) -> torch.Tensor:
    loss = objective.dense(zx, columns(*split_documents(zy)), torch.tensor(SCALE, dtype=zx.dtype))
    loss.backward()
    return loss.detach()


def agreement(objective: InfoNCE, k: int, d: int, chunk: int) -> float:
    """Largest relative error of the streamed gradients (float32) against the dense float64 ones, N = 300."""
    x64, y64 = problem(300, k, d, torch.float64, seed=1)
    dense(objective, x64, y64)
    zx, zy = (t.detach().float().requires_grad_() for t in (x64, y64))
    streamed(objective, zx, zy, chunk)
    return max(((g.double() - w).norm() / w.norm()).item() for g, w in ((zx.grad, x64.grad), (zy.grad, y64.grad)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2048, help="queries")
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 3, 7], help="hard negatives per query")
    parser.add_argument("--chunk", type=int, default=1024, help="stream_chunk_size")
    parser.add_argument("--objective", choices=["symmetric", "oneway"], default="symmetric")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    objective = InfoNCE(symmetric=args.objective == "symmetric")
    checks = {k: agreement(objective, k, args.d, args.chunk) for k in args.ks}
    for k, err in checks.items():
        print(f"check k={k}: streamed float32 gradients vs dense float64, rel. error {err:.1e}", flush=True)
    data = {k: problem(args.n, k, args.d, torch.float32) for k in args.ks}

    def clear(name: str) -> None:
        for t in data[int(name.split("k=")[1])]:
            t.grad = None

    variants: dict[str, Any] = {}
    for k, (zx, zy) in data.items():
        variants[f"streamed k={k}"] = lambda zx=zx, zy=zy: streamed(objective, zx, zy, args.chunk)
        variants[f"dense k={k}"] = lambda zx=zx, zy=zy: dense(objective, zx, zy)
    results = harness.round_robin(variants, args.repeats, warmup=args.warmup, before=clear, log=print)
    rows = []
    for name, m in results.items():
        impl, k = name.split(" k=")
        base = results[f"{impl} k={args.ks[0]}"]
        row = {"impl": impl, "k": int(k), "n": args.n, "columns": args.n * (1 + int(k)), "d": args.d, **m.row()}
        if m.ok and base.ok:
            row["x_first_k"] = m.median_s / base.median_s
        row.pop("times_s", None), row.pop("cpu_times_s", None)
        rows.append(row)
        print(f"{name:>14}: {m.median_s * 1000:9.1f} ms  x k={args.ks[0]} {row.get('x_first_k', float('nan')):.2f}")
    meta = harness.metadata(torch.device("cpu"), objective=args.objective)

    def figure() -> Any:
        plt = harness.pyplot()
        fig, ax = plt.subplots(figsize=(6, 4))
        for impl in ("streamed", "dense"):
            got = [r for r in rows if r["impl"] == impl and r["status"] == "ok"]
            ax.plot([1 + r["k"] for r in got], [r["median_s"] * 1000 for r in got], "o-", label=impl)
        ax.set_xlabel("columns per query problem / N (1 + k)")
        ax.set_ylabel("loss forward + backward, ms")
        ax.set_title(f"{args.objective} InfoNCE, N = {args.n}, d = {args.d}")
        ax.legend()
        return fig

    paths = harness.write_results(
        args.out, "negatives_bench", meta, {"objective": args.objective, "checks": checks}, rows=rows, figure=figure
    )
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
