"""Classification evaluation (`components/classification_eval.py`, `[eval] classification_path`, `python -m
titan_contrastive.evaluate --classification`): MTEB's logistic-regression classification (10 undersampled fits;
accuracy, F1, precision, recall, AP for two labels) equal to mteb 2's procedure written out from its source, on two
and on three labels, numbers and strings; a folder of tables and a saved DatasetDict read alike; 2 gloo processes
give what 1 gives; through the trainer (the best checkpoint kept by it) and the command; bad input is one line."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.eval_runs import keep_best_run
from tests.needs import needs
from tests.test_clustering_eval import _letters
from tests.test_retrieval_metrics import write_beir
from titan_contrastive.components.classification_eval import evaluate_classification, load_classification
from titan_contrastive.datasets.base import DataError

pytestmark = needs("hf")  # scikit-learn comes with the [hf] extra

# each label's first 4 words train (one of them mostly another label's letters: which rows a fit draws matters)
WORDS = {0: ["aab", "aaab", "abmm", "azzz", "aaaab", "aba"], 1: ["zzy", "zzzy", "zymm", "zaaa", "zzzzy", "zzyy"]}
WORDS[2] = ["mmn", "mnm", "mnaa", "mzzz", "mmnn", "mmmmn"]


def write_set(folder: Path, labels: tuple = (0, 1), names: dict | None = None, per_split: int = 4) -> Path:
    """Each label's first `per_split` words in train, the rest (and a mixed word) in test, as .jsonl files."""
    folder.mkdir(parents=True, exist_ok=True)
    named = names or {label: label for label in labels}
    train = [{"text": w, "label": named[k]} for k in labels for w in WORDS[k][:per_split]]
    test = [{"text": w, "label": named[k]} for k in labels for w in WORDS[k][per_split:]] + [
        {"text": "azmy", "label": named[labels[0]]}
    ]
    for name, rows in (("train", train), ("test", test)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def mteb(folder: Path, per_label: int) -> dict[str, float]:
    """mteb 2's AbsTaskClassification with its LogisticRegression, written out from its source: one index list,
    shuffled again by each experiment with a RandomState seeded anew with 42, the first `per_label` rows of each label
    kept; raw labels; `_calculate_scores`' metrics (AP where the test labels are two), averaged."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import accuracy_score, average_precision_score, f1_score, precision_score, recall_score

    rows = {
        s: [json.loads(line) for line in (folder / f"{s}.jsonl").read_text().splitlines()] for s in ("train", "test")
    }
    x = {s: [r["text"] for r in rows[s]] for s in rows}
    y = {s: [r["label"] for r in rows[s]] for s in rows}
    model = LogisticRegression(max_iter=100).set_params(random_state=42)
    idxs, scores = list(range(len(y["train"]))), []
    for _ in range(10):
        np.random.RandomState(42).shuffle(idxs)
        counter, picked = defaultdict(int), []
        for i in idxs:
            if counter[y["train"][i]] < per_label:
                picked.append(i)
                counter[y["train"][i]] += 1
        model.fit(np.stack([_letters([x["train"][i]])[0].numpy() for i in picked]), [y["train"][i] for i in picked])
        y_pred = model.predict(np.stack([_letters([t])[0].numpy() for t in x["test"]]))
        y_test = y["test"]
        s = {"accuracy": accuracy_score(y_test, y_pred)}
        s["f1"], s["f1_weighted"] = (
            f1_score(y_test, y_pred, average="macro"),
            f1_score(y_test, y_pred, average="weighted"),
        )
        s["precision"] = precision_score(y_test, y_pred, average="macro")
        s["precision_weighted"] = precision_score(y_test, y_pred, average="weighted")
        s["recall"], s["recall_weighted"] = (
            recall_score(y_test, y_pred, average="macro"),
            recall_score(y_test, y_pred, average="weighted"),
        )
        if len(np.unique(y_test)) == 2:
            s["ap"] = average_precision_score(y_test, y_pred, average="macro")
            s["ap_weighted"] = average_precision_score(y_test, y_pred, average="weighted")
        scores.append(s)
    return {f"classification/{k}": float(np.mean([s[k] for s in scores])) for k in scores[0]}


@pytest.mark.parametrize(
    "labels, names, per_label",
    [((0, 1), None, 2), ((0, 1, 2), None, 1), ((0, 1, 2), {0: "sea", 1: "desert", 2: "forest"}, 8)],
    ids=["two-numbers", "three-numbers", "three-strings"],
)
def test_it_equals_mtebs_procedure(tmp_path: Path, labels: tuple, names: dict | None, per_label: int) -> None:
    folder = write_set(tmp_path / "set", labels, names)
    task = load_classification(str(folder))
    got = evaluate_classification(task, _letters, batch_size=3, per_label=per_label, dims=(2,))
    want = mteb(folder, per_label)
    assert {k: v for k, v in got.items() if not k.startswith("dim")} == pytest.approx(want, abs=1e-12)
    assert ("classification/ap" in got) == (len(labels) == 2)
    assert 0 < got["dim2/classification/accuracy"] <= 1  # a and b alone: the classes of z and m look alike there
    if per_label < 4:  # fewer than the train rows of a label: the experiments' fits differ
        assert len(task.train[0]) == 4 * len(labels)


def test_a_saved_dataset_dict_reads_as_the_folder(tmp_path: Path) -> None:
    from datasets import Dataset, DatasetDict

    folder = write_set(tmp_path / "set", (0, 1, 2))
    splits = {
        s: [json.loads(line) for line in (folder / f"{s}.jsonl").read_text().splitlines()] for s in ("train", "test")
    }
    DatasetDict({s: Dataset.from_list(rows) for s, rows in splits.items()}).save_to_disk(tmp_path / "saved")
    a, b = load_classification(str(folder)), load_classification(str(tmp_path / "saved"))
    assert a.texts == b.texts
    for x, y in zip((*a.train, *a.test), (*b.train, *b.test), strict=True):
        assert np.array_equal(x, y)


def _on_ranks(folder: str, out: str) -> None:
    dist.init_process_group("gloo")
    task = load_classification(folder)
    results = evaluate_classification(task, _letters, batch_size=2, rank=dist.get_rank(), world_size=2, per_label=2)
    torch.save(results, Path(out) / f"rank{dist.get_rank()}.pt")


def test_two_processes_give_what_one_gives(tmp_path: Path) -> None:
    folder = write_set(tmp_path / "set", (0, 1, 2))
    one = evaluate_classification(load_classification(str(folder)), _letters, batch_size=2, per_label=2)
    run_distributed(_on_ranks, 2, str(folder), str(tmp_path))
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == one


def test_training_and_the_command_measure_it(tmp_path: Path) -> None:
    from titan_contrastive.evaluate import main

    folder = write_set(tmp_path / "set", (0, 1, 2))
    evals = keep_best_run(tmp_path, "classification_path", folder, "classification/f1")
    assert all(0 <= e["classification/accuracy"] <= 1 and 0 <= e["classification/recall"] <= 1 for e in evals)
    out = tmp_path / "out.json"
    beir = write_beir(tmp_path / "beir")
    argv = ["", "--beir", str(beir), "--classification", str(folder), "--classification-per-label", "2"]
    assert main([*argv, "--out", str(out)]) == 0  # the bundled MiniLM
    assert 0 <= json.loads(out.read_text())["classification/f1_weighted"] <= 1


def test_bad_sets_are_one_line(tmp_path: Path) -> None:
    good = write_set(tmp_path / "good")
    (tmp_path / "no_test").mkdir()
    (tmp_path / "no_test" / "train.jsonl").write_text((good / "train.jsonl").read_text())
    columns = write_set(tmp_path / "columns")
    (columns / "test.jsonl").write_text(json.dumps({"text": "a", "labels": 1}) + "\n")
    one = write_set(tmp_path / "one", (0,))
    listed = write_set(tmp_path / "listed")
    (listed / "train.jsonl").write_text(json.dumps({"text": "a", "label": [1]}) + "\n")
    for path, message in (
        (good / "train.jsonl", "is not a folder; give a folder of train and test tables"),
        (tmp_path / "no_test", "holds no test table; give test.jsonl (or .json, .csv, .parquet) beside the other"),
        (columns, "(test): row 0 has no column label; its rows hold text, label"),
        (one, "its train rows hold fewer than two labels or its test rows none"),
        (listed, "(train): row 0 holds no text and label; give a text and its label (a number or a string)"),
    ):
        with pytest.raises(DataError) as err:
            load_classification(str(path))
        assert str(err.value).startswith(f"eval.classification_path='{path}'") and message in str(err.value)
        assert "\n" not in str(err.value)
