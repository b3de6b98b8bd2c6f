"""Retrieval evaluation as embedding users measure it: a BEIR folder, top-k search, IR metrics.

People compare text embedders by nDCG@10, MRR@10, MAP@100 and recall@k on BEIR-format sets,
mostly through sentence-transformers' `InformationRetrievalEvaluator`. `read_beir` reads such a
folder, `top_k` ranks the corpus for every query chunk by chunk (never a queries x corpus
matrix), and `ir_metrics` scores the rankings with that evaluator's definitions, so the
figures are comparable with the ones users report:

- relevance is binary: a qrels row with a score above 0 is relevant and its grade is not used
  (the evaluator takes a set of relevant ids); `graded=True` gives nDCG with the grade as the
  gain instead, as pytrec_eval does for BEIR's own tables;
- queries without a relevant document are read but left out of every average;
- equal scores rank by ascending corpus id. `read_beir` orders the corpus by id, so `top_k`'s
  rule (lower corpus index first) is the same order.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titan_contrastive.datasets.base import DataError

QRELS_HEADER = ["query-id", "corpus-id", "score"]


@dataclass(frozen=True)
class BeirSet:
    """One split of a BEIR folder. `qrels[query_id][doc_id]` is a grade > 0 (score-0 rows are dropped)."""

    query_ids: list[str]
    queries: list[str]
    corpus_ids: list[str]  # ascending, the evaluator's tie order
    corpus: list[str]  # title + " " + text, stripped (BEIR's and sentence-transformers' convention)
    qrels: dict[str, dict[str, int]]


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, row) of a BEIR jsonl file."""
    if not path.is_file():
        raise DataError(f"{path}: not found; a BEIR folder holds corpus.jsonl, queries.jsonl and qrels/<split>.tsv")
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{n}", json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not JSON ({e.msg}); write one JSON object per line") from None


def _hf_rows(path: Path, split: str | None = None) -> Iterator[tuple[str, Any]]:
    """(where, row) of a `save_to_disk` folder: a Dataset, or a DatasetDict's `split` (None: its only split)."""
    from titan_contrastive.datasets.hf_disk import import_datasets

    datasets = import_datasets(f"eval.beir_path (a Hugging Face dataset folder: {path})")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - datasets raises many types for an unreadable folder
        raise DataError(f"{path}: not a readable save_to_disk folder ({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.DatasetDict):
        name = split if split in ds else next(iter(ds)) if split is None and len(ds) == 1 else None
        if name is None:
            raise DataError(f"{path}: a DatasetDict without split {split!r} (splits: {', '.join(ds)}); save it")
        ds = ds[name]
    for n, row in enumerate(ds):
        yield f"{path}[{n}]", row


def _texts(rows: Iterable[tuple[str, Any]], what: str) -> dict[str, str]:
    """`_id` -> text of BEIR rows; `title` (optional) goes before the text."""
    texts: dict[str, str] = {}
    for where, row in rows:
        if not isinstance(row, dict) or not isinstance(row.get("_id"), (str, int)):
            raise DataError(f"{where}: no string `_id` in {str(row)[:80]!r}; give every {what} an `_id`")
        text, title = row.get("text"), row.get("title") or ""
        if not isinstance(text, str) or not isinstance(title, str):
            raise DataError(f"{where}: `text`/`title` of {row['_id']!r} is not a string; write them as strings")
        key = str(row["_id"])
        if key in texts:
            raise DataError(f"{where}: `_id` {key!r} appears twice; give every {what} its own `_id`")
        texts[key] = (title + " " + text).strip()
    return texts


def read_corpus(path: str | Path) -> dict[str, str]:
    """`_id` -> text of a BEIR `corpus.jsonl` (title before text), as `read_beir` reads it."""
    return _texts(_jsonl_rows(Path(path)), "document")


def _tsv_rows(path: Path) -> Iterator[tuple[str, Any]]:
    if not path.is_file():
        raise DataError(f"{path}: not found; write qrels/{path.stem}.tsv (`query-id corpus-id score`, tab-separated)")
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines or lines[0].split("\t") != QRELS_HEADER:
        head = lines[0] if lines else ""
        raise DataError(f"{path}:1: header {head!r}; start the file with the line query-id<TAB>corpus-id<TAB>score")
    for n, line in enumerate(lines[1:], 2):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != 3:
            raise DataError(
                f"{path}:{n}: {line!r} has {len(fields)} fields; write query-id, corpus-id, score with tabs"
            )
        yield f"{path}:{n}", dict(zip(QRELS_HEADER, fields))


def read_beir(folder: str | Path, split: str = "test") -> BeirSet:
    """Read a local BEIR folder: `corpus.jsonl`, `queries.jsonl` and `qrels/{split}.tsv`, or the same
    as Hugging Face datasets saved to disk (`corpus/`, `queries/`, `qrels/` save_to_disk folders, the
    layout of the MTEB sets on the hub: columns `_id`, `title`, `text`; `query-id`, `corpus-id`, `score`)."""
    folder = Path(folder)
    if (folder / "corpus.jsonl").exists() or not (folder / "corpus").is_dir():
        corpus = read_corpus(folder / "corpus.jsonl")
        queries = _texts(_jsonl_rows(folder / "queries.jsonl"), "query")
        judgements = _tsv_rows(folder / "qrels" / f"{split}.tsv")
    else:
        corpus = _texts(_hf_rows(folder / "corpus"), "document")
        queries = _texts(_hf_rows(folder / "queries"), "query")
        judgements = _hf_rows(folder / "qrels", split)
    qrels: dict[str, dict[str, int]] = {}
    for where, row in judgements:
        qid, did, score = (str(row.get(k, "")) for k in QRELS_HEADER)
        try:
            grade = int(score)
        except ValueError:
            raise DataError(
                f"{where}: score {score!r} is not an integer; write graded relevance as 0, 1, 2..."
            ) from None
        if qid not in queries:
            raise DataError(f"{where}: query-id {qid!r} is not in the queries; add the query or drop the row")
        if did not in corpus:
            raise DataError(f"{where}: corpus-id {did!r} is not in the corpus; add the document or drop the row")
        if grade > 0:
            qrels.setdefault(qid, {})[did] = grade
    corpus_ids = sorted(corpus)
    return BeirSet(list(queries), list(queries.values()), corpus_ids, [corpus[c] for c in corpus_ids], qrels)


def _select(scores: torch.Tensor, indices: torch.Tensor, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best candidates of each row by (score descending, index ascending), in that order."""
    threshold = scores.topk(k, dim=1).values[:, -1:]
    # every score above the k-th comes first, then the ties at the k-th with the lowest indices
    key = torch.where(scores > threshold, indices, torch.where(scores == threshold, indices + n, 2 * n))
    pick = key.topk(k, dim=1, largest=False).indices
    s, i = scores.gather(1, pick), indices.gather(1, pick)
    by_index = i.argsort(dim=1, stable=True)
    s, i = s.gather(1, by_index), i.gather(1, by_index)
    by_score = s.argsort(dim=1, descending=True, stable=True)
    return s.gather(1, by_score), i.gather(1, by_score)


def top_k(
    query_emb: torch.Tensor,
    corpus_emb: torch.Tensor,
    k: int,
    chunk: int = 50_000,
    normalize: bool = False,
    similarity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores and corpus indices [Q, min(k, N)] of each query's best documents by dot product
    (cosine with `normalize=True` or normalized embeddings; `similarity`'s scores where given: late interaction's),
    best first, ties to the lower index.

    The corpus is scored `chunk` rows at a time and merged into a running top-k, so memory is
    Q x (k + chunk) whatever the corpus size. Equal embeddings tie exactly only when the matrix
    products give them equal scores, which a BLAS need not do across chunks of different shapes."""
    if k < 1 or chunk < 1:
        raise ValueError(f"top_k needs k >= 1 and chunk >= 1, got k={k}, chunk={chunk}")
    q, c = query_emb.float(), corpus_emb.float()
    if normalize:
        q, c = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(c, dim=-1)
    n = c.shape[0]
    k = min(k, n)
    best_s = q.new_empty((q.shape[0], 0))
    best_i = torch.empty((q.shape[0], 0), dtype=torch.long, device=q.device)
    for start in range(0, n, chunk):
        s = q @ c[start : start + chunk].T if similarity is None else similarity(q, c[start : start + chunk])
        i = torch.arange(start, start + s.shape[1], device=q.device).expand_as(s)
        cand_s, cand_i = torch.cat([best_s, s], dim=1), torch.cat([best_i, i], dim=1)
        best_s, best_i = _select(cand_s, cand_i, min(k, cand_s.shape[1]), n)
    return best_s, best_i


def _dcg(gains: Sequence[float]) -> float:
    return sum(g / math.log2(r + 2) for r, g in enumerate(gains))


def ir_metrics(
    top_scores: torch.Tensor,
    top_indices: torch.Tensor,
    query_ids: Sequence[str],
    corpus_ids: Sequence[str],
    qrels: dict[str, dict[str, int]],
    ndcg_at: Sequence[int] = (10,),
    mrr_at: Sequence[int] = (10,),
    map_at: Sequence[int] = (100,),
    recall_at: Sequence[int] = (1, 10, 100),
    precision_at: Sequence[int] = (),
    accuracy_at: Sequence[int] = (),
    graded: bool = False,
) -> dict[str, float]:
    """`ndcg@k`, `mrr@k`, `map@k`, `recall@k`, `precision@k`, `accuracy@k` averaged over the
    queries with a relevant document, as sentence-transformers' InformationRetrievalEvaluator
    computes them from `top_k`'s output (row r is query `query_ids[r]`)."""
    ks = [*ndcg_at, *mrr_at, *map_at, *recall_at, *precision_at, *accuracy_at]
    need = min(max(ks, default=0), len(corpus_ids))
    if top_indices.shape[1] < need:
        raise ValueError(f"ir_metrics needs {need} hits per query, top_k gave {top_indices.shape[1]}; raise its k")
    sums: dict[str, float] = {}
    count = 0
    for scores, indices, qid in zip(top_scores.tolist(), top_indices.tolist(), query_ids):
        relevant = {d: g for d, g in qrels.get(qid, {}).items() if g > 0}
        if not relevant:
            continue
        count += 1
        hits = sorted(((s, corpus_ids[i]) for s, i in zip(scores, indices)), key=lambda h: (-h[0], h[1]))
        ranked = [d for _, d in hits]
        values: dict[str, float] = {}
        for k in accuracy_at:
            values[f"accuracy@{k}"] = float(any(d in relevant for d in ranked[:k]))
        for k in precision_at:
            values[f"precision@{k}"] = sum(d in relevant for d in ranked[:k]) / k
        for k in recall_at:
            values[f"recall@{k}"] = sum(d in relevant for d in ranked[:k]) / len(relevant)
        for k in mrr_at:
            values[f"mrr@{k}"] = next((1 / (r + 1) for r, d in enumerate(ranked[:k]) if d in relevant), 0.0)
        for k in ndcg_at:
            gains = [relevant.get(d, 0) if graded else float(d in relevant) for d in ranked[:k]]
            ideal = sorted(relevant.values(), reverse=True) if graded else [1] * len(relevant)
            values[f"ndcg@{k}"] = _dcg(gains) / _dcg(ideal[:k])
        for k in map_at:
            found, total = 0, 0.0
            for r, d in enumerate(ranked[:k]):
                if d in relevant:
                    found += 1
                    total += found / (r + 1)
            values[f"map@{k}"] = total / min(k, len(relevant))
        for name, v in values.items():
            sums[name] = sums.get(name, 0.0) + v
    if count == 0:
        raise DataError("qrels: no query in query_ids has a document with a score above 0; check the qrels split")
    return {name: total / count for name, total in sums.items()}
