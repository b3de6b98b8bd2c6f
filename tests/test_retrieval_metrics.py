"""components/retrieval_metrics.py: a BEIR folder read as BEIR reads it, a chunked top-k equal to
torch.topk, and IR metrics equal to sentence-transformers' InformationRetrievalEvaluator."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.needs import require
from titan_contrastive.components.retrieval_metrics import ir_metrics, top_k
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.beir_folder import read_beir

CORPUS = [  # d3 and d4 are the same document: their scores tie exactly (same chunk, so the same products)
    {"_id": "d5", "title": "Paris", "text": "Paris is the capital of France."},
    {"_id": "d1", "title": "", "text": "The Eiffel Tower stands in Paris."},
    {"_id": "d3", "title": "Cats", "text": "Cats sleep most of the day."},
    {"_id": "d4", "title": "Cats", "text": "Cats sleep most of the day."},
    {"_id": "d2", "text": "Berlin is the capital of Germany."},
    {"_id": "d7", "text": "Photosynthesis turns light into sugar in plants."},
    {"_id": "d6", "text": "The stock market fell sharply on Monday."},
]
QUERIES = [
    {"_id": "q1", "text": "What is the capital of France?"},
    {"_id": "q2", "text": "Cats sleep most of the day."},
    {"_id": "q3", "text": "How do plants make food?"},
    {"_id": "q4", "text": "Which city is Germany's capital?"},
    {"_id": "q5", "text": "A query nobody judged relevant."},
]
QRELS = [("q1", "d5", 2), ("q1", "d1", 1), ("q2", "d4", 1), ("q3", "d7", 1), ("q3", "d6", 0), ("q4", "d2", 2)]
QRELS += [("q5", "d6", 0)]  # q5 has no relevant document


def write_beir(folder: Path, corpus=CORPUS, queries=QUERIES, qrels=QRELS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in corpus))
    (folder / "queries.jsonl").write_text("".join(json.dumps(r) + "\n" for r in queries))
    (folder / "qrels").mkdir(exist_ok=True)
    rows = ["query-id\tcorpus-id\tscore", *(f"{q}\t{d}\t{s}" for q, d, s in qrels)]
    (folder / "qrels" / "test.tsv").write_text("\n".join(rows) + "\n")
    return folder


def test_read_beir(tmp_path: Path) -> None:
    beir = read_beir(write_beir(tmp_path))
    assert beir.corpus_ids == ["d1", "d2", "d3", "d4", "d5", "d6", "d7"]
    assert (
        beir.corpus[0] == "The Eiffel Tower stands in Paris."
        and beir.corpus[4] == "Paris Paris is the capital of France."
    )
    assert beir.query_ids == ["q1", "q2", "q3", "q4"]  # q5: judged, but no document is relevant to it
    assert beir.qrels == {"q1": {"d5": 2, "d1": 1}, "q2": {"d4": 1}, "q3": {"d7": 1}, "q4": {"d2": 2}}


def test_hugging_face_datasets_on_disk_read_as_the_files(tmp_path: Path) -> None:
    """The MTEB layout saved with save_to_disk (corpus/, queries/, a qrels/ DatasetDict by split) is the
    same set as the jsonl + tsv files."""
    require("data")
    import datasets

    hf = tmp_path / "hf"
    datasets.Dataset.from_list([{"title": "", **r} for r in CORPUS]).save_to_disk(str(hf / "corpus"))
    datasets.DatasetDict({"queries": datasets.Dataset.from_list(QUERIES)}).save_to_disk(str(hf / "queries"))
    rows = [{"query-id": q, "corpus-id": d, "score": s} for q, d, s in QRELS]
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(hf / "qrels"))
    assert read_beir(hf) == read_beir(write_beir(tmp_path / "files"))
    with pytest.raises(DataError, match="a DatasetDict without split 'dev'"):
        read_beir(hf, split="dev")


def test_metrics_equal_sentence_transformers(tmp_path: Path) -> None:
    require("hf")
    import sentence_transformers as st
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    beir = read_beir(write_beir(tmp_path))
    model = st.SentenceTransformer(str(bundled_minilm()), device="cpu")
    ks = {"mrr_at_k": [1, 10], "ndcg_at_k": [1, 3, 10], "map_at_k": [2, 100]}
    ks |= {"accuracy_at_k": [1, 3], "precision_recall_at_k": [1, 2, 10]}
    evaluator = InformationRetrievalEvaluator(
        queries=dict(zip(beir.query_ids, beir.queries)),
        corpus=dict(zip(beir.corpus_ids, beir.corpus)),
        relevant_docs={q: set(docs) for q, docs in beir.qrels.items()},
        corpus_chunk_size=4,
        write_csv=False,
        **ks,
    )
    theirs = evaluator(model)
    q = model.encode(beir.queries, normalize_embeddings=True, convert_to_tensor=True)
    c = model.encode(beir.corpus, normalize_embeddings=True, convert_to_tensor=True)
    scores, indices = top_k(q, c, k=100, chunk=4)
    assert indices[1, :2].tolist() == [2, 3] and scores[1, 0] == scores[1, 1]  # q2: d3 ties d4, d3 wins by id
    ours = ir_metrics(
        scores,
        indices,
        beir.query_ids,
        beir.corpus_ids,
        beir.qrels,
        ndcg_at=ks["ndcg_at_k"],
        mrr_at=ks["mrr_at_k"],
        map_at=ks["map_at_k"],
        recall_at=ks["precision_recall_at_k"],
        precision_at=ks["precision_recall_at_k"],
        accuracy_at=ks["accuracy_at_k"],
    )
    assert ours["mrr@1"] < 1.0 and ours["recall@1"] < 1.0  # the tie (and the ranking) matter
    assert len(ours) == len(theirs) == 15
    for name, value in ours.items():
        assert value == pytest.approx(theirs[f"cosine_{name}"], abs=1e-6), name


def test_graded_ndcg() -> None:
    scores, indices = torch.tensor([[0.9, 0.5, 0.1]]), torch.tensor([[0, 1, 2]])
    got = ir_metrics(scores, indices, ["q"], ["a", "b", "c"], {"q": {"b": 2, "a": 1}}, ndcg_at=(3,), graded=True)
    assert got["ndcg@3"] == pytest.approx((1 + 2 / math.log2(3)) / (2 + 1 / math.log2(3)))
    binary = ir_metrics(scores, indices, ["q"], ["a", "b", "c"], {"q": {"b": 2, "a": 1}}, ndcg_at=(3,))
    assert binary["ndcg@3"] == pytest.approx(1.0)


def test_graded_metrics_equal_pytrec_eval() -> None:
    """Graded nDCG@5/10 and recall@k of random rankings (no ties: trec_eval breaks them by id descending, the
    evaluator ascending) against pytrec_eval, what MTEB and ViDoRe compute them with; grades 0-3, score-0 rows
    judged non-relevant, a query without a relevant document left out of both."""
    import pytrec_eval

    g = torch.Generator().manual_seed(3)
    corpus_ids = [f"d{i:02d}" for i in range(40)]
    query_ids = [f"q{i}" for i in range(12)]
    judged = {
        q: {
            corpus_ids[j]: int(torch.randint(0, 4, (), generator=g))
            for j in torch.randperm(40, generator=g)[:6].tolist()
        }
        for q in query_ids
    }
    judged["q11"] = {corpus_ids[0]: 0}
    qrels = {q: {d: s for d, s in docs.items() if s > 0} for q, docs in judged.items()}
    scores = torch.rand(12, 40, generator=g, dtype=torch.float64)
    top_s, top_i = top_k(scores, torch.eye(40, dtype=torch.float64), 40)
    ours = ir_metrics(top_s, top_i, query_ids, corpus_ids, qrels, ndcg_at=(5, 10), recall_at=(1, 5, 10), graded=True)
    run = {q: {d: float(scores[i, j]) for j, d in enumerate(corpus_ids)} for i, q in enumerate(query_ids)}
    kept = {q: docs for q, docs in judged.items() if qrels[q]}
    evaluator = pytrec_eval.RelevanceEvaluator(kept, {"ndcg_cut.5,10", "recall.1,5,10"})
    per_query = evaluator.evaluate({q: run[q] for q in kept}).values()
    for ours_name, theirs_name in (("ndcg@5", "ndcg_cut_5"), ("ndcg@10", "ndcg_cut_10"), ("recall@5", "recall_5")):
        theirs = sum(m[theirs_name] for m in per_query) / len(kept)
        assert ours[ours_name] == pytest.approx(theirs, abs=1e-12), ours_name
    assert 0 < ours["ndcg@5"] < 1 and len(kept) == 11


@pytest.mark.parametrize("chunk", [1, 7, 13, 1000])
def test_top_k_equals_full_topk(chunk: int) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(9, 8, generator=g).round()  # small integers: exact products and many exact ties
    c = torch.randn(50, 8, generator=g).round()
    c[30], c[41] = c[5], c[5]
    scores, indices = top_k(q, c, k=12, chunk=chunk)
    full = q @ c.T
    # reference: the full product, sorted by (score descending, index ascending)
    order = full.argsort(dim=1, descending=True, stable=True)[:, :12]
    assert torch.equal(indices, order) and torch.equal(scores, full.gather(1, order))
    assert torch.equal(scores, torch.topk(full, 12, dim=1).values)
    assert (scores[:, 1:] == scores[:, :-1]).sum() > 10  # the ties are there
    assert top_k(q, c, k=99, chunk=chunk)[1].shape == (9, 50)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: (f / "queries.jsonl").unlink(), "queries.jsonl: not found"),
        (lambda f: (f / "corpus.jsonl").write_text('{"_id": "d1", "text": "x"}\n{oops\n'), "corpus.jsonl:2: not JSON"),
        (lambda f: (f / "corpus.jsonl").write_text('{"text": "x"}\n'), "no string `_id`"),
        (lambda f: (f / "corpus.jsonl").write_text('{"_id": "d1", "text": 3}\n'), "is not a string"),
        (lambda f: write_beir(f, qrels=[("q1", "d9", 1)]), "corpus-id 'd9' is not in the corpus"),
        (lambda f: write_beir(f, qrels=[("q9", "d1", 1)]), "query-id 'q9' is not in the queries"),
        (lambda f: write_beir(f, qrels=[("q1", "d1", "high")]), "score 'high' is not an integer"),
        (lambda f: (f / "qrels" / "test.tsv").write_text("q1\td1\t1\n"), "header"),
        (lambda f: (f / "qrels" / "test.tsv").unlink(), "test.tsv: not found"),
    ],
)
def test_data_errors(tmp_path: Path, damage, message: str) -> None:
    folder = write_beir(tmp_path)
    damage(folder)
    with pytest.raises(DataError, match=message) as info:
        read_beir(folder)
    assert "\n" not in str(info.value)
