"""Retrieval evaluation as embedding users measure it: a BEIR folder, sharded over the ranks.

Queries and corpus (texts, or page images: `beir_folder`) are each embedded once across all ranks (contiguous
shards, every rank the same number of batches, because an FSDP2 forward is a collective), all-gathered, then every
query is scored against the corpus in chunks (`retrieval_metrics.top_k`: never queries x corpus at once) and
`retrieval_metrics.ir_metrics` gives nDCG@5/10, MRR@10, MAP@100 and Recall@1/5/10/100 as sentence-transformers'
InformationRetrievalEvaluator computes them (nDCG graded, as pytrec_eval, on request). Used by the trainer
(`[eval] beir_path`) and by `python -m titan_contrastive.evaluate`.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from titan_contrastive.components.evaluate import dim_cuts, gather_rows
from titan_contrastive.components.precision import at_least_fp32
from titan_contrastive.components.quantized_search import quantized_top_k
from titan_contrastive.components.retrieval_metrics import ir_metrics, top_k
from titan_contrastive.components.token_pooling import document_pooler, token_counts
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.beir_folder import BeirSet, beir_splits, read_beir
from titan_contrastive.losses import matryoshka
from titan_contrastive.losses.maxsim import scores as late_scores

__all__ = [
    "BUNDLED",
    "check_corpus",
    "device_forward",
    "embed_texts",
    "evaluate_beir",
    "evaluate_sets",
    "load_beir",
    "pair_embedders",
    "side_embedders",
]

BUNDLED = Path(__file__).resolve().parents[1] / "assets" / "wordnet_beir"
K = 100  # the deepest cut the metrics read (MAP@100, Recall@100)
CUTS = {"ndcg_at": (5, 10), "recall_at": (1, 5, 10, 100)}
"""nDCG@5 is visual document retrieval's headline (ViDoRe), nDCG@10 text retrieval's (BEIR, MTEB)."""


def load_beir(path: str, split: str = "test") -> dict[str, BeirSet]:
    """`path`'s BEIR sets by split name ("bundled": the WordNet set in assets/wordnet_beir): `split` one name, several
    separated by commas, or `*` for every one (`beir_folder.beir_splits`); a DataError names the fix."""
    folder = BUNDLED if path == "bundled" else Path(path).expanduser()
    if not folder.is_dir():
        raise DataError(
            f"eval.beir_path={path!r} is not a folder; give a BEIR folder (corpus.jsonl, queries.jsonl, qrels/)"
        )
    return {name: read_beir(folder, name) for name in beir_splits(folder, split)}


def evaluate_sets(
    sets: dict[str, BeirSet], *embedders: Callable[..., torch.Tensor], **options: Any
) -> dict[str, float]:
    """`evaluate_beir` over each of `sets`: one set's keys are `beir/...`; several sets' are `beir/{name}/...` for
    each, and `beir/...` their mean (NanoBEIR's aggregate), at each cut too. Splits of one corpus (a BEIR folder's
    dev and test) embed it once. `options`: evaluate_beir's."""
    prefix = options.pop("prefix", "beir/")
    if len(sets) == 1:
        return evaluate_beir(next(iter(sets.values())), *embedders, prefix=prefix, **options)
    keys = {name: _corpus_key(beir) for name, beir in sets.items()}
    left = Counter(key for key in keys.values() if key is not None)  # sets still to score on each corpus
    embedded: dict[tuple, torch.Tensor] = {}
    each = {}
    for name, beir in sets.items():
        key = keys[name]
        cache = embedded if key is not None and (key in embedded or left[key] > 1) else None
        each[name] = evaluate_beir(beir, *embedders, prefix=f"{prefix}{name}/", corpus_cache=cache, **options)
        if key is not None:
            left[key] -= 1
            if not left[key]:
                embedded.pop(key, None)
    results = {key: value for metrics in each.values() for key, value in metrics.items()}
    first = next(iter(each))
    for key in each[first]:
        values = [each[name][key.replace(f"{prefix}{first}/", f"{prefix}{name}/", 1)] for name in each]
        results[key.replace(f"{prefix}{first}/", prefix, 1)] = sum(values) / len(values)
    return results


def _corpus_key(beir: BeirSet) -> tuple | None:
    """What makes two sets' corpora one: their ids, texts and image files (None where the images are a dataset's
    rows, which two sets may number alike)."""
    if beir.images is not None and beir.images.table is not None:
        return None
    files = () if beir.images is None else tuple(beir.images.refs)
    return tuple(beir.corpus_ids), tuple(beir.corpus), files


@torch.no_grad()
def embed_texts(
    embed: Callable[[list[Any]], torch.Tensor], texts: Sequence[Any], *, batch_size: int, rank: int, world_size: int
) -> torch.Tensor:
    """`embed(batch of texts)` (or of images) over this rank's contiguous shard, all rows gathered on every rank."""
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


def check_corpus(beir: BeirSet, pages: bool, key: str = "eval.beir_path") -> Sequence[Any]:
    """What a model that embeds pages (`pages`: images) or texts reads of `beir`'s corpus, or a DataError."""
    if pages and beir.images is None:
        raise DataError(
            f"{key}: a corpus of texts, and this run's documents are images; give a corpus of pages (an `image` per "
            "document) or train on text documents (data.retrieval_mode=t2t)"
        )
    if not pages and beir.images is not None and not any(beir.corpus):
        raise DataError(
            f"{key}: a corpus of page images without texts, and this model embeds texts; evaluate it with a model "
            "that reads images (model.name=qwen_vl, data.retrieval_mode=t2i)"
        )
    return beir.images if pages else beir.corpus  # type: ignore[return-value]


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
    graded: bool = False,
    pages: bool = False,
    pool_factor: float = 1.0,
    pool_protected: int = 1,
    corpus_cache: dict[tuple, torch.Tensor] | None = None,
    precisions: Sequence[str] = (),
) -> dict[str, float]:
    """The IR metrics of `beir` with these embedders, by the dot product of their embeddings (the towers' unit
    vectors: their cosine; SPLADE's: its score), and by the cosine of their first m dims for each m of `dims`
    (`evaluate.dim_cuts`; of each token's first m, for token sets); each text embedded once. `sparse` (SPLADE's
    embeddings): also the mean number of non-zero dimensions of a query's and of a document's
    (`query_active_dims`, `corpus_active_dims`, as sentence-transformers' SparseInformationRetrievalEvaluator reports
    them), what an inverted index pays.
    `token_dim` (ColBERT's token sets): scored by late interaction (`losses/late_interaction.py`) instead, and the
    mean number of tokens a document keeps reported (`corpus_tokens`, the index's vectors per document); `pool_factor`
    > 1: each document's tokens pooled first (`token_pooling`, its first `pool_protected` left out of the clustering).
    `pages`: `embed_docs` reads the corpus's images (`check_corpus`), else its texts. `graded`: nDCG with the
    qrels' grades as gains (pytrec_eval's, as MTEB and ViDoRe report it), else binary (sentence-transformers').
    `corpus_cache`: corpus embeddings by corpus (`evaluate_sets`' for splits of one corpus): read from it, or
    embedded and kept in it. `precisions` (`quantized_search.PRECISIONS`): also the metrics with the corpus held in
    each (keys `{precision}/...`, at each dims cut too), searched as sentence-transformers' quantization does."""
    if precisions and (token_dim or sparse):
        raise ValueError(f"precisions={list(precisions)}: quantized search is for one dense vector per text")
    common = {"batch_size": batch_size, "rank": rank, "world_size": world_size}
    if pool_factor != 1:
        if not token_dim:
            raise ValueError(f"pool_factor={pool_factor}: token pooling is for token sets (late interaction)")
        embed_docs = _pooled(
            embed_docs, document_pooler(token_dim, pool_factor, pool_protected, "eval.beir_pool_factor")
        )
    queries = embed_texts(embed_queries, beir.queries, **common)
    key = None if corpus_cache is None else _corpus_key(beir)
    corpus = None if key is None else corpus_cache.get(key)  # type: ignore[union-attr]
    if corpus is None:
        corpus = embed_texts(embed_docs, check_corpus(beir, pages), **common)
        if key is not None:
            corpus_cache[key] = corpus  # type: ignore[index]
    results = {}
    for m, cut in dim_cuts(token_dim or queries.shape[-1], dims):
        if token_dim:  # each token cut to its first m components, renormalized
            q, c = (matryoshka.prefix(x, m, token_dim) if cut else x for x in (queries, corpus))
            scores, indices = top_k(q, c, K, similarity=functools.partial(late_scores, dim=m))
        else:
            scores, indices = top_k(queries[:, :m], corpus[:, :m], K, normalize=bool(cut))
        metrics = ir_metrics(scores, indices, beir.query_ids, beir.corpus_ids, beir.qrels, **CUTS, graded=graded)
        results |= {f"{cut}{prefix}{name}": value for name, value in metrics.items()}
        for precision in precisions:
            scores, indices = quantized_top_k(queries[:, :m], corpus[:, :m], K, precision, normalize=bool(cut))
            metrics = ir_metrics(scores, indices, beir.query_ids, beir.corpus_ids, beir.qrels, **CUTS, graded=graded)
            results |= {f"{precision}/{cut}{prefix}{name}": value for name, value in metrics.items()}
    if token_dim:
        results[f"{prefix}corpus_tokens"] = token_counts(corpus, token_dim).double().mean().item()
    if sparse:
        for name, rows in (("query", queries), ("corpus", corpus)):
            results[f"{prefix}{name}_active_dims"] = torch.count_nonzero(rows, dim=1).double().mean().item()
    return results


def _pooled(embed: Callable[[list[Any]], torch.Tensor], pool: Callable[[torch.Tensor], torch.Tensor]):
    """`embed` with its rows pooled (`token_pooling.document_pooler`)."""
    return lambda docs: pool(at_least_fp32(embed(docs)))


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


def device_forward(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> Callable[..., Any]:
    """`model(**batch)` with the batch on `device`, its floating tensors in `dtype`: the forward of a model a command
    loaded itself (the trainer's own runs in its precision)."""

    def forward(batch: dict[str, torch.Tensor]) -> Any:
        return model(**{k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in batch.items()})

    return forward


def side_embedders(
    forward: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, ...]], process: Any
) -> tuple[Callable[[list[str]], torch.Tensor], Callable[[list[Any]], torch.Tensor]]:
    """(embed queries, embed documents) of a model whose batches a side processor fills (qwen_vl's
    `SideProcessor`: `sides(query images, query texts, document images, document texts)`, `kinds` of each
    side): queries are texts; documents texts or images (uint8 HWC), as the run's document side reads them.
    The other side gets one placeholder row (a blank image or one word), as `pair_embedders` does."""
    kinds = process.kinds
    if kinds["query"] != "text":
        raise DataError(
            f"eval.beir_path and eval.sts_path read text queries; data.retrieval_mode={process.mode} embeds "
            f"{kinds['query']} queries (t2i and t2t read text queries)"
        )
    if kinds["doc"] == "multi":
        raise DataError(
            f"eval.beir_path and eval.sts_path read documents of one kind, texts or pages; data.retrieval_mode="
            f"{process.mode} embeds an image and a text per document: evaluate on data.val_path"
        )
    blank = [np.full((64, 64, 3), 255, dtype=np.uint8)]

    def batch(texts: list[str] | None, docs: list[Any] | None) -> dict[str, torch.Tensor]:
        texts, image_docs = texts or ["query"], kinds["doc"] == "image"
        docs = docs or (blank if image_docs else ["document"])
        return process.sides(None, texts, docs if image_docs else None, None if image_docs else docs)

    return (lambda texts: forward(batch(texts, None))[0]), (lambda docs: forward(batch(None, docs))[1])
