"""SPLADE's vocabulary head and pooling: autograd through the [B, L, V] logits against the fused function
(`models/bi_encoder/splade_head.py`), side by side.

    python -m benchmarks.splade_head_bench                               # CPU: BERT-base's head, 8 texts of 256 tokens
    python -m benchmarks.splade_head_bench --batch 32 --dtype bfloat16   # one GPU

The head of BERT-base (hidden 768 to its 30,522 entries) on random inputs of `--batch` texts of `--length` tokens
(a quarter of them padding), a loss linear in the embedding. Rows, per path and pooling: the bytes autograd keeps
for the backward (`SavedActivations`, counted, so the same on any device), the median seconds of one forward and
backward (`harness.round_robin`, interleaved, after a warm-up), the peak memory of that call above what was
allocated before it (CUDA allocator only), and the embedding's and gradients' largest difference from the logits
path.
Writes splade_head_bench.{json,csv,png}.
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks import harness

NAME = "splade_head_bench"
FIELDS = ["path", "strategy", "batch", "length", "dtype", "saved_mib", "median_s", "peak_mib", "max_diff"]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(harness.RESULTS))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    import torch

    from titan_contrastive.components.memory_probe import SavedActivations
    from titan_contrastive.models.bi_encoder.pooling import splade_pooled
    from titan_contrastive.models.bi_encoder.splade_head import VocabularyHead, splade_head_pooled

    device = harness.default_device()
    dtype = getattr(torch, args.dtype)
    meta = harness.metadata(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    head = torch.nn.Linear(args.hidden, args.vocab).to(device, dtype)
    with torch.no_grad():  # about a tenth of the logits positive, as a trained SPLADE head's
        head.weight.copy_(torch.randn(args.vocab, args.hidden, generator=gen) / args.hidden**0.5)
        head.bias.copy_(torch.full((args.vocab,), -1.3))
    fused_head = VocabularyHead(head)
    x = torch.randn(args.batch, args.length, args.hidden, generator=gen).to(device, dtype).requires_grad_(True)
    mask = torch.ones(args.batch, args.length, dtype=torch.bool, device=device)
    mask[:, args.length * 3 // 4 :] = False
    weights = torch.randn(args.batch, args.vocab, generator=gen).to(device, dtype)
    paths = {
        "logits": lambda strategy: splade_pooled(head(x), mask, strategy),
        "fused": lambda strategy: splade_head_pooled(x, fused_head, mask, strategy),
    }

    def step(path: str, strategy: str) -> list[Any]:
        x.grad, head.weight.grad, head.bias.grad = None, None, None
        out = paths[path](strategy)
        (out.float() * weights.float()).sum().backward()
        return [out.detach(), x.grad, head.weight.grad, head.bias.grad]

    rows = []
    for strategy in ("max", "sum"):
        results, saved = {}, {}
        for path in paths:
            with SavedActivations([x, head.weight, head.bias]) as probe:
                out = paths[path](strategy)
            saved[path] = probe.peak
            del out
            results[path] = step(path, strategy)
        measured = harness.round_robin(
            {path: (lambda path=path, strategy=strategy: step(path, strategy)) for path in paths},
            args.repeats,
            device=device,
            rss=False,  # a process's RSS keeps what the other path freed; the CUDA allocator's peak is per call
        )
        for path, m in measured.items():
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(results[path], results["logits"]))
            peak = None if m.cuda_peak_extra_bytes is None else m.cuda_peak_extra_bytes / 2**20
            rows.append(
                {
                    "path": path,
                    "strategy": strategy,
                    "batch": args.batch,
                    "length": args.length,
                    "dtype": args.dtype,
                    "saved_mib": saved[path] / 2**20,
                    "median_s": m.median_s,
                    "peak_mib": peak,
                    "max_diff": diff,
                    "times_s": m.times_s,
                }
            )

    def figure() -> Any:
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        labels = [f"{r['path']}\n{r['strategy']}" for r in rows]
        axes[0].bar(labels, [r["saved_mib"] for r in rows])
        axes[0].set_ylabel("saved for backward (MiB)")
        axes[1].bar(labels, [r["median_s"] for r in rows])
        axes[1].set_ylabel("forward + backward (s, median)")
        fig.suptitle(
            f"SPLADE head: {args.batch} x {args.length} tokens, {args.hidden} -> {args.vocab}, {args.dtype}, "
            f"{harness.device_name(device)}"
        )
        fig.tight_layout()
        return fig

    harness.write_results(args.out, NAME, meta, {"config": vars(args)}, rows=rows, fields=FIELDS, figure=figure)
    for row in rows:
        peak = "" if row["peak_mib"] is None else f"  CUDA peak {row['peak_mib']:.1f} MiB"
        print(
            f"{row['path']:>6} {row['strategy']}: saved {row['saved_mib']:8.1f} MiB  {row['median_s']:.3f} s{peak}  "
            f"max diff {row['max_diff']:.2e}"
        )


if __name__ == "__main__":
    main()
