"""Our classification evaluation against mteb's own, on a real bundled task: emoji names -> their category.

    pip install --no-deps --target /tmp/mteb_pkg mteb polars    # mteb beside this venv, its own deps left out
    python -m benchmarks.mteb_compare --mteb /tmp/mteb_pkg       # about a minute on 2 cores

The task: the bundled emoji set's names (`titan_contrastive/assets/emoji`, "grinning face", "red apple", ...) labelled
with their emoji.json category ("Smileys & Emotion", "Food & Drink", ...; 9 labels), its train split (1,706) and
test split (200) as the trainer holds them out. The bundled all-MiniLM-L6-v2 embeds them. Ours: `python -m
titan_contrastive.evaluate MiniLM --beir '' --classification DIR` (components/classification_eval.py). Theirs: an
`AbsTaskClassification` of mteb holding the same rows, run by `mteb.evaluate` on sentence-transformers' load of the
same folder. Both at 8 rows per label (mteb's default) and at 32. Writes mteb_compare.{json,csv,png} under --out:
per metric both values and their difference.
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
FIELDS = ["per_label", "metric", "ours", "mteb", "difference"]


def write_task(folder: Path) -> Path:
    """The emoji classification set as train.jsonl and test.jsonl in `folder`."""
    import numpy as np

    from titan_contrastive.datasets import emoji

    data = np.load(emoji.npz_file(""), allow_pickle=False)
    names, categories = data["names"].tolist(), data["categories"].tolist()
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        ids = emoji.split_ids(len(names), split)
        rows = "".join(json.dumps({"text": names[i], "label": categories[i]}) + "\n" for i in ids)
        (folder / f"{split}.jsonl").write_text(rows)
    return folder


def ours(folder: Path, per_label: int, out: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "titan_contrastive.evaluate", "", "--beir", "", "--classification", str(folder)]
    cmd += ["--classification-per-label", str(per_label), "--out", str(out)]
    result = harness.run_child(cmd, cwd=harness.REPO)
    if result.returncode != 0:
        raise SystemExit(f"ours failed:\n{result.stderr[-2000:]}")
    return {m: json.loads(out.read_text())[f"classification/{m}"] for m in METRICS}


def theirs(folder: Path, per_label: int, mteb_path: str, out: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([mteb_path, str(harness.REPO)])}
    cmd = [sys.executable, "-m", "benchmarks.mteb_compare", "--side", str(folder), str(per_label), str(out)]
    result = harness.run_child(cmd, cwd=harness.REPO, env=env)
    if result.returncode != 0:
        raise SystemExit(f"mteb failed:\n{result.stderr[-3000:]}")
    return json.loads(out.read_text())


def mteb_side(folder: Path, per_label: int, out: Path) -> None:
    """In the child with mteb importable: the task as an mteb AbsTaskClassification, run by mteb.evaluate."""
    import mteb
    from datasets import Dataset, DatasetDict
    from mteb.abstasks.classification import AbsTaskClassification
    from mteb.abstasks.task_metadata import TaskMetadata
    from sentence_transformers import SentenceTransformer

    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    rows = {
        s: [json.loads(line) for line in (folder / f"{s}.jsonl").read_text().splitlines()] for s in ("train", "test")
    }

    class EmojiCategories(AbsTaskClassification):
        metadata = TaskMetadata(
            name="EmojiCategoryClassification",
            description="An emoji's name labelled with its emoji.json category.",
            dataset={"path": "titan-contrastive/emoji", "revision": "bundled"},
            type="Classification",
            category="t2c",
            modalities=["text"],
            eval_splits=["test"],
            eval_langs=["eng-Latn"],
            main_score="accuracy",
        )
        samples_per_label = per_label

        def load_data(self, **kwargs: Any) -> None:
            self.dataset = DatasetDict({s: Dataset.from_list(r) for s, r in rows.items()})
            self.data_loaded = True

    model = SentenceTransformer(str(bundled_minilm()), device="cpu")
    result = mteb.evaluate(model, tasks=[EmojiCategories()], cache=None, show_progress_bar=False)
    scores = result.task_results[0].scores["test"][0]
    out.write_text(json.dumps({m: float(scores[m]) for m in METRICS}))


def plot(rows: list[dict[str, Any]]):  # noqa: ANN201 - a matplotlib figure
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.5))
    labels = [f"{r['metric']}\n{r['per_label']}/label" for r in rows]
    width = 0.4
    xs = range(len(rows))
    ax.bar([x - width / 2 for x in xs], [r["ours"] for r in rows], width, label="titan_contrastive")
    ax.bar([x + width / 2 for x in xs], [r["mteb"] for r in rows], width, label="mteb")
    ax.set_xticks(list(xs), labels, fontsize=6, rotation=60)
    ax.set_ylabel("score, emoji name -> category (200 test rows)")
    ax.legend()
    fig.suptitle("Classification of the bundled MiniLM's embeddings: ours against mteb's")
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
        for metric in METRICS:
            rows.append(
                {
                    "per_label": per_label,
                    "metric": metric,
                    "ours": mine[metric],
                    "mteb": other[metric],
                    "difference": mine[metric] - other[metric],
                }
            )
        print(per_label, {m: (round(mine[m], 6), round(other[m], 6)) for m in METRICS}, flush=True)
    dist_info = next(Path(args.mteb).glob("mteb-*.dist-info"), None)
    versions["mteb"] = dist_info.name.removeprefix("mteb-").removesuffix(".dist-info") if dist_info else "?"
    payload = {"task": "emoji name -> category (9 labels; 1,706 train, 200 test)", "model": "all-MiniLM-L6-v2"}
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
