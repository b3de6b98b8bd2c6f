"""Our classification and clustering evaluations against mteb's own, on a real bundled set: emoji names and their
category.

    pip install --no-deps --target /tmp/mteb_pkg mteb polars    # mteb beside this venv, its own deps left out
    python -m benchmarks.mteb_compare --mteb /tmp/mteb_pkg       # about a minute on 2 cores

The set: the bundled emoji set's names (`titan_contrastive/assets/emoji`, "grinning face", "red apple", ...)
labelled with their emoji.json category ("Smileys & Emotion", "Food & Drink", ...; 9 labels). Classification: its
train split (1,706) and test split (200) as the trainer holds them out, at 8 rows per label (mteb's default) and 32.
Clustering: MTEB's legacy layout, rows of sentences and labels: the train names in 4 rows and the test names in one.
The bundled all-MiniLM-L6-v2 embeds them. Ours: `python -m titan_contrastive.evaluate MiniLM --beir ''
--classification DIR --clustering FILE` (components/classification_eval.py, clustering_eval.py). Theirs: an
`AbsTaskClassification` and an `AbsTaskClusteringLegacy` of mteb holding the same rows, run by `mteb.evaluate` on
sentence-transformers' load of the same folder. Writes mteb_compare.{json,csv,png} under --out: per metric both
values and their difference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from benchmarks import harness

PER_LABEL = (8, 32)
METRICS = ["accuracy", "f1", "f1_weighted", "precision", "precision_weighted", "recall", "recall_weighted"]
CLUSTER_ROWS = 4
"""The rows the train names are cut into (the test names are one more)."""
FIELDS = ["task", "setting", "metric", "ours", "mteb", "difference"]


def write_task(folder: Path) -> Path:
    """The emoji classification set as train.jsonl and test.jsonl in `folder`, and the clustering rows beside it in
    clusters.jsonl."""
    import numpy as np

    from titan_contrastive.datasets import emoji

    data = np.load(emoji.npz_file(""), allow_pickle=False)
    names, categories = data["names"].tolist(), data["categories"].tolist()
    folder.mkdir(parents=True, exist_ok=True)
    clusters = []
    for split, parts in (("train", CLUSTER_ROWS), ("test", 1)):
        ids = emoji.split_ids(len(names), split)
        rows = "".join(json.dumps({"text": names[i], "label": categories[i]}) + "\n" for i in ids)
        (folder / f"{split}.jsonl").write_text(rows)
        for part in np.array_split(ids, parts):
            clusters.append({"sentences": [names[i] for i in part], "labels": [categories[i] for i in part]})
    (folder.parent / "clusters.jsonl").write_text("".join(json.dumps(row) + "\n" for row in clusters))
    return folder


def ours(folder: Path, per_label: int, out: Path) -> dict[str, float]:
    """classification/... and clustering/v_measure of `python -m titan_contrastive.evaluate` on the bundled MiniLM."""
    cmd = [sys.executable, "-m", "titan_contrastive.evaluate", "", "--beir", "", "--classification", str(folder)]
    cmd += ["--classification-per-label", str(per_label), "--clustering", str(folder.parent / "clusters.jsonl")]
    result = harness.run_child([*cmd, "--out", str(out)], cwd=harness.REPO)
    if result.returncode != 0:
        raise SystemExit(f"ours failed:\n{result.stderr[-2000:]}")
    return json.loads(out.read_text())


def theirs(folder: Path, per_label: int, mteb_path: str, out: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([mteb_path, str(harness.REPO)])}
    cmd = [sys.executable, "-m", "benchmarks.mteb_compare", "--side", str(folder), str(per_label), str(out)]
    result = harness.run_child(cmd, cwd=harness.REPO, env=env)
    if result.returncode != 0:
        raise SystemExit(f"mteb failed:\n{result.stderr[-3000:]}")
    return json.loads(out.read_text())


def mteb_side(folder: Path, per_label: int, out: Path) -> None:
    """In the child with mteb importable: the sets as an mteb AbsTaskClassification and AbsTaskClusteringLegacy, run
    by mteb.evaluate; their scores under our keys."""
    import mteb
    from datasets import Dataset, DatasetDict
    from mteb.abstasks.classification import AbsTaskClassification
    from mteb.abstasks.clustering_legacy import AbsTaskClusteringLegacy
    from mteb.abstasks.task_metadata import TaskMetadata
    from sentence_transformers import SentenceTransformer

    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    def read(file: Path) -> list[dict[str, Any]]:
        return [json.loads(line) for line in file.read_text().splitlines()]

    def task_metadata(name: str, kind: str, main: str) -> TaskMetadata:
        return TaskMetadata(
            name=name,
            description="Emoji names and their emoji.json categories.",
            dataset={"path": "titan-contrastive/emoji", "revision": "bundled"},
            type=kind,
            category="t2c",
            modalities=["text"],
            eval_splits=["test"],
            eval_langs=["eng-Latn"],
            main_score=main,
        )

    class EmojiCategories(AbsTaskClassification):
        metadata = task_metadata("EmojiCategoryClassification", "Classification", "accuracy")
        samples_per_label = per_label

        def load_data(self, **kwargs: Any) -> None:
            self.dataset = DatasetDict({s: Dataset.from_list(read(folder / f"{s}.jsonl")) for s in ("train", "test")})
            self.data_loaded = True

    class EmojiClusters(AbsTaskClusteringLegacy):
        metadata = task_metadata("EmojiCategoryClustering", "Clustering", "v_measure")

        def load_data(self, **kwargs: Any) -> None:
            self.dataset = DatasetDict({"test": Dataset.from_list(read(folder.parent / "clusters.jsonl"))})
            self.data_loaded = True

    model = SentenceTransformer(str(bundled_minilm()), device="cpu")
    result = mteb.evaluate(model, tasks=[EmojiCategories(), EmojiClusters()], cache=None, show_progress_bar=False)
    scores = {r.task_name: r.scores["test"][0] for r in result.task_results}
    classes, clusters = scores["EmojiCategoryClassification"], scores["EmojiCategoryClustering"]
    mine = {f"classification/{m}": float(classes[m]) for m in METRICS}
    out.write_text(json.dumps({**mine, "clustering/v_measure": float(clusters["v_measure"])}))


def plot(rows: list[dict[str, Any]]):  # noqa: ANN201 - a matplotlib figure
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.5))
    labels = [f"{r['metric']}\n{r['setting']}" for r in rows]
    width = 0.4
    xs = range(len(rows))
    ax.bar([x - width / 2 for x in xs], [r["ours"] for r in rows], width, label="titan_contrastive")
    ax.bar([x + width / 2 for x in xs], [r["mteb"] for r in rows], width, label="mteb")
    ax.set_xticks(list(xs), labels, fontsize=6, rotation=60)
    ax.set_ylabel("score, emoji names and their categories")
    ax.legend()
    fig.suptitle("Classification and clustering of the bundled MiniLM's embeddings: ours against mteb's")
    return fig


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--side"]:
        folder, per_label, out = argv[1:4]
        return mteb_side(Path(folder), int(per_label), Path(out))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mteb", required=True, help="a folder mteb (and polars) are installed in (pip --target)")
    p.add_argument("--out", type=Path, default=harness.RESULTS, help="where mteb_compare.{json,csv,png} go")
    args = p.parse_args(argv)
    work = harness.REPO / "outputs" / "mteb_compare"
    folder = write_task(work / "emoji_categories")
    rows = []
    versions = {}
    for per_label in PER_LABEL:
        mine = ours(folder, per_label, work / f"ours_{per_label}.json")
        other = theirs(folder, per_label, args.mteb, work / f"mteb_{per_label}.json")
        keys = [f"classification/{m}" for m in METRICS]
        keys += ["clustering/v_measure"] if per_label == PER_LABEL[0] else []
        for key in keys:
            task, metric = key.split("/")
            setting = f"{per_label} rows per label" if task == "classification" else f"{CLUSTER_ROWS + 1} rows"
            rows.append(
                {
                    "task": task,
                    "setting": setting,
                    "metric": metric,
                    "ours": mine[key],
                    "mteb": other[key],
                    "difference": mine[key] - other[key],
                }
            )
        print(per_label, {k: (round(mine[k], 6), round(other[k], 6)) for k in keys}, flush=True)
    dist_info = next(Path(args.mteb).glob("mteb-*.dist-info"), None)
    versions["mteb"] = dist_info.name.removeprefix("mteb-").removesuffix(".dist-info") if dist_info else "?"
    payload = {
        "task": "emoji name -> category (9 labels; 1,706 train, 200 test; clustering: 5 rows of them)",
        "model": "all-MiniLM-L6-v2",
    }
    harness.write_results(
        args.out,
        "mteb_compare",
        harness.metadata(**versions),
        payload,
        rows=rows,
        fields=FIELDS,
        figure=lambda: plot(rows),
    )
    print(f"wrote {args.out}/mteb_compare.json, .csv and .png")


if __name__ == "__main__":
    main()
