"""The user's text pairs for the bi_encoder family, served as batches: `(query, positive[, negative, ...])`
rows read by `pair_rows` (files, columns, scores, bad rows), tokenized at load.

Several files join with `::` (`mixing.SourceMix`, weighted by `data.upsampling_factors`): they must
agree on the number of negatives per row (unless data.hard_negatives is false, or they are drawn:
data.negatives_per_row) and on having ids. Each may have its own prompts (`data.query_prompts`,
`data.doc_prompts`: a task's instruction), which replace the tokenizer's (the model's) for that file's
queries, or documents and negatives.

Served documents: each row's positive and hard negatives, served as `doc` [B, doc_length] and `neg`
[B, k, doc_length] unless data.hard_negatives is false: every step kind adds them to the contrastive
problem as extra columns (`batching.with_negatives`, `losses`), and the start log says how many are
served. With `data.negatives_per_row = k` a row holds a list of positives and any number of negatives,
and each epoch serves one positive and k negatives of them, by the seed, the row and the epoch
(`pools.Pools`, tevatron's and FlagEmbedding's training groups).

Ids: with an id column, every positive's document id is a hash of its id string, and a hard
negative's is the id of a positive with exactly its text, else a hash of its text (another
namespace); they are served as `doc_id` (`batching.DOC_IDS`) [B] or [B, 1 + k], and the duplicate
mask (loss.mask_duplicates) then compares documents as the data names them, not by token ids.
blake2b rather than Python's `hash`: the same ids in every process, run and worker.

Teacher scores (loss.distill) are served as `teacher_scores` (`batching.TEACHER_SCORES`) float32
[B, 1 + k], the served documents' own. A frozen model's embeddings of the texts, from a file of their own
(loss.teacher_embeddings or guide_embeddings), are served beside them (`datasets/frozen.py`).

Every text is tokenized at load, as for WordNet, each distinct one once (its prompt before it) and kept unpadded
(`token_table.TokenTable`): a batch is then a gather padded as the tokenizer pads, and a corpus passage that is the
hard negative of many queries is held once. The ranks of a run share that work: each tokenizes a share of the
texts and sends the others its ids.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from itertools import chain, repeat

import torch
import torch.distributed as dist

from titan_contrastive.batching import DOC_IDS, FROZEN_DOCS, FROZEN_QUERIES, NEGATIVES, OWN_GROUP, TEACHER_SCORES
from titan_contrastive.datasets.bad_samples import too_many_bad
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.corpus import resolve_documents
from titan_contrastive.datasets.frozen import EmbeddingTable
from titan_contrastive.datasets.mixing import SourceMix, check_per_source, in_batch_per_source, joins, split_sources
from titan_contrastive.datasets.pair_rows import PairRows, join_sources, kept_rows, read_rows
from titan_contrastive.datasets.pools import Pools
from titan_contrastive.datasets.token_table import TokenTable
from titan_contrastive.datasets.tokenizer import PairTokenizer

logger = logging.getLogger("titan_contrastive")


def source_tokenizers(
    tokenizer: PairTokenizer, parts: Sequence[str], query_prompts: Sequence[str], doc_prompts: Sequence[str]
) -> list[PairTokenizer]:
    """`tokenizer` with each source's prompts (`data.query_prompts`, `data.doc_prompts`: one per part, or
    empty for the tokenizer's own), or a DataError when a list does not hold one per part."""
    check_per_source("query_prompts", query_prompts, parts, empty="none")
    check_per_source("doc_prompts", doc_prompts, parts, empty="none")
    tokenizers = [
        dataclasses.replace(
            tokenizer,
            query_prompt=query_prompts[i] if query_prompts else tokenizer.query_prompt,
            doc_prompt=doc_prompts[i] if doc_prompts else tokenizer.doc_prompt,
        )
        for i in range(len(parts))
    ]
    if query_prompts or doc_prompts:
        for part, t in zip(parts, tokenizers):
            logger.info(f"pairs: {part}: query prompt {t.query_prompt!r}, document prompt {t.doc_prompt!r}")
    return tokenizers


def _row_tokenizers(spans: Sequence[tuple[int, PairTokenizer]]) -> Iterator[PairTokenizer]:
    """Each row's source's tokenizer, in order (`spans`: how many rows, which tokenizer)."""
    return chain.from_iterable(repeat(tokenizer, n) for n, tokenizer in spans)


def _query_texts(
    spans: Sequence[tuple[int, PairTokenizer]], rows: Sequence[Sequence[str]], prompts: Sequence[str] | None
) -> Iterator[str]:
    """Each row's query as its source's tokenizer reads it: after the row's own instruction (`prompts`,
    FlagEmbedding's `prompt`) where it has one, else the source's query prompt."""
    own = prompts or repeat("")
    return ((p or t.query_prompt) + row[0] for row, p, t in zip(rows, own, _row_tokenizers(spans)))


def _document_texts(spans: Sequence[tuple[int, PairTokenizer]], served: Sequence[Sequence[str]]) -> Iterator[str]:
    """The served documents, flat row by row, each after its source's document prompt."""
    return (t.doc_prompt + d for docs, t in zip(served, _row_tokenizers(spans)) for d in docs)


def _hash63(namespace: str, text: str) -> int:
    """A stable 63-bit hash of a string in a namespace (the same in every process and run)."""
    digest = hashlib.blake2b(f"{namespace}\0{text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def document_ids(documents: Sequence[Sequence[str]], ids: Sequence[str]) -> torch.Tensor:
    """int64, flat over the rows' `documents` (each row's positive, then its negatives): the positive's id, and
    a negative's (a positive's id for a negative with exactly its text, the first such row's; else a hash of
    the text)."""
    positive = [_hash63("id", i) for i in ids]
    by_text: dict[str, int] = {}
    for docs, pid in zip(documents, positive):
        by_text.setdefault(docs[0], pid)
    flat = [
        i
        for docs, pid in zip(documents, positive)
        for i in [pid] + [by_text[t] if t in by_text else _hash63("text", t) for t in docs[1:]]
    ]
    return torch.tensor(flat, dtype=torch.int64)


def _drawable(rows: PairRows, source: str, max_bad_fraction: float) -> PairRows:
    """A pooled file's rows that hold a negative to draw from; the others skipped and counted (`no_negatives`), a
    DataError past `max_bad_fraction` of the file or when none is left."""
    keep = [i for i, (texts, p) in enumerate(zip(rows.texts, rows.positives or [])) if len(texts) > 1 + p]
    bare = len(rows.texts) - len(keep)
    if not bare:
        return rows
    skipped = rows.skipped + Counter(no_negatives=bare)
    total = len(rows.texts) + sum(rows.skipped.values())
    if not keep or too_many_bad(skipped, total, max_bad_fraction):
        raise DataError(
            f"{source}: {bare} of its {len(rows.texts)} rows hold no hard negative to draw from "
            f"(data.negatives_per_row; bad rows {dict(skipped)} exceed data.max_bad_fraction={max_bad_fraction}); "
            "give each row a negative, or raise data.max_bad_fraction"
        )
    logger.warning(f"{source}: {bare} row(s) hold no hard negative to draw from (data.negatives_per_row); skipped")
    return kept_rows(rows, keep, skipped)


class PairsDataset:
    """Rows tokenized at load: batches {query, doc, index[, neg][, doc_id]} (see the module docstring).
    Built from a file (the constructor) or from rows in memory (`from_rows`, e.g. WordNet)."""

    def __init__(
        self,
        *,
        split: str,
        path: str,
        tokenizer: PairTokenizer,
        query_length: int,
        columns: Sequence[str] = (),
        id_column: str = "id",
        max_bad_fraction: float = 0.001,
        hard_negatives: bool = True,
        negatives_per_row: int = 0,
        corpus: str = "",
        seed: int = 0,
        factors: Sequence[float] = (),
        teacher: str = "",
        query_prompts: Sequence[str] = (),
        doc_prompts: Sequence[str] = (),
        in_batch_negatives: Sequence[bool] = (),
        frozen: EmbeddingTable | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """`negatives_per_row`: k > 0 draws each row's positive and k negatives per epoch from its lists, by
        `seed` (module docstring); 0 serves the rows as they are. `corpus`: the file of the documents that the rows
        name by id (`corpus.resolve_documents`); "": the rows hold the texts. `in_batch_negatives`: one per source,
        false flags its queries to be scored against their own documents only (`batching.OWN_GROUP`). `group`: the
        ranks that each build this same set, sharing its tokenization (`token_table.TokenTable`); None: alone."""
        parts, factors = split_sources(path, factors)
        tokenizers = source_tokenizers(tokenizer, parts, query_prompts, doc_prompts)
        pooled = negatives_per_row > 0
        seen: dict[str, str] = {}  # each distinct text held once, across the sources too
        files = [
            read_rows(part, columns, id_column, max_bad_fraction, split, teacher, pooled, seen, bool(corpus))
            for part in parts
        ]
        if corpus:
            files = resolve_documents(files, parts, corpus, seen, max_bad_fraction)
        if pooled and split == "train":
            files = [_drawable(f, part, max_bad_fraction) for f, part in zip(files, parts)]
        rows = join_sources(parts, files, hard_negatives)
        if rows.scores is not None and teacher == "cosent" and not hard_negatives:  # the positives' scores alone
            rows = rows._replace(scores=[row[:1] for row in rows.scores])
        spans = [(len(f.texts), t) for f, t in zip(files, tokenizers)]
        self._setup(rows, "pairs", split, path, tokenizer, query_length, hard_negatives, spans, teacher, frozen, group)
        if pooled and split == "train":
            self._draw(rows, negatives_per_row, seed)
        elif pooled:  # evaluation: each row's first positive
            self._draw(rows, 0, None)
        if joins(factors):
            self._mix = SourceMix([len(f.texts) for f in files], factors)
            self.source_sizes = self._mix.sizes
        flags = in_batch_per_source(in_batch_negatives, parts)
        if not all(flags):
            self._own_only(parts, flags, [len(f.texts) for f in files])

    def _own_only(self, parts: Sequence[str], flags: Sequence[bool], lengths: Sequence[int]) -> None:
        """Serve `OWN_GROUP` for the rows of the sources whose `flags` (data.in_batch_negatives) are false."""
        if not self.num_negatives:
            raise DataError(
                f"data.in_batch_negatives={list(flags)}: a query without in-batch negatives is scored against its own "
                f"hard negatives, and {self.source} serves none (its rows hold no negative column, or "
                "data.negatives_per_row is 0 with lists): give those rows hard negatives"
            )
        self._own = torch.cat([torch.full((n,), not flag) for n, flag in zip(lengths, flags)])
        for part, flag in zip(parts, flags):
            if not flag:
                logger.info(f"{self.name}: {part}: each query against its own positive and hard negatives only")

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[Sequence[str]],
        *,
        name: str,
        split: str,
        source: str,
        tokenizer: PairTokenizer,
        query_length: int,
        ids: Sequence[str] | None = None,
        hard_negatives: bool = True,
        frozen: EmbeddingTable | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> PairsDataset:
        """A dataset of rows (query, positive, negatives...), all of one width; `ids`: the positives' ids; `group`:
        the ranks sharing the tokenization (`__init__`)."""
        if not rows or len({len(r) for r in rows}) != 1 or len(rows[0]) < 2:
            raise DataError(f"{source}: rows must all hold a query, a positive and the same number of negatives")
        if ids is not None and len(ids) != len(rows):
            raise DataError(f"{source}: {len(ids)} ids for {len(rows)} rows; give one id per row")
        self = cls.__new__(cls)
        texts = PairRows([list(r) for r in rows], None if ids is None else list(ids), None, Counter())
        self._setup(texts, name, split, source, tokenizer, query_length, hard_negatives, frozen=frozen, group=group)
        return self

    def _setup(
        self,
        rows: PairRows,
        name: str,
        split: str,
        source: str,
        tokenizer: PairTokenizer,
        query_length: int,
        hard_negatives: bool,
        spans: Sequence[tuple[int, PairTokenizer]] = (),
        teacher: str = "",
        frozen: EmbeddingTable | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """`spans`: (rows, their tokenizer) per source in order; empty = every row through `tokenizer`;
        `teacher`: the loss.distill kind that reads the rows' scores; `frozen`: a frozen model's embeddings of
        the rows' texts (`datasets/frozen.py`); `group`: the ranks sharing the tokenization."""
        self.name, self.split, self.source, self.full = name, split, source, True
        self.skipped = rows.skipped
        self._mix: SourceMix | None = None
        self.source_sizes: list[int] | None = None
        """Samples per epoch of each `::`-joined file (`mixing.SourceMix`); None: one file, each row once."""
        self.epoch = 0
        self.image_shape = None
        self.class_names = None
        self.recall_ks = (1, 10)
        self.recall_direction = "query_to_doc"
        self.tokenizer = tokenizer
        self.own_prompts = sum(map(bool, rows.prompts or ()))
        """Rows whose query has its own prompt (FlagEmbedding's `prompt`), in place of the model's."""
        texts, pooled = rows.texts, rows.positives is not None
        in_file = len(texts[0]) - 2
        k = self.num_negatives = in_file if hard_negatives and not pooled else 0  # `neg` [B, k, L]; 0: none
        served = [row[1:] if pooled else row[1 : 2 + k] for row in texts]  # the documents kept, flat row by row
        spans = spans or [(len(texts), tokenizer)]
        self._queries = TokenTable(tokenizer, _query_texts(spans, texts, rows.prompts), query_length, group)
        self._documents = TokenTable(tokenizer, _document_texts(spans, served), tokenizer.doc_length, group)
        self._pools = Pools([1] * len(texts), [k] * len(texts), k, None)  # rows served whole; `_draw` for pools
        self._ids = None if rows.ids is None else document_ids(served, rows.ids)
        if rows.scores is not None and not k and not pooled and teacher != "cosent":  # CoSENT: scored pairs
            raise DataError(
                f"{source}: loss.distill compares each query's positive with its hard negatives, and the rows hold "
                "none; give rows with hard negatives (and their scores), or leave loss.distill empty"
            )
        scores = None if rows.scores is None else [s for row, d in zip(rows.scores, served) for s in row[: len(d)]]
        self._teacher = None if scores is None else torch.tensor(scores, dtype=torch.float32)
        if split == "train" and in_file and not pooled:
            logger.info(
                f"{name}: {k} hard negative(s) per row served from {source}: each query's problem has the batch's "
                f"positives and {k} hard negatives per query as columns"
                if k
                else f"{name}: data.hard_negatives=false: the {in_file} hard negative(s) per row in {source} are not "
                "served; each query's problem has the batch's positives only"
            )
        self._frozen: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._own: torch.Tensor | None = None
        """bool [rows]: the rows whose query sees its own documents only (`_own_only`); None: every query all."""
        if frozen is not None:
            self._carry(frozen, [[row[0]] + docs for row, docs in zip(texts, served)])
        if self._teacher is not None:
            logger.info(f"{name}: the teacher's scores of each served document from {source} (loss.distill)")
        if split == "train" and rows.ids is not None:
            logger.info(f"{name}: document ids from the id column of {source} (loss.mask_duplicates compares them)")

    def _draw(self, rows: PairRows, k: int, seed: int | None) -> None:
        """Serve one positive and `k` negatives of each row per epoch, drawn by `seed` (`pools.Pools`); `k` = 0
        (evaluation): the first positive alone."""
        positives = rows.positives or []
        negatives = [len(t) - 1 - p for t, p in zip(rows.texts, positives)]
        self._pools, self.num_negatives = Pools(positives, negatives, k, seed), k
        if k:
            fewer = sum(n < k for n in negatives)
            logger.info(
                f"{self.name}: {k} of each row's hard negatives (it holds {min(negatives)} to {max(negatives)}) and "
                f"one of its positives ({min(positives)} to {max(positives)}) served per epoch from {self.source}"
                + (f"; {fewer} row(s) hold fewer than {k} and serve some twice" if fewer else "")
            )

    def _carry(self, frozen: EmbeddingTable, texts: Sequence[Sequence[str]]) -> None:
        """Serve `frozen`'s embeddings of each row's query and served documents (`texts`: per row, the query then
        the documents in the flat order)."""
        queries, documents = frozen.find([t[0] for t in texts], [d for t in texts for d in t[1:]])
        self._frozen = (frozen.vectors, queries, documents)
        logger.info(f"{self.name}: a frozen model's {frozen.dim}-wide embeddings of every text from {frozen.source}")

    def __len__(self) -> int:
        return len(self._queries) if self._mix is None else len(self._mix)

    def set_epoch(self, epoch: int) -> None:
        """Joined files' windows and the documents drawn from pools (data.negatives_per_row) move per epoch."""
        self.epoch = epoch

    def rows(self, indices: Sequence[int]) -> list[int]:
        """The rows (in the files' order) of these indices of the epoch."""
        if self._mix is None:
            return list(indices)
        return [self._mix.record(i, self.epoch) for i in indices]

    def documents(self, indices: Sequence[int]) -> torch.Tensor:
        """int64 [B, 1 + k]: the flat places (`pools.Pools`) of the documents served for these indices of the
        epoch, the positive first."""
        return self._pools.draw(torch.as_tensor(self.rows(indices), dtype=torch.long), self.epoch)

    def __getitems__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        idx, at, k = torch.as_tensor(self.rows(indices), dtype=torch.long), self.documents(indices), self.num_negatives
        batch = {"query": self._queries[idx], "doc": self._documents[at[:, 0]], "index": torch.as_tensor(list(indices))}
        if k:
            batch[NEGATIVES] = self._documents[at[:, 1:]]
        if self._ids is not None:
            batch[DOC_IDS] = self._ids[at] if k else self._ids[at[:, 0]]
        if self._teacher is not None:
            batch[TEACHER_SCORES] = self._teacher[at]
        if self._own is not None:
            batch[OWN_GROUP] = self._own[idx]
        if self._frozen is not None:
            vectors, queries, documents = self._frozen
            batch[FROZEN_QUERIES] = vectors[queries[idx]]
            batch[FROZEN_DOCS] = vectors[documents[at]] if k else vectors[documents[at[:, 0]]]
        return batch
