"""Pair classification (`components/pair_classification_eval.py`, `[eval] pair_classification_path`, `python -m
titan_contrastive.evaluate --pair-classification`): the figures sentence-transformers' BinaryClassificationEvaluator
gives for the same model and pairs, whole and at its first 64 dims; MTEB's rows of lists read as the same pairs; the
accuracy and F1 where one threshold parts the labels exactly are 1; 2 gloo processes give what 1 gives; through the
trainer, with the best checkpoint kept by it; ColBERT refused; bad input is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.eval_runs import keep_best_run
from tests.needs import needs
from tests.test_hf_text import folder_run
from tests.test_retrieval_metrics import write_beir
from titan_contrastive.components.pair_classification_eval import (
    evaluate_pair_classification,
    load_pair_classification,
)
from titan_contrastive.datasets.base import DataError

pytestmark = needs("hf")

PAIRS = [
    ("a small animal kept as a pet", "a domestic cat", 1),
    ("frozen water", "ice", 1),
    ("frozen water", "a violin", 0),
    ("the season after summer", "autumn", 1),
    ("the season after summer", "a sailor", 0),
    ("a person who flies an aircraft", "a pilot", 1),
    ("a person who flies an aircraft", "a bird", 0),
    ("a musical instrument with keys", "a piano", 1),
    ("a musical instrument with keys", "a guitar", 0),
    ("a domestic cat", "a puppy", 0),
    ("ice", "snow melt", 0),
    ("a bus", "a bus driver", 1),
]


def write_rows(file: Path, pairs: list[tuple[str, str, int]] = PAIRS) -> Path:
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text("".join(json.dumps({"sentence1": a, "sentence2": b, "label": y}) + "\n" for a, b, y in pairs))
    return file


def _letters(texts: list[str]) -> torch.Tensor:
    """A fixed embedding of each text without a model: counts of its letters (a..z), plus one."""
    return torch.tensor([[1.0 + t.count(c) for c in "abcdefghijklmnopqrstuvwxyz"] for t in texts]).double()


def test_the_evaluator_equals_sentence_transformers(tmp_path: Path) -> None:
    """The bundled MiniLM through our command and BinaryClassificationEvaluator, whole and at 64 dims."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import BinaryClassificationEvaluator

    from titan_contrastive.evaluate import main
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    file, out, beir = write_rows(tmp_path / "classified.jsonl"), tmp_path / "out.json", write_beir(tmp_path / "beir")
    argv = ["", "--beir", str(beir), "--pair-classification", str(file), "--out", str(out), "--dims", "64"]
    assert main([*argv, "--batch-size", "5"]) == 0
    ours = json.loads(out.read_text())
    model = SentenceTransformer(str(bundled_minilm()), device="cpu")
    first, second, labels = (list(x) for x in zip(*PAIRS))
    assert ours["pair_classification/cosine_ap"] != ours["dim64/pair_classification/cosine_ap"]
    for cut, truncate in (("", None), ("dim64/", 64)):
        theirs = BinaryClassificationEvaluator(first, second, labels, write_csv=False, truncate_dim=truncate)(model)
        assert {k.removeprefix(f"{cut}pair_classification/") for k in ours if k.startswith(cut + "pair")} == set(theirs)
        for name, value in theirs.items():
            assert ours[f"{cut}pair_classification/{name}"] == pytest.approx(value, abs=1e-5), (cut, name)


def test_mteb_rows_of_lists_are_the_same_pairs(tmp_path: Path) -> None:
    first, second, labels = (list(x) for x in zip(*PAIRS))
    mteb = tmp_path / "mteb.jsonl"
    mteb.write_text(json.dumps({"sentence1": first, "sentence2": second, "labels": labels}) + "\n")
    ours = load_pair_classification(str(write_rows(tmp_path / "classified.jsonl")))
    theirs = load_pair_classification(str(mteb))
    assert ours.sentences == theirs.sentences and (ours.pairs == theirs.pairs).all()
    assert (ours.labels == theirs.labels).all() and len(ours.sentences) == len({s for p in PAIRS for s in p[:2]})
    results = evaluate_pair_classification(ours, _letters, batch_size=4)
    assert results == evaluate_pair_classification(theirs, _letters, batch_size=3)


def test_labels_one_threshold_parts_are_classified_exactly() -> None:
    """Pairs whose cosine is above 0.99 exactly when labelled 1: accuracy, F1, precision, recall, AP and MCC all 1."""
    import numpy as np

    from titan_contrastive.components.pair_classification_eval import PairSet

    task = PairSet(["aaa", "aab", "zzz", "aaaa"], np.array([[0, 3], [2, 2], [0, 2], [1, 2]]), np.array([1, 1, 0, 0]))
    got = evaluate_pair_classification(task, _letters, batch_size=2)
    for name in ("accuracy", "f1", "precision", "recall", "ap", "mcc"):
        assert got[f"pair_classification/cosine_{name}"] == pytest.approx(1.0), name


def _on_ranks(file: str, out: str) -> None:
    dist.init_process_group("gloo")
    task = load_pair_classification(file)
    results = evaluate_pair_classification(task, _letters, batch_size=2, rank=dist.get_rank(), world_size=2)
    torch.save(results, Path(out) / f"rank{dist.get_rank()}.pt")


def test_two_processes_give_what_one_gives(tmp_path: Path) -> None:
    file = write_rows(tmp_path / "classified.jsonl")
    one = evaluate_pair_classification(load_pair_classification(str(file)), _letters, batch_size=2)
    run_distributed(_on_ranks, 2, str(file), str(tmp_path))
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == one


def test_training_measures_it_and_keeps_the_best(tmp_path: Path) -> None:
    from titan_contrastive.config import ConfigError

    file = write_rows(tmp_path / "classified.jsonl")
    evals = keep_best_run(tmp_path, "pair_classification_path", file, "pair_classification/cosine_ap")
    assert all(0 < e["pair_classification/cosine_ap"] <= 1 for e in evals)
    with pytest.raises(ConfigError, match=r"^eval.pair_classification_path=.*: model.pooling='colbert' embeds a text"):
        folder_run(
            tmp_path / "colbert", "encoder", "--model.pooling=colbert", f"--eval.pair_classification_path={file}"
        )


def test_bad_files_are_one_line(tmp_path: Path) -> None:
    bad = {
        "columns.jsonl": [{"sentence1": "a", "label": 1}],
        "labels.jsonl": [{"sentence1": "a", "sentence2": "b", "label": 2}],
        "uneven.jsonl": [{"sentence1": ["a", "b"], "sentence2": ["c"], "labels": [0, 1]}],
        "one.jsonl": [
            {"sentence1": "a", "sentence2": "b", "label": 1},
            {"sentence1": "c", "sentence2": "d", "label": 1},
        ],
    }
    for name, rows in bad.items():
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, message in (
        ("missing.jsonl", "does not exist; give a .jsonl, .json or .parquet file of sentence1, sentence2"),
        ("columns.jsonl", "row 0 has no column sentence2; its rows hold sentence1, sentence2"),
        ("labels.jsonl", "row 0 holds 1 sentence1, 1 sentence2 and labels [2]; give each pair a label of 0 or 1"),
        ("uneven.jsonl", "row 0 holds 2 sentence1, 1 sentence2 and labels [0, 1]"),
        ("one.jsonl", "2 pair(s) of label(s) [1]; give pairs of both labels"),
    ):
        with pytest.raises(DataError) as err:
            load_pair_classification(str(tmp_path / name))
        assert str(err.value).startswith(f"eval.pair_classification_path='{tmp_path / name}'"), str(err.value)
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
