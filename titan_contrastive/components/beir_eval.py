"""Retrieval evaluation as embedding users measure it: a BEIR folder, sharded over the ranks.

Queries and corpus are each embedded once across all ranks (contiguous shards, every rank the
same number of batches, because an FSDP2 forward is a collective), all-gathered, then every query
is scored against the corpus in chunks (`retrieval_metrics.top_k`: never queries x corpus at
once) and `retrieval_metrics.ir_metrics` gives nDCG@10, MRR@10, MAP@100 and Recall@1/10/100 as
sentence-transformers' InformationRetrievalEvaluator computes them. Used by the trainer
(`[eval] beir_path`) and by `python -m titan_contrastive.evaluate`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from titan_contrastive.components.evaluate import dim_cuts, gather_rows
from titan_contrastive.components.precision import at_least_fp32
from titan_contrastive.components.retrieval_metrics import BeirSet, ir_metrics, read_beir, top_k
from titan_contrastive.datasets.base import DataError
from titan_contrastive.losses import matryoshka
from titan_contrastive.losses.late_interaction import scores as late_scores

__all__ = ["BUNDLED", "embed_texts", "evaluate_beir", "load_beir"]

BUNDLED = Path(__file__).resolve().parents[1] / "assets" / "wordnet_beir"
K = 100  # the deepest cut the metrics read (MAP@100, Recall@100)


def load_beir(path: str, split: str = "test") -> BeirSet:
    """`path`'s BEIR split ("bundled": the WordNet set in assets/wordnet_beir); a DataError names the fix."""
    folder = BUNDLED if path == "bundled" else Path(path).expanduser()
    if not folder.is_dir():
        raise DataError(
            f"eval.beir_path={path!r} is not a folder; give a BEIR folder (corpus.jsonl, queries.jsonl, qrels/)"
        )
    return read_beir(folder, split)


@torch.no_grad()
def embed_texts(
    embed: Callable[[list[str]], torch.Tensor], texts: list[str], *, batch_size: int, rank: int, world_size: int
) -> torch.Tensor:
    """`embed(batch of texts)` over this rank's contiguous shard, all rows gathered on every rank."""
    shards = np.array_split(np.arange(len(texts)), world_size)
    mine, rows = shards[rank], []
    for start in range(0, max(len(s) for s in shards), batch_size):
        part = mine[start : start + batch_size].tolist()
        out = at_least_fp32(embed([texts[i] for i in (part or [0])]))
        if part:
            rows.append(out)
    width = out.shape[-1]
    local = torch.cat(rows) if rows else out.new_zeros((0, width))
    return gather_rows(local, [len(s) for s in shards])


@torch.profiler.record_function("evaluate_beir")  # a named span in [profiling] traces
def evaluate_beir(
    beir: BeirSet,
    embed_queries: Callable[[list[str]], torch.Tensor],
    embed_docs: Callable[[list[str]], torch.Tensor],
    *,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    prefix: str = "beir/",
    dims: Sequence[int] = (),
    sparse: bool = False,
    token_dim: int = 0,
) -> dict[str, float]:
    """The IR metrics of `beir` with these embedders, by the dot product of their embeddings (the towers' unit
    vectors: their cosine; SPLADE's: its score), and by the cosine of their first m dims for each m of `dims`
    (`evaluate.dim_cuts`; of each token's first m, for token sets); each text embedded once. `sparse` (SPLADE's
    embeddings): also the mean number of non-zero dimensions of a query's and of a document's
    (`query_active_dims`, `corpus_active_dims`, as sentence-transformers' SparseInformationRetrievalEvaluator reports
    them), what an inverted index pays.
    `token_dim` (ColBERT's token sets): scored by late interaction (`losses/late_interaction.py`) instead."""
    common = {"batch_size": batch_size, "rank": rank, "world_size": world_size}
    queries = embed_texts(embed_queries, beir.queries, **common)
    corpus = embed_texts(embed_docs, beir.corpus, **common)
    results = {}
    for m, cut in dim_cuts(token_dim or queries.shape[-1], dims):
        if token_dim:  # each token cut to its first m components, renormalized
            q, c = (matryoshka.prefix(x, m, token_dim) if cut else x for x in (queries, corpus))
            scores, indices = top_k(q, c, K, similarity=functools.partial(late_scores, dim=m))
        else:
            scores, indices = top_k(queries[:, :m], corpus[:, :m], K, normalize=bool(cut))
        metrics = ir_metrics(scores, indices, beir.query_ids, beir.corpus_ids, beir.qrels)
        results |= {f"{cut}{prefix}{name}": value for name, value in metrics.items()}
    if sparse:
        for name, rows in (("query", queries), ("corpus", corpus)):
            results[f"{prefix}{name}_active_dims"] = torch.count_nonzero(rows, dim=1).double().mean().item()
    return results


def pair_embedders(
    forward: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, ...]], tokenizer: object, query_length: int
) -> tuple[Callable[[list[str]], torch.Tensor], Callable[[list[str]], torch.Tensor]]:
    """(embed queries, embed documents) of a text-pair model whose `forward({"query", "doc"})` returns
    (query embeddings, document embeddings, ...), tokenized by its `PairTokenizer` (prompts and lengths
    included). The other tower gets one row: the root forward runs (FSDP2 unshards there), cheaply."""
    if not (hasattr(tokenizer, "encode_queries") and hasattr(tokenizer, "encode_docs")):
        raise DataError(
            "eval.beir_path and eval.sts_path need a text-to-text model family (bi_encoder) and its text-pair data"
        )

    def queries(texts: list[str]) -> torch.Tensor:
        ids = tokenizer.encode_queries(texts, query_length)  # type: ignore[attr-defined]
        return forward({"query": ids, "doc": tokenizer.encode_docs(texts[:1])})[0]  # type: ignore[attr-defined]

    def docs(texts: list[str]) -> torch.Tensor:
        ids = tokenizer.encode_docs(texts)  # type: ignore[attr-defined]
        return forward({"query": tokenizer.encode_queries(texts[:1], query_length), "doc": ids})[1]  # type: ignore[attr-defined]

    return queries, docs
