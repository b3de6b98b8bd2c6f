"""Triplet accuracy (`components/triplet_eval.py`, `[eval] triplet_path`, `python -m titan_contrastive.evaluate
--triplets`): what sentence-transformers' TripletEvaluator gives for the same model (its query and document prompts)
and rows, whole and at its first 64 dims; the share written from its definition; 2 gloo processes give what 1 gives;
through the trainer, with the best checkpoint kept by it; ColBERT and page documents refused; bad input is one line."""

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
from titan_contrastive.components.triplet_eval import evaluate_triplets, load_triplets
from titan_contrastive.datasets.base import DataError

TRIPLETS = [
    ("a small animal kept as a pet", "a domestic cat", "a bus"),
    ("frozen water", "ice", "a violin"),
    ("frozen water", "snow", "steam"),
    ("the season after summer", "autumn", "spring"),
    ("a person who flies an aircraft", "a pilot", "a bird"),
    ("a musical instrument with keys", "a piano", "keys"),
    ("a domestic cat", "a kitten", "a small animal kept as a pet"),  # a text on both sides
    ("keys", "a lock", "a piano"),
]


def write_rows(file: Path, rows: list[tuple[str, str, str]] = TRIPLETS) -> Path:
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text("".join(json.dumps(dict(zip(("anchor", "positive", "negative"), r))) + "\n" for r in rows))
    return file


def _letters(texts: list[str]) -> torch.Tensor:
    return torch.tensor([[1.0 + t.count(c) for c in "abcdefghijklmnopqrstuvwxyz"] for t in texts]).double()


def _shifted(texts: list[str]) -> torch.Tensor:
    """Another embedding for the document side, so that a side mixed up shows."""
    return _letters([t[1:] + "zz" for t in texts])


@needs("hf")
def test_the_evaluator_equals_sentence_transformers(tmp_path: Path) -> None:
    """A MiniLM folder with query and document prompts through our command and TripletEvaluator (its encode_query and
    encode_document), whole and at 64 dims."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import TripletEvaluator

    from titan_contrastive.evaluate import main
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    prompts = {"query": "question: ", "document": "passage: "}
    SentenceTransformer(str(bundled_minilm()), device="cpu", prompts=prompts).save(str(tmp_path / "minilm"))
    file, out, beir = write_rows(tmp_path / "triplets.jsonl"), tmp_path / "out.json", write_beir(tmp_path / "beir")
    argv = [str(tmp_path / "minilm"), "--beir", str(beir), "--triplets", str(file), "--out", str(out)]
    assert main([*argv, "--dims", "64", "--batch-size", "3"]) == 0
    ours = json.loads(out.read_text())
    model = SentenceTransformer(str(tmp_path / "minilm"), device="cpu")
    anchors, positives, negatives = (list(x) for x in zip(*TRIPLETS))
    for cut, truncate in (("", None), ("dim64/", 64)):
        theirs = TripletEvaluator(anchors, positives, negatives, write_csv=False, truncate_dim=truncate)(model)
        assert ours[f"{cut}triplet/cosine_accuracy"] == theirs["cosine_accuracy"], cut
    without = TripletEvaluator(anchors, positives, negatives, write_csv=False)(
        SentenceTransformer(str(bundled_minilm()), device="cpu")
    )
    assert without["cosine_accuracy"] != ours["triplet/cosine_accuracy"]  # the prompts change it: they are used


def test_the_share_is_its_definition(tmp_path: Path) -> None:
    task = load_triplets(str(write_rows(tmp_path / "triplets.jsonl")))
    assert len(task.anchors) == 7 and len(task.documents) == 15 and task.rows.shape == (8, 3)
    got = evaluate_triplets(task, _letters, _shifted, batch_size=3, dims=(5,))
    for cut, m in (("", 26), ("dim5/", 5)):
        cos = torch.nn.functional.cosine_similarity
        wins = [
            float(
                cos(_letters([a])[0, :m], _shifted([p])[0, :m], 0) > cos(_letters([a])[0, :m], _shifted([n])[0, :m], 0)
            )
            for a, p, n in TRIPLETS
        ]
        assert 0 < sum(wins) < len(wins)
        assert got[f"{cut}triplet/cosine_accuracy"] == pytest.approx(sum(wins) / len(wins), abs=1e-12), cut


def _on_ranks(file: str, out: str) -> None:
    dist.init_process_group("gloo")
    task = load_triplets(file)
    results = evaluate_triplets(task, _letters, _shifted, batch_size=2, rank=dist.get_rank(), world_size=2)
    torch.save(results, Path(out) / f"rank{dist.get_rank()}.pt")


def test_two_processes_give_what_one_gives(tmp_path: Path) -> None:
    file = write_rows(tmp_path / "triplets.jsonl")
    one = evaluate_triplets(load_triplets(str(file)), _letters, _shifted, batch_size=2)
    run_distributed(_on_ranks, 2, str(file), str(tmp_path))
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == one


@needs("hf")
def test_training_measures_it_and_keeps_the_best(tmp_path: Path) -> None:
    from titan_contrastive.config import ConfigError

    file = write_rows(tmp_path / "triplets.jsonl")
    evals = keep_best_run(tmp_path, "triplet_path", file, "triplet/cosine_accuracy")
    assert all(0 <= e["triplet/cosine_accuracy"] <= 1 for e in evals)
    with pytest.raises(ConfigError, match=r"^eval.triplet_path=.*: model.pooling='colbert' embeds a text as its"):
        folder_run(tmp_path / "colbert", "encoder", "--model.pooling=colbert", f"--eval.triplet_path={file}")


def test_bad_files_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "columns.jsonl").write_text(json.dumps({"anchor": "a", "positive": "b"}) + "\n")
    (tmp_path / "lists.jsonl").write_text(json.dumps({"anchor": "a", "positive": ["b"], "negative": "c"}) + "\n")
    (tmp_path / "empty.jsonl").write_text("")
    for name, message in (
        ("missing.jsonl", "does not exist; give a .jsonl, .json or .parquet file of anchor, positive, negative"),
        ("columns.jsonl", "row 0 has no column negative; its rows hold anchor, positive, negative"),
        ("lists.jsonl", "row 0 holds ['str', 'list', 'str']; give three texts"),
        ("empty.jsonl", "no row; give rows of anchor, positive, negative"),
    ):
        with pytest.raises(DataError) as err:
            load_triplets(str(tmp_path / name))
        assert str(err.value).startswith(f"eval.triplet_path='{tmp_path / name}'") and message in str(err.value)
        assert "\n" not in str(err.value)
