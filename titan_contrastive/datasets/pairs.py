"""The user's text pairs for the bi_encoder family: `(query, positive[, negative, ...])` rows.

Files: `.jsonl` (one JSON object per line, or a JSON list), `.csv` (comma-separated, a header
line), `.tsv` (tab-separated; a header line when `data.pairs_columns` names the columns, else
none), `.parquet`, and Hugging Face datasets on disk: a `save_to_disk` folder (of a DatasetDict,
the split "train" or "test") or an `.arrow` file (`hf_disk`, never the hub). A glob pattern or a folder
of such files (a dataset repository's shards) is one source, its files read in sorted order (`shards`).

Columns: those named by `data.pairs_columns` (query, positive, then negatives), else the row's
columns in order, which is sentence-transformers' convention (anchor, positive, negatives...),
with two exceptions for named columns: the id column (`data.pairs_id_column`, `id`) is no text
but the positive's id, and a `label`, `labels`, `score` or `scores` column (sentence-transformers'
label columns) is a teacher's scores of the row's documents, read in a run with loss.distill and
else left (one number per row, a scored pair's label, is refused: another loss's data). A
negative column may hold a list of texts (tevatron's `negatives: [...]`), flattened in order.

Several files join with `::` (`mixing.SourceMix`, weighted by `data.upsampling_factors`): they must
agree on the number of negatives per row (unless data.hard_negatives is false) and on having ids.
Each may have its own prompts (`data.query_prompts`, `data.doc_prompts`: a task's instruction),
which replace the tokenizer's (the model's) for that file's queries, or documents and negatives.

Ids: with an id column, every positive's document id is a hash of its id string, and a hard
negative's is the id of a positive with exactly its text, else a hash of its text (another
namespace); they are served as `doc_id` (`batching.DOC_IDS`) [B] or [B, 1 + k], and the duplicate
mask (loss.mask_duplicates) then compares documents as the data names them, not by token ids.
blake2b rather than Python's `hash`: the same ids in every process, run and worker.

Teacher scores (loss.distill, train split): per row a list of 1 + k numbers, the positive's score
then each negative's (a JSON list in a CSV/TSV cell); for margin_mse also k margins T_0 - T_j (one
number for a triplet), read as the scores [0, -m_1, ..., -m_k]. Served as `teacher_scores`
(`batching.TEACHER_SCORES`) float32 [B, 1 + k]; a row whose scores are not such numbers is a bad row.
A frozen model's embeddings of the texts, from a file of their own (loss.teacher_embeddings or
guide_embeddings), are served beside them (`datasets/frozen.py`).

Why everything is tokenized at load, as for WordNet: a batch is then one gather, and the texts
are small next to images. A bad row (an empty query, positive or negative, another number of
negatives than the first row, a missing id) is skipped at load, counted and logged; past
`data.max_bad_fraction` of the file the load stops, naming the file and row. Extra columns are
hard negatives, served as `neg` [B, k, doc_length] unless data.hard_negatives is false: every
step kind adds them to the contrastive problem as extra columns (`batching.with_negatives`,
`losses`), and the start log says how many are served.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from titan_contrastive.batching import DOC_IDS, FROZEN_DOCS, FROZEN_QUERIES, NEGATIVES, TEACHER_SCORES
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.frozen import EmbeddingTable
from titan_contrastive.datasets.mixing import SourceMix, check_per_source, joins, split_sources
from titan_contrastive.datasets.shards import shard_files
from titan_contrastive.datasets.tables import read_table
from titan_contrastive.datasets.tokenizer import PairTokenizer

logger = logging.getLogger("titan_contrastive")
FORMATS = (".jsonl", ".csv", ".tsv", ".parquet", ".arrow")
SCORE_COLUMNS = ("label", "labels", "score", "scores")  # sentence-transformers' label columns


class PairRows(NamedTuple):
    texts: list[list[str]]
    """Per row: query, positive, negatives..., every row as wide as the first."""
    ids: list[str] | None
    """Per row, its positive's id (the id column's value as text); None without an id column."""
    scores: list[list[float]] | None
    """Per row, the teacher's scores of its 1 + k documents; None when not read."""
    skipped: Counter[str]
    """Bad rows by reason."""


def _fields(row: Any, columns: Sequence[str], id_column: str, score_column: str) -> tuple[list[Any], Any, Any]:
    """(the row's text values in column order, its id value or None, its scores' value or None)."""
    if not isinstance(row, dict):
        return list(row), None, None
    ident = row.get(id_column) if id_column else None
    other = (id_column, score_column)
    texts = [row.get(c) for c in columns] if columns else [v for k, v in row.items() if k not in other]
    return texts, ident, row.get(score_column) if score_column else None


def _parsed(value: Any) -> Any:
    """A score column's value, a JSON text (a CSV/TSV cell) read as JSON; None for text that is not JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return None


def _scores(value: Any, width: int, margins: bool) -> list[float] | None:
    """A row's teacher scores of its `width` documents (see the module docstring), or None when
    they are not that many finite numbers."""
    value = _parsed(value)
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        return None
    if margins and len(values) == width - 1:
        return [0.0] + [-float(v) for v in values]
    return [float(v) for v in values] if len(values) == width else None


def _check_columns(
    file: Path, names: list[str] | None, raw: list[Any], columns: Sequence[str], id_column: str, teacher: str
) -> tuple[bool, str]:
    """(whether the rows have an id column, the teacher's scores column or ""); a DataError for a
    column that is not there or not allowed."""
    if id_column and id_column in columns:
        raise DataError(
            f"data.pairs_id_column={id_column!r} is also in data.pairs_columns={list(columns)}: the id is not a "
            "text; take it out of one of them"
        )
    keys = set(names) if names is not None else {k for row in raw if isinstance(row, dict) for k in row}
    missing = [c for c in columns if names is not None and c not in keys]
    if missing:
        raise DataError(f"{file}: no column {missing[0]!r} (columns: {', '.join(names or [])}); fix data.pairs_columns")
    if id_column and id_column not in keys and id_column != "id":
        raise DataError(
            f"data.pairs_id_column={id_column!r}: {file} has no such column (columns: {', '.join(map(str, keys))}); "
            "name the positive's id column, or set it to '' for none"
        )
    has_ids, scored = bool(id_column) and id_column in keys, [c for c in SCORE_COLUMNS if c in keys]
    if teacher:
        if len(scored) != 1 or names is None and not all(isinstance(row, dict) for row in raw):
            raise DataError(
                f"loss.distill={teacher}: {file} needs the teacher's scores in one named column, label, labels, score "
                f"or scores (found: {', '.join(scored) or 'none'}); add it, or leave loss.distill empty"
            )
        return has_ids, scored[0]
    if scored and not columns:
        first = next((row.get(scored[0]) for row in raw if isinstance(row, dict)), None)
        if len(scored) == 1 and _score_list(first):
            logger.info(
                f"{file}: the teacher's scores in its {scored[0]!r} column are not read (loss.distill reads them)"
            )
            return has_ids, scored[0]
        raise DataError(
            f"{file}: a {scored[0]!r} column: scored pairs train with loss.distill=cosent (CoSENT), which reads it; "
            "set it, drop the column, or name the text columns in data.pairs_columns"
        )
    return has_ids, ""


def _score_list(value: Any) -> bool:
    """Whether a score column's value is a list of scores (a teacher's, of a row's documents), not one label."""
    value = _parsed(value)
    return isinstance(value, (list, tuple)) and len(value) >= 2


def read_rows(
    path: str,
    columns: Sequence[str] = (),
    id_column: str = "id",
    max_bad_fraction: float = 0.001,
    split: str = "train",
    teacher: str = "",
) -> PairRows:
    """The usable rows of a pairs file, their ids and (`teacher`: the loss.distill kind) the
    teacher's scores (see the module docstring); `split`: which split of a saved DatasetDict. A pattern or a
    folder of shards (`shards.shard_files`): each file's, joined in order."""
    files = shard_files(path, FORMATS)
    if files is not None:
        parts = [read_rows(str(f), columns, id_column, max_bad_fraction, split, teacher) for f in files]
        return _shards_joined(path, files, parts)
    file = Path(path).expanduser()
    if not (file.is_dir() or (file.suffix in FORMATS and file.is_file())):
        raise DataError(
            f"data.path={path}: not an existing {'/'.join(FORMATS)} file or save_to_disk folder; give "
            "query/positive[/negative] rows in one of those"
        )
    try:
        names, raw = read_table(file, columns, split)
    except DataError:
        raise
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{file}: not readable ({type(e).__name__}: {e})") from None
    except Exception as e:  # noqa: BLE001 - pyarrow's errors for a damaged Parquet file, a JSON line of no row
        raise DataError(f"{file}: not a readable {file.suffix[1:]} file ({type(e).__name__}: {e})") from None
    has_ids, score_column = _check_columns(file, names, raw, columns, id_column, teacher)
    rows, ids, scores, skipped, width = [], [], [], Counter(), 0
    for n, row in enumerate(raw):
        values, ident, scored = _fields(row, columns, id_column if has_ids else "", score_column)
        values = values[:2] + [t for v in values[2:] for t in (v if isinstance(v, (list, tuple)) else [v])]
        texts = [t.strip() if isinstance(t, str) else "" for t in values]
        ident = "" if ident is None else str(ident).strip()
        width = width or len(texts)
        row_scores = _scores(scored, width - 1, teacher == "margin_mse") if teacher else None
        reason = (
            "short_row"
            if len(texts) < 2
            else "ragged_negatives"  # another number of hard negatives than the first row
            if len(texts) != width
            else "missing_text"
            if not all(texts)
            else "missing_id"
            if has_ids and not ident
            else "bad_scores"  # not 1 + k finite numbers (or k margins)
            if teacher and row_scores is None
            else ""
        )
        if reason:
            skipped[reason] += 1
            logger.warning(f"{file} row {n + 1}: {reason}; skipped")
            if sum(skipped.values()) > max(1, int(max_bad_fraction * len(raw))):
                raise DataError(
                    f"{file}: {sum(skipped.values())} bad rows of {len(raw)} exceed "
                    f"data.max_bad_fraction={max_bad_fraction} "
                    f"({dict(skipped)}; last: row {n + 1}); fix the file or raise data.max_bad_fraction"
                )
            continue
        rows.append(texts)
        ids.append(ident)
        scores.append(row_scores)
    if not rows:
        bad = f" ({dict(skipped)} skipped)" if skipped else ""
        raise DataError(f"{file}: no usable rows{bad}; every row needs a query and a positive")
    return PairRows(rows, ids if has_ids else None, scores if teacher else None, skipped)


def _shards_joined(path: str, files: Sequence[Path], parts: Sequence[PairRows]) -> PairRows:
    """The rows of a source's shards `files` (`parts`, read each), in order; a DataError when they disagree
    on the row's width or on having ids."""
    for f, part in zip(files[1:], parts[1:]):
        if len(part.texts[0]) != len(parts[0].texts[0]) or (part.ids is None) != (parts[0].ids is None):
            what = "ids" if len(part.texts[0]) == len(parts[0].texts[0]) else "columns"
            raise DataError(
                f"data.path={path}: {f.name} and {files[0].name} differ in their {what} ({len(part.texts[0])} and "
                f"{len(parts[0].texts[0])} texts per row, ids {part.ids is not None} and {parts[0].ids is not None}); "
                "the files of one source hold rows alike"
            )
    return PairRows(
        [row for part in parts for row in part.texts],
        None if parts[0].ids is None else [i for part in parts for i in part.ids],
        None if parts[0].scores is None else [s for part in parts for s in part.scores],
        sum((part.skipped for part in parts), Counter()),
    )


def _join(
    parts: Sequence[str], files: Sequence[PairRows], hard_negatives: bool
) -> tuple[list[list[str]], list[str] | None, list[list[float]] | None]:
    """The rows and ids of `::`-joined files, in order (query and positive only where they disagree on
    the number of hard negatives and `hard_negatives` is false); a DataError when they disagree on it
    and the negatives are served, or on having an id column."""
    widths = {part: len(f.texts[0]) - 2 for part, f in zip(parts, files)}
    width = None if len(set(widths.values())) == 1 else 2
    if width and hard_negatives:
        shown = ", ".join(f"{part}: {k}" for part, k in widths.items())
        raise DataError(
            f"data.path={'::'.join(parts)}: the sources hold different numbers of hard negatives per row ({shown}); "
            "give every source the same number, or set data.hard_negatives=false (queries and positives only)"
        )
    with_ids = [part for part, f in zip(parts, files) if f.ids is not None]
    if with_ids and len(with_ids) != len(parts):
        without = next(part for part, f in zip(parts, files) if f.ids is None)
        raise DataError(
            f"data.pairs_id_column: {with_ids[0]} has that column and {without} has not; give every source ids "
            "(they are compared across sources) or set data.pairs_id_column=''"
        )
    texts = [row[:width] for f in files for row in f.texts]
    scores = [s for f in files for s in f.scores] if files[0].scores is not None else None
    return texts, [i for f in files for i in f.ids] if with_ids else None, scores


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


def _by_source(
    spans: Sequence[tuple[int, PairTokenizer]],
    rows: Sequence[Sequence[str]],
    encode: Callable[[PairTokenizer, Sequence[Sequence[str]]], torch.Tensor],
) -> torch.Tensor:
    """`encode(tokenizer, rows)` of each source's rows (`spans`: how many, which tokenizer), concatenated."""
    out, start = [], 0
    for n, tokenizer in spans:
        out.append(encode(tokenizer, rows[start : start + n]))
        start += n
    return torch.cat(out)


def _hash63(namespace: str, text: str) -> int:
    """A stable 63-bit hash of a string in a namespace (the same in every process and run)."""
    digest = hashlib.blake2b(f"{namespace}\0{text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def document_id_table(rows: Sequence[Sequence[str]], ids: Sequence[str]) -> torch.Tensor:
    """int64 [N, 1 + k]: row i's positive's id, then its negatives' (a positive's id for a negative
    with exactly its text, the first such row's; else a hash of the text)."""
    positive = [_hash63("id", i) for i in ids]
    by_text: dict[str, int] = {}
    for row, pid in zip(rows, positive):
        by_text.setdefault(row[1], pid)
    table = [
        [pid] + [by_text[t] if t in by_text else _hash63("text", t) for t in row[2:]]
        for row, pid in zip(rows, positive)
    ]
    return torch.tensor(table, dtype=torch.int64).view(len(rows), -1)


class PairsDataset:
    """Pre-tokenized rows: batches {query, doc, index[, neg][, doc_id]} (see the module docstring).
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
        factors: Sequence[float] = (),
        teacher: str = "",
        query_prompts: Sequence[str] = (),
        doc_prompts: Sequence[str] = (),
        frozen: EmbeddingTable | None = None,
    ) -> None:
        parts, factors = split_sources(path, factors)
        tokenizers = source_tokenizers(tokenizer, parts, query_prompts, doc_prompts)
        files = [read_rows(part, columns, id_column, max_bad_fraction, split, teacher) for part in parts]
        texts, ids, scores = _join(parts, files, hard_negatives)
        self.skipped = sum((f.skipped for f in files), Counter())
        spans = [(len(f.texts), t) for f, t in zip(files, tokenizers)]
        if scores is not None and teacher == "cosent" and not hard_negatives:  # the positives' scores alone
            scores = [row[:1] for row in scores]
        self._setup(
            texts, ids, "pairs", split, path, tokenizer, query_length, hard_negatives, scores, spans, teacher, frozen
        )
        if joins(factors):
            self._mix = SourceMix([len(f.texts) for f in files], factors)
            self.source_sizes = self._mix.sizes

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
    ) -> PairsDataset:
        """A dataset of rows (query, positive, negatives...), all of one width; `ids`: the positives' ids."""
        if not rows or len({len(r) for r in rows}) != 1 or len(rows[0]) < 2:
            raise DataError(f"{source}: rows must all hold a query, a positive and the same number of negatives")
        if ids is not None and len(ids) != len(rows):
            raise DataError(f"{source}: {len(ids)} ids for {len(rows)} rows; give one id per row")
        self = cls.__new__(cls)
        self.skipped = Counter()
        self._setup(rows, ids, name, split, source, tokenizer, query_length, hard_negatives, frozen=frozen)
        return self

    def _setup(
        self,
        rows: Sequence[Sequence[str]],
        ids: Sequence[str] | None,
        name: str,
        split: str,
        source: str,
        tokenizer: PairTokenizer,
        query_length: int,
        hard_negatives: bool,
        scores: Sequence[Sequence[float]] | None = None,
        spans: Sequence[tuple[int, PairTokenizer]] = (),
        teacher: str = "",
        frozen: EmbeddingTable | None = None,
    ) -> None:
        """`spans`: (rows, their tokenizer) per source in order; empty = every row through `tokenizer`;
        `teacher`: the loss.distill kind that reads `scores`; `frozen`: a frozen model's embeddings of the rows'
        texts (`datasets/frozen.py`)."""
        self.name, self.split, self.source, self.full = name, split, source, True
        self._mix: SourceMix | None = None
        self.source_sizes: list[int] | None = None
        """Samples per epoch of each `::`-joined file (`mixing.SourceMix`); None: one file, each row once."""
        self.epoch = 0
        self.image_shape = None
        self.class_names = None
        self.recall_ks = (1, 10)
        self.recall_direction = "query_to_doc"
        self.tokenizer = tokenizer
        in_file = len(rows[0]) - 2
        self.num_negatives = in_file if hard_negatives else 0  # served per row as `neg` [B, k, L]; 0: none
        spans = spans or [(len(rows), tokenizer)]
        self._queries = _by_source(spans, rows, lambda t, part: t.encode_queries([r[0] for r in part], query_length))
        self._docs = _by_source(spans, rows, lambda t, part: t.encode_docs([r[1] for r in part]))
        k = self.num_negatives
        negatives = (
            _by_source(spans, rows, lambda t, part: t.encode_docs([d for r in part for d in r[2:]])) if k else None
        )
        self._negs = None if negatives is None else negatives.view(len(rows), k, -1)
        ids_table = document_id_table(rows, ids) if ids is not None else None
        self._ids = None if ids_table is None else ids_table if k else ids_table[:, 0]
        if scores is not None and not k and teacher != "cosent":  # CoSENT ranks scored pairs without negatives
            raise DataError(
                f"{source}: loss.distill compares each query's positive with its hard negatives, and the rows hold "
                "none; give rows with hard negatives (and their scores), or leave loss.distill empty"
            )
        self._teacher = None if scores is None else torch.tensor(scores, dtype=torch.float32).view(len(rows), 1 + k)
        if split == "train" and in_file:
            logger.info(
                f"{name}: {k} hard negative(s) per row served from {source}: each query's problem has the batch's "
                f"positives and {k} hard negatives per query as columns"
                if k
                else f"{name}: data.hard_negatives=false: the {in_file} hard negative(s) per row in {source} are not "
                "served; each query's problem has the batch's positives only"
            )
        self._frozen = None if frozen is None else (frozen.vectors, frozen.rows(rows, 2 + k))
        if frozen is not None:
            logger.info(f"{name}: a frozen model's {frozen.dim}-wide embeddings of every text from {frozen.source}")
        if self._teacher is not None:
            logger.info(f"{name}: the teacher's scores of each row's 1 + {k} documents from {source} (loss.distill)")
        if split == "train" and ids is not None:
            logger.info(f"{name}: document ids from the id column of {source} (loss.mask_duplicates compares them)")

    def __len__(self) -> int:
        return len(self._queries) if self._mix is None else len(self._mix)

    def set_epoch(self, epoch: int) -> None:
        """No per-sample randomness (the pairs are fixed); joined files' windows move per epoch."""
        self.epoch = epoch

    def rows(self, indices: Sequence[int]) -> list[int]:
        """The rows (in the files' order) of these indices of the epoch."""
        if self._mix is None:
            return list(indices)
        return [self._mix.record(i, self.epoch) for i in indices]

    def __getitems__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(self.rows(indices), dtype=torch.long)
        batch = {"query": self._queries[idx], "doc": self._docs[idx], "index": torch.as_tensor(list(indices))}
        if self._negs is not None:
            batch[NEGATIVES] = self._negs[idx]
        if self._ids is not None:
            batch[DOC_IDS] = self._ids[idx]
        if self._teacher is not None:
            batch[TEACHER_SCORES] = self._teacher[idx]
        if self._frozen is not None:
            vectors, at = self._frozen
            batch[FROZEN_QUERIES] = vectors[at[idx, 0]]
            batch[FROZEN_DOCS] = vectors[at[idx, 1:]] if self.num_negatives else vectors[at[idx, 1]]
        return batch
