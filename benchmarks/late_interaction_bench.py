"""Late interaction's loss over one problem: autograd through every token product against the tiled scores that
recompute each tile for the backward (`losses/maxsim.py`), for InfoNCE, the sigmoid loss and the pairwise loss, side
by side; and the streamed forms of InfoNCE (two passes over the columns) and of the sigmoid loss (one).

    python -m benchmarks.late_interaction_bench                               # CPU: 64 queries, 1 hard negative each
    python -m benchmarks.late_interaction_bench --queries 512 --dtype bfloat16   # one GPU

`--queries` queries of 32 tokens against their positives and `--negatives` hard negatives each (documents of
180 tokens, a quarter of each left out as padding or skipped), 128-wide unit tokens, PyLate's sizes; one-way
InfoNCE over MaxSim (PyLate's Contrastive), the same masked and weighted (`masked`: a column above 0.95 x its
query's positive MaxSim removed, colpali-engine's positive-aware negative filtering, and hardness 2 on the in-batch
negatives), the sigmoid loss over MaxSim (t = 10, b = -10, MaxSim over the query's tokens) and the pairwise loss over
MaxSim (colpali-engine's ColbertPairwiseNegativeCELoss: the hardest in-batch negative, then each query's hard
negatives). Rows, per objective and path (`autograd`: its dense form; `tiled`: its microbatch form; `streamed`: the
global-negatives step's form, `--chunk` rows at a time, its gradients by hand): the most bytes autograd held at once
during the call (`saved`: a tile's graph formed and freed inside it counts) and what it still holds for the backward
when the call returns (`kept`; `SavedActivations`, counted, so the same on any device), the median seconds of one
loss and backward (`harness.round_robin`, interleaved, after a warm-up), the peak memory of that call above what was
allocated before it (CUDA allocator only), and the loss's and gradients' largest difference from the objective's
autograd path. Writes late_interaction_bench.{json,csv,png}.
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks import harness

NAME = "late_interaction_bench"
FIELDS = [
    "objective",
    "path",
    "queries",
    "columns",
    "dtype",
    "saved_mib",
    "kept_mib",
    "median_s",
    "peak_mib",
    "max_diff",
]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--queries", type=int, default=64)
    p.add_argument("--negatives", type=int, default=1)
    p.add_argument("--query-tokens", type=int, default=32)
    p.add_argument("--doc-tokens", type=int, default=180)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--chunk", type=int, default=16, help="rows per block of the streamed forms")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(harness.RESULTS))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    import torch
    import torch.nn.functional as F

    from titan_contrastive.components.memory_probe import SavedActivations
    from titan_contrastive.losses import FalseNegatives, Hardness, Ranks
    from titan_contrastive.losses.late_interaction import LateInteraction, LatePairwise
    from titan_contrastive.losses.late_sigmoid import LateSigmoid

    device = harness.default_device()
    dtype = getattr(torch, args.dtype)
    meta = harness.metadata(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    n, m = args.queries, args.queries * (1 + args.negatives)

    def tokens(rows: int, length: int) -> torch.Tensor:
        t = F.normalize(torch.randn(rows, length, args.dim, generator=gen), dim=-1)
        t[:, length * 3 // 4 :] = 0  # padding and skipped tokens: zero vectors
        return t.flatten(1).to(device, dtype).requires_grad_(True)

    q, docs = tokens(n, args.query_tokens), tokens(m, args.doc_tokens)
    scale = torch.tensor(1.0, device=device)
    sigmoid_scale, bias = torch.tensor(10.0, device=device), torch.tensor(-10.0, device=device)
    masked = LateInteraction(args.dim, false_negatives=FalseNegatives(relative=0.95), hardness=Hardness(strength=2.0))
    objectives = {
        "infonce": LateInteraction(args.dim),
        "masked": masked,
        "sigmoid": LateSigmoid(token_dim=args.dim, normalize=True),
        "pairwise": LatePairwise(token_dim=args.dim),
    }
    paths, streamed = {}, {}
    for name, objective in objectives.items():
        s, b = (sigmoid_scale, bias) if objective.has_bias else (scale, None)
        paths[f"{name} autograd"] = lambda o=objective, s=s, b=b: o.dense(q, docs, s, b)
        paths[f"{name} tiled"] = lambda o=objective, s=s, b=b: o.microbatch(
            q, (docs[:n], docs[n:]), s, b, None, Ranks(None)
        )
        if name in ("infonce", "sigmoid"):
            paths[f"{name} streamed"] = streamed[f"{name} streamed"] = lambda o=objective, s=s, b=b: o.streamed(
                q.detach(), docs.detach(), s, b, first_row=0, num_queries=n, chunk=args.chunk, ranks=Ranks(None)
            )

    def step(path: str) -> list[Any]:
        if path in streamed:  # the gradients by hand, no autograd
            out = streamed[path]()
            return [out.loss, out.grad_rows, out.grad_cols]
        q.grad, docs.grad = None, None
        loss = paths[path]()
        loss.backward()
        return [loss.detach(), q.grad, docs.grad]

    rows, results, saved, kept = [], {}, {}, {}
    for path in paths:
        with SavedActivations([q, docs]) as probe:
            out = paths[path]()
        saved[path], kept[path] = probe.peak, probe.live
        del out
        results[path] = step(path)
    measured = harness.round_robin(
        {path: (lambda path=path: step(path)) for path in paths}, args.repeats, device=device, rss=False
    )
    for path, result in measured.items():
        name = path.split()[0]
        reference = results[f"{name} autograd"]
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(results[path], reference))
        peak = None if result.cuda_peak_extra_bytes is None else result.cuda_peak_extra_bytes / 2**20
        rows.append(
            {
                "objective": name,
                "path": path.split()[1],
                "queries": n,
                "columns": m,
                "dtype": args.dtype,
                "saved_mib": saved[path] / 2**20,
                "kept_mib": kept[path] / 2**20,
                "median_s": result.median_s,
                "peak_mib": peak,
                "max_diff": diff,
                "times_s": result.times_s,
            }
        )

    def figure() -> Any:
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
        labels = [f"{r['objective']}\n{r['path']}" for r in rows]
        at = range(len(rows))
        axes[0].bar([x - 0.2 for x in at], [r["saved_mib"] for r in rows], width=0.4, label="held at most")
        axes[0].bar([x + 0.2 for x in at], [r["kept_mib"] for r in rows], width=0.4, label="kept for the backward")
        axes[0].set_xticks(list(at), labels)
        axes[0].legend(fontsize=7)
        for ax in axes:
            ax.tick_params(axis="x", labelsize=7)
        axes[0].set_ylabel("autograd's saved tensors (MiB)")
        axes[1].bar(labels, [r["median_s"] for r in rows])
        axes[1].set_ylabel("loss + backward (s, median)")
        fig.suptitle(
            f"MaxSim InfoNCE (masked), sigmoid and pairwise: {n} x {args.query_tokens} query tokens, "
            f"{m} x {args.doc_tokens} document tokens, d {args.dim}, {args.dtype}, {harness.device_name(device)}",
            fontsize=9,
        )
        fig.tight_layout()
        return fig

    harness.write_results(args.out, NAME, meta, {"config": vars(args)}, rows=rows, fields=FIELDS, figure=figure)


if __name__ == "__main__":
    main()
