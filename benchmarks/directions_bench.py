"""What joint directions and hardness weighting cost the loss: one-way InfoNCE against
Qwen3-Embedding's directions (query_to_query + doc_to_doc), GTE's (+ doc_to_query) and one-way
with hardness weighting (in-batch negatives, alpha 9), the streamed objective (global negatives'
PyTorch path), forward + backward of the loss alone, at N queries with k hard negatives each,
side by side in one process (interleaved rounds, medians).

    python -m benchmarks.directions_bench                   # N = 4096, d = 384, k = 0 1
    python -m benchmarks.directions_bench --n 1024 --ks 0 --repeats 2

Prediction (benchmarks/NOTES.md, 2026-11-27): per query the joint softmax holds M + (N - 1) +
(M - 1 - k) candidates for Qwen3's set and N more for GTE's, against M = N (1 + k); each
direction is one LSE pass and one gradient pass over its blocks. Hardness weighting adds one
elementwise pass per block. Before timing, each objective's
streamed gradients (float32) are checked against its dense float64 form. Writes
`directions_bench.{json,csv,png}`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.negatives_bench import agreement, problem, streamed
from titan_contrastive.losses import Hardness, InfoNCE

OBJECTIVES = {
    "one-way": InfoNCE(False),
    "hardness": InfoNCE(False, hardness=Hardness("in_batch_negatives", 9.0)),
    "qwen3": InfoNCE(False, directions=("query_to_query", "doc_to_doc")),
    "gte": InfoNCE(False, directions=("query_to_query", "doc_to_query", "doc_to_doc")),
}


def candidates(directions: tuple[str, ...], n: int, k: int) -> int:
    """Logits in one query's softmax (before any mask)."""
    m = n * (1 + k)
    extra = {"query_to_query": n - 1, "doc_to_query": n, "doc_to_doc": m - 1 - k}
    return m + sum(extra[d] for d in directions)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=4096, help="queries")
    parser.add_argument("--d", type=int, default=384)
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1], help="hard negatives per query")
    parser.add_argument("--chunk", type=int, default=1024, help="stream_chunk_size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    checks = {}
    for name, objective in OBJECTIVES.items():
        for k in args.ks:
            checks[f"{name} k={k}"] = err = agreement(objective, k, args.d, args.chunk)
            print(f"check {name} k={k}: streamed float32 gradients vs dense float64, rel. error {err:.1e}", flush=True)
    data = {k: problem(args.n, k, args.d, torch.float32) for k in args.ks}

    def clear(name: str) -> None:
        for t in data[int(name.split("k=")[1])]:
            t.grad = None

    variants: dict[str, Any] = {}
    for k, (zx, zy) in data.items():
        for name, objective in OBJECTIVES.items():
            variants[f"{name} k={k}"] = lambda o=objective, zx=zx, zy=zy: streamed(o, zx, zy, args.chunk)
    results = harness.round_robin(variants, args.repeats, warmup=args.warmup, before=clear, log=print)
    rows = []
    for label, m in results.items():
        name, k = label.split(" k=")
        base = results[f"one-way k={k}"]
        n_cand = candidates(OBJECTIVES[name].directions, args.n, int(k))
        row = {"objective": name, "k": int(k), "n": args.n, "d": args.d, "candidates": n_cand, **m.row()}
        row["candidates_x_one_way"] = n_cand / (args.n * (1 + int(k)))
        if m.ok and base.ok:
            row["x_one_way"] = m.median_s / base.median_s
        row.pop("times_s", None), row.pop("cpu_times_s", None)
        rows.append(row)
        print(f"{label:>12}: {m.median_s * 1000:9.1f} ms  x one-way {row.get('x_one_way', float('nan')):.2f}")
    meta = harness.metadata(torch.device("cpu"))

    def figure() -> Any:
        plt = harness.pyplot()
        fig, ax = plt.subplots(figsize=(6, 4))
        width = 0.8 / len(args.ks)
        for j, k in enumerate(args.ks):
            got = [r for r in rows if r["k"] == k and r["status"] == "ok"]
            xs = [i + j * width for i in range(len(got))]
            ax.bar(xs, [r["median_s"] * 1000 for r in got], width, label=f"k = {k}")
            for x, r in zip(xs, got):
                ax.annotate(f"{r['x_one_way']:.2f}x", (x, r["median_s"] * 1000), ha="center", va="bottom", fontsize=8)
        ax.set_xticks([i + width * (len(args.ks) - 1) / 2 for i in range(len(OBJECTIVES))], list(OBJECTIVES))
        ax.set_ylabel("streamed loss forward + backward, ms")
        ax.set_title(f"joint directions, hardness weighting: N = {args.n}, d = {args.d}, stream chunk {args.chunk}")
        ax.legend()
        return fig

    paths = harness.write_results(args.out, "directions_bench", meta, {"checks": checks}, rows=rows, figure=figure)
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
