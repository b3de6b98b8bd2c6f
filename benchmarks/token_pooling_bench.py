"""What token pooling of a late-interaction index costs (`components/token_pooling.py`: sentence-transformers'
HierarchicalTokenPooling, scipy's Ward linkage on the CPU), per document, at ColBERT's and ColQwen's sizes.

    python -m benchmarks.token_pooling_bench                         # 180, 768 and 1,024 tokens; factors 2 and 3
    python -m benchmarks.token_pooling_bench --tokens 1024 --factors 3 --docs 4 --repeats 3

`--docs` documents of each token count (unit tokens, `--dim` wide, 1 protected), pooled as one batch the way the
evaluation pools a batch of embedded documents. Rows, per (tokens, factor): the median milliseconds per document
(`harness.round_robin`, every variant interleaved, after a warm-up), the vectors a document keeps, and their share
of its tokens. Writes token_pooling_bench.{json,csv,png}.
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks import harness

NAME = "token_pooling_bench"
FIELDS = ["tokens", "factor", "dim", "docs", "ms_per_doc", "kept_tokens", "kept_share"]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[180, 768, 1024])
    p.add_argument("--factors", type=float, nargs="+", default=[2.0, 3.0])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--docs", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(harness.RESULTS))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    import torch
    import torch.nn.functional as F

    from titan_contrastive.components.token_pooling import document_pooler, token_counts

    meta = harness.metadata("cpu")
    gen = torch.Generator().manual_seed(0)
    docs = {n: F.normalize(torch.randn(args.docs, n, args.dim, generator=gen), dim=-1).flatten(1) for n in args.tokens}
    variants, kept = {}, {}
    for n in args.tokens:
        for f in args.factors:
            pool = document_pooler(args.dim, f, 1, "token_pooling_bench")
            variants[f"{n}x{f:g}"] = lambda pool=pool, rows=docs[n]: pool(rows)
            kept[f"{n}x{f:g}"] = token_counts(pool(docs[n]), args.dim).double().mean().item()
    measured = harness.round_robin(variants, args.repeats, device="cpu", rss=False)
    rows = []
    for n in args.tokens:
        for f in args.factors:
            key = f"{n}x{f:g}"
            result = measured[key]
            rows.append(
                {
                    "tokens": n,
                    "factor": f,
                    "dim": args.dim,
                    "docs": args.docs,
                    "ms_per_doc": 1e3 * result.median_s / args.docs,
                    "kept_tokens": kept[key],
                    "kept_share": kept[key] / n,
                    "times_s": result.times_s,
                }
            )

    def figure() -> Any:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for f in args.factors:
            mine = [r for r in rows if r["factor"] == f]
            ax.plot([r["tokens"] for r in mine], [r["ms_per_doc"] for r in mine], marker="o", label=f"factor {f:g}")
        ax.set_xlabel("tokens per document")
        ax.set_ylabel("ms per document (median)")
        ax.legend()
        ax.set_title(f"Ward token pooling, d {args.dim}, {args.docs} documents a batch, {meta['cpu']}", fontsize=8)
        fig.tight_layout()
        return fig

    harness.write_results(args.out, NAME, meta, {"config": vars(args)}, rows=rows, fields=FIELDS, figure=figure)


if __name__ == "__main__":
    main()
