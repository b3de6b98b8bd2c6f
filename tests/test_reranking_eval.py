"""Reranking evaluation (`components/reranking_eval.py`, `[eval] reranking_path`, `python -m titan_contrastive.evaluate
--reranking`): the figures sentence-transformers' RerankingEvaluator gives for the same model and rows, whole and at
its first 64 dims; MAP, MRR@10 and nDCG@10 as their definitions give them; 2 gloo processes give what 1 gives; through
the trainer, with the best checkpoint kept by it; bad input is one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.eval_runs import keep_best_run
from tests.needs import needs
from tests.test_retrieval_metrics import write_beir
from titan_contrastive.datasets.base import DataError

pytestmark = needs("hf")

ROWS = [
    {"query": "a small animal kept as a pet", "positive": ["a domestic cat", "a puppy"], "negative": ["a bus", "ice"]},
    {"query": "frozen water", "positive": ["ice"], "negative": ["a violin", "steam", "a domestic cat", "snow melt"]},
    {"query": "the season after summer", "positive": ["autumn", "fall"], "negative": ["a sailor", "spring", "winter"]},
    {"query": "a person who flies an aircraft", "positive": "a pilot", "negative": ["a bus driver", "a bird"]},
    {"query": "a musical instrument with keys", "positive": ["a piano"], "negative": ["a guitar", "a violin", "keys"]},
    {"query": "no negatives here", "positive": ["a piano"], "negative": []},  # left out, as the evaluator leaves it
] + [
    {"query": f"question {i}", "positive": [f"answer {i}", f"reply {i}"], "negative": [f"answer {i + 1}", "a bird"]}
    for i in range(12)  # more candidates than 10 in none, ranks past 1 in some
]


def write_rows(file: Path, rows: list[dict] = ROWS) -> Path:
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return file


def _letters(texts: list[str]) -> torch.Tensor:
    """A fixed embedding of each text without a model: counts of its letters (a..z) and digits, plus one."""
    return torch.tensor([[1.0 + t.count(c) for c in "abcdefghijklmnopqrstuvwxyz0123456789"] for t in texts]).double()


def test_the_evaluator_equals_sentence_transformers(tmp_path: Path) -> None:
    """The bundled MiniLM through our command (beside a small BEIR folder) and RerankingEvaluator, whole and at its
    first 64 dims (`--dims`, the evaluator's `truncate_dim`)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import RerankingEvaluator

    from titan_contrastive.evaluate import main
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    file, out = write_rows(tmp_path / "rerank.jsonl"), tmp_path / "out.json"
    beir = write_beir(tmp_path / "beir")
    argv = ["", "--beir", str(beir), "--reranking", str(file), "--out", str(out), "--batch-size", "5", "--dims", "64"]
    assert main(argv) == 0
    ours = json.loads(out.read_text())
    model = SentenceTransformer(str(bundled_minilm()), device="cpu")
    samples = [{**r, "positive": [r["positive"]] if isinstance(r["positive"], str) else r["positive"]} for r in ROWS]
    assert ours["reranking/map"] != ours["dim64/reranking/map"] and 0 < ours["reranking/mrr@10"] < 1
    for cut, truncate in (("", None), ("dim64/", 64)):
        theirs = RerankingEvaluator(samples, at_k=10, write_csv=False, truncate_dim=truncate)(model)
        for name in ("map", "mrr@10", "ndcg@10"):
            assert ours[f"{cut}reranking/{name}"] == pytest.approx(theirs[name], abs=1e-6), (cut, name)


def _definitions(file: Path) -> dict[str, float]:
    """MAP, MRR@10 and nDCG@10 (binary gains) of `_letters`' cosines over the rows with a positive and a negative,
    written from their definitions (no ties among these scores)."""
    ap, rr, ndcg = [], [], []
    for row in (json.loads(line) for line in file.read_text().splitlines()):
        positives = [row["positive"]] if isinstance(row["positive"], str) else row["positive"]
        if not (positives and row["negative"]):
            continue
        texts = positives + row["negative"]
        q, d = (torch.nn.functional.normalize(_letters(t), dim=-1) for t in ([row["query"]], texts))
        order = (d @ q[0]).argsort(descending=True).tolist()
        relevant = [i < len(positives) for i in order]
        hits = [r for r, rel in enumerate(relevant) if rel]
        ap.append(sum((k + 1) / (r + 1) for k, r in enumerate(hits)) / len(positives))
        rr.append(1 / (hits[0] + 1) if hits[0] < 10 else 0.0)
        dcg = sum(1 / math.log2(r + 2) for r in hits if r < 10)
        ndcg.append(dcg / sum(1 / math.log2(r + 2) for r in range(min(len(positives), 10))))
    means = {"map": sum(ap) / len(ap), "mrr@10": sum(rr) / len(rr), "ndcg@10": sum(ndcg) / len(ndcg)}
    return {f"reranking/{name}": value for name, value in means.items()}


def test_the_metrics_are_their_definitions(tmp_path: Path) -> None:
    from titan_contrastive.components.reranking_eval import evaluate_reranking
    from titan_contrastive.datasets.reranking_sets import read_reranking

    file = write_rows(tmp_path / "rerank.jsonl")
    task = read_reranking(str(file))
    texts = [([r["positive"]] if isinstance(r["positive"], str) else r["positive"]) + r["negative"] for r in ROWS]
    kept = texts[:5] + texts[6:]  # not the row without negatives
    assert len(task.rows) == len(ROWS) - 1 and len(task.documents) == len(set().union(*kept))
    got = evaluate_reranking(task, _letters, _letters, batch_size=4)
    assert got == pytest.approx(_definitions(file), abs=1e-12)


def _on_ranks(file: str, out: str) -> None:
    from titan_contrastive.components.reranking_eval import evaluate_reranking
    from titan_contrastive.datasets.reranking_sets import read_reranking

    dist.init_process_group("gloo")
    results = evaluate_reranking(
        read_reranking(file), _letters, _letters, batch_size=3, rank=dist.get_rank(), world_size=2
    )
    torch.save(results, Path(out) / f"rank{dist.get_rank()}.pt")


def test_two_processes_give_what_one_gives(tmp_path: Path) -> None:
    from titan_contrastive.components.reranking_eval import evaluate_reranking
    from titan_contrastive.datasets.reranking_sets import read_reranking

    file = write_rows(tmp_path / "rerank.jsonl")
    one = evaluate_reranking(read_reranking(str(file)), _letters, _letters, batch_size=3)
    run_distributed(_on_ranks, 2, str(file), str(tmp_path))
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == one


def test_training_evaluates_reranking_and_keeps_the_best(tmp_path: Path) -> None:
    file = write_rows(tmp_path / "rerank.jsonl")
    evals = keep_best_run(tmp_path, "reranking_path", file, "reranking/ndcg@10", "--eval.dims=8")
    assert all(0 < e["reranking/ndcg@10"] <= 1 and 0 < e["dim8/reranking/map"] <= 1 for e in evals)


def test_bad_files_are_one_line(tmp_path: Path) -> None:
    from titan_contrastive.datasets.reranking_sets import read_reranking

    (tmp_path / "columns.jsonl").write_text(json.dumps({"query": "a", "positives": ["b"], "negative": ["c"]}) + "\n")
    good = {"query": "a", "positive": ["b"], "negative": ["c"]}
    (tmp_path / "later.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(["a", ["b"], ["c"]]) + "\n")
    empty = write_rows(tmp_path / "empty.jsonl", [{"query": "a", "positive": [], "negative": ["c"]}])
    for path, message in (
        (tmp_path / "missing.jsonl", "does not exist; give a .jsonl, .json or .parquet file of query, positive"),
        (tmp_path / "columns.jsonl", "row 0 has no column positive; its rows hold query, positive, negative"),
        (tmp_path / "later.jsonl", "row 1 has no column query, positive, negative; its rows hold query, positive"),
        (empty, "no row with a query, a positive and a negative"),
    ):
        with pytest.raises(DataError) as err:
            read_reranking(str(path))
        assert str(err.value).startswith(f"eval.reranking_path='{path}'") and message in str(err.value)
        assert "\n" not in str(err.value)
