"""Reading the user's text pairs: `(query, positive[, negative, ...])` rows of a file, as texts.

Files: `.jsonl` (one JSON object per line, or a JSON list), `.json` (an array of them, or JSON lines), `.csv`
(comma-separated, a header line), `.tsv` (tab-separated; a header line when `data.pairs_columns` names the columns,
else none), `.txt` (a text a line, the one column `text`: unsupervised SimCSE's data, `data.pairs_columns = ["text",
"text"]`), `.parquet`, and Hugging Face datasets on disk: a `save_to_disk` folder (of a DatasetDict,
the split "train" or "test") or an `.arrow` file (`hf_disk`, never the hub). A glob pattern or a folder
of such files (a dataset repository's shards) is one source, its files read in sorted order (`shards`).

Columns: those named by `data.pairs_columns` (query, positive, then negatives), else the row's columns in order,
which is sentence-transformers' convention (anchor, positive, negatives...), or those of FlagEmbedding's and
tevatron's rows (`pair_columns`), with two exceptions for named columns: the id column (`data.pairs_id_column`, `id`)
is no text but the positive's id, and a `label`, `labels`, `score` or `scores` column (sentence-transformers' label
columns) is a teacher's scores of the row's documents, read in a run with loss.distill and else left (one number
per row, a scored pair's label, is refused: another loss's data). A negative column may hold a list of texts
(tevatron's `negatives: [...]`), flattened in order; a passage may be tevatron's `{"docid", "title", "text"}`, read
as its title, a space and its text. With data.corpus the documents are ids into it (`pair_columns`, `corpus`).

Pools (`pooled`, a run with data.negatives_per_row): the positive column may hold a list of texts too
(FlagEmbedding's `{"query", "pos": [...], "neg": [...]}`), rows hold any number of negatives, and a
row's texts are its query, its positives, then its negatives (`PairRows.positives` says how many
positives). Without pools every row is as wide as the first, with one positive.

Teacher scores (loss.distill, train split): per row one number per document, the positive's (the
positives', pooled) then each negative's (a JSON list in a CSV/TSV cell); for margin_mse also the
negatives' margins T_0 - T_j behind a single positive (one number for a triplet), read as the scores
[0, -m_1, ..., -m_k]. A row whose scores are not such numbers is a bad row.

A bad row (an empty query, positive or negative, another number of negatives than the first row, a
missing id) is skipped at load, counted and logged; past `data.max_bad_fraction` of the file the load
stops, naming the file and row.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from titan_contrastive.datasets.bad_samples import too_many_bad
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.beir_folder import is_beir_folder, judged_pairs
from titan_contrastive.datasets.formats import data_suffix, formats_named
from titan_contrastive.datasets.pair_columns import (
    FLAG_PROMPT,
    FLAG_SCORED,
    FLAG_SCORES,
    FLAG_TEXTS,
    TEVATRON_TEXTS,
    check_columns,
    flag_columns,
    parsed,
    tevatron_columns,
    tevatron_ids,
)
from titan_contrastive.datasets.shards import shard_files
from titan_contrastive.datasets.tables import guarded_rows, opened_rows

logger = logging.getLogger("titan_contrastive")

FORMATS = (".jsonl", ".json", ".csv", ".tsv", ".txt", ".parquet", ".arrow")
TABLE_FORMATS = tuple(f for f in FORMATS if f != ".txt")
"""The formats of rows of several columns (a corpus's ids and texts, STS pairs and scores): a `.txt` file has one."""


class PairRows(NamedTuple):
    texts: list[list[str]]
    """Per row: query, positive(s), negatives...; without pools every row as wide as the first."""
    ids: list[str] | None
    """Per row, its positive's id (the id column's value as text); None without an id column."""
    scores: list[list[float]] | None
    """Per row, the teacher's scores of its documents (positives, then negatives); None when not read."""
    skipped: Counter[str]
    """Bad rows by reason."""
    positives: list[int] | None = None
    """Pooled: per row, how many of its texts after the query are positives; None: one each."""
    prompts: list[str] | None = None
    """Per row, the instruction before its query (FlagEmbedding's `prompt`, "" for none); None: no such column."""


def kept_rows(rows: PairRows, keep: Sequence[int], skipped: Counter[str]) -> PairRows:
    """The rows of `rows` at `keep`, every per-row list with them, the bad rows counted as `skipped`."""

    def kept(values: list | None) -> list | None:
        return None if values is None else [values[i] for i in keep]

    return PairRows(
        kept(rows.texts), kept(rows.ids), kept(rows.scores), skipped, kept(rows.positives), kept(rows.prompts)
    )


def _fields(row: Any, columns: Sequence[str], id_column: str, score_column: str) -> tuple[list[Any], Any, Any]:
    """(the row's text values in column order, its id value or None, its scores' value or None)."""
    if not isinstance(row, dict):
        return list(row), None, None
    ident = row.get(id_column) if id_column else None
    other = (id_column, score_column)
    texts = [row.get(c) for c in columns] if columns else [v for k, v in row.items() if k not in other]
    if score_column == FLAG_SCORED:
        pos, neg = (row.get(c) for c in FLAG_SCORES)
        return texts, ident, [*pos, *neg] if isinstance(pos, list) and isinstance(neg, list) else None
    return texts, ident, row.get(score_column) if score_column else None


def document_scores(value: Any, width: int, margins: bool = False) -> list[float] | None:
    """A row's teacher scores of its `width` documents (see the module docstring), or None when
    they are not that many finite numbers."""
    value = parsed(value)
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        return None
    if margins and len(values) == width - 1:
        return [0.0] + [-float(v) for v in values]
    return [float(v) for v in values] if len(values) == width else None


def read_rows(
    path: str,
    columns: Sequence[str] = (),
    id_column: str = "id",
    max_bad_fraction: float = 0.001,
    split: str = "train",
    teacher: str = "",
    pooled: bool = False,
    seen: dict[str, str] | None = None,
    by_id: bool = False,
) -> PairRows:
    """The usable rows of a pairs file, their ids and (`teacher`: the loss.distill kind) the
    teacher's scores (see the module docstring); `split`: which split of a saved DatasetDict; `pooled`:
    lists of positives and any number of negatives per row. A pattern or a folder of shards
    (`shards.shard_files`): each file's, joined in order. The rows are read one at a time and each distinct text is
    held once, however many rows repeat it (a corpus's passages as many queries' negatives); `seen`: the texts other
    files read (`::`-joined sources), shared with them. `by_id`: the documents are ids (module docstring)."""
    seen = {} if seen is None else seen
    if is_beir_folder(path):
        if by_id:
            raise DataError(
                f"data.path={path} is a retrieval set, which holds its own corpus (its judged pairs are the rows): "
                "leave data.corpus empty"
            )
        return _judged_rows(path, columns, split, teacher, pooled, id_column, max_bad_fraction, seen)
    files = shard_files(path, FORMATS)
    if files is not None:
        parts = [
            _read_file(f, columns, id_column, max_bad_fraction, split, teacher, pooled, seen, by_id) for f in files
        ]
        return _shards_joined(path, files, parts)
    file = Path(path).expanduser()
    if not (file.is_dir() or (data_suffix(file) in FORMATS and file.is_file())):
        raise DataError(
            f"data.path={path}: not an existing {formats_named(FORMATS)} file or save_to_disk folder; give "
            "query/positive[/negative] rows in one of those"
        )
    return _read_file(file, columns, id_column, max_bad_fraction, split, teacher, pooled, seen, by_id)


def _judged_rows(
    path: str,
    columns: Sequence[str],
    split: str,
    teacher: str,
    pooled: bool,
    id_column: str,
    max_bad_fraction: float,
    seen: dict[str, str],
) -> PairRows:
    """A retrieval set's split as rows: each query and a relevant document (pooled: all of them), the document's
    corpus id its id; no negatives (the qrels name none)."""
    if columns or teacher:
        what = f"data.pairs_columns={list(columns)}" if columns else f"loss.distill={teacher!r}"
        raise DataError(
            f"{what}: data.path={path} is a retrieval set (corpus, queries, qrels), whose rows are its judged pairs, "
            "with no columns to name nor a teacher's scores: leave it empty"
        )
    rows, ids, counts, skipped = [], [], [], Counter()
    for query, documents, doc_ids in zip(*judged_pairs(path, split)):
        for texts, group in [(documents, doc_ids)] if pooled else [([t], [i]) for t, i in zip(documents, doc_ids)]:
            if not query or not all(texts):
                skipped["missing_text"] += 1
                continue
            rows.append([seen.setdefault(t, t) for t in [query, *texts]])
            ids.append(group[0])
            counts.append(len(texts))
    if not rows or too_many_bad(skipped, len(rows) + sum(skipped.values()), max_bad_fraction):
        raise DataError(
            f"data.path={path}: {sum(skipped.values())} of the split {split!r}'s judged pairs have an empty query or "
            f"document, past data.max_bad_fraction={max_bad_fraction}; fix them or raise data.max_bad_fraction"
        )
    logger.info(f"data.path={path}: the retrieval set's {split!r} split, {len(rows)} rows of its judged pairs")
    return PairRows(rows, ids if id_column and not pooled else None, None, skipped, counts if pooled else None)


def _columns(
    file: Path, columns: Sequence[str], split: str
) -> tuple[list[str] | None, set[str], bool, int, Any, Iterator[Any]]:
    """(the column names or None, the rows' columns, whether every row is a dict, how many rows, the first dict row
    or None, the rows from the first). JSON lines, CSV and TSV are read once for it first, a row at a time, keeping
    none; Parquet and Arrow files say how many rows they hold."""
    names, rows = opened_rows(file, columns, split)
    keys, dicts, count, first = set(names or ()), True, rows.length, None
    if count is not None and names is not None:
        first = next(guarded_rows(file, rows), None)
        return (
            names,
            keys,
            dicts,
            count,
            first,
            itertools.chain([] if first is None else [first], guarded_rows(file, rows)),
        )
    count = 0
    for row in guarded_rows(file, rows):
        count += 1
        if not isinstance(row, dict):
            dicts = False
            continue
        first = row if first is None else first
        if names is None:
            keys.update(row)
    return names, keys, dicts, count, first, guarded_rows(file, opened_rows(file, columns, split)[1])


def _read_file(
    file: Path,
    columns: Sequence[str],
    id_column: str,
    max_bad_fraction: float,
    split: str,
    teacher: str,
    pooled: bool,
    seen: dict[str, str],
    by_id: bool,
) -> PairRows:
    """`read_rows` of one file; `seen`: the texts read so far, each held once (a text read again is that object)."""
    names, keys, dicts, total, first, table = _columns(file, columns, split)
    flag = not columns and flag_columns(file, keys, teacher)
    columns = columns or (() if flag else tevatron_ids(file, keys, by_id))
    columns = TEVATRON_TEXTS if not columns and not flag and tevatron_columns(file, keys) else columns
    columns, prompted = (FLAG_TEXTS, FLAG_PROMPT in keys) if flag else (columns, False)
    has_ids, score_column = check_columns(file, names, dicts, first, keys, columns, id_column, teacher)
    rows, ids, scores, counts, prompts, skipped, width = [], [], [], [], [], Counter(), 0
    for n, row in enumerate(table):
        values, ident, scored = _fields(row, columns, id_column if has_ids else "", score_column)
        positives = _positives(values, file, n, pooled, id_column if has_ids else "")
        values = values[:1] + positives + [t for v in values[2:] for t in (v if isinstance(v, (list, tuple)) else [v])]
        documents = [doc_id(v) if by_id else cell_text(v) for v in values[1:]]
        texts = [seen.setdefault(t, t) for t in [cell_text(values[0]), *documents]] if values else []
        ident = "" if ident is None else str(ident).strip()
        width = width or len(texts)
        docs = len(texts) - 1 if pooled else width - 1
        row_scores = document_scores(scored, docs, teacher == "margin_mse" and len(positives) == 1) if teacher else None
        reason = (
            "short_row"
            if len(texts) < 2 or not positives
            else "ragged_negatives"  # another number of hard negatives than the first row
            if len(texts) != width and not pooled
            else "missing_text"
            if not all(texts)
            else "missing_id"
            if has_ids and not ident
            else "bad_scores"  # not one finite number per document (or the negatives' margins)
            if teacher and row_scores is None
            else ""
        )
        if reason:
            skipped[reason] += 1
            logger.warning(f"{file} row {n + 1}: {reason}; skipped")
            if too_many_bad(skipped, total, max_bad_fraction):
                raise DataError(
                    f"{file}: {sum(skipped.values())} bad rows of {total} exceed "
                    f"data.max_bad_fraction={max_bad_fraction} "
                    f"({dict(skipped)}; last: row {n + 1}); fix the file or raise data.max_bad_fraction"
                    + (
                        "; or draw k of each row's negatives: data.negatives_per_row = k"
                        if "ragged_negatives" in skipped
                        else ""
                    )
                )
            continue
        rows.append(texts)
        ids.append(ident)
        scores.append(row_scores)
        counts.append(len(positives))
        prompt = row.get(FLAG_PROMPT) if prompted and isinstance(row, dict) else ""
        prompts.append(seen.setdefault(prompt, prompt) if prompt and isinstance(prompt, str) else "")
    if not rows:
        bad = f" ({dict(skipped)} skipped)" if skipped else ""
        raise DataError(f"{file}: no usable rows{bad}; every row needs a query and a positive")
    return PairRows(
        rows,
        ids if has_ids else None,
        scores if teacher else None,
        skipped,
        counts if pooled else None,
        prompts if prompted else None,
    )


def cell_text(value: Any) -> str:
    """A cell's text: a string, or a tevatron passage `{"title", "text"}` read as its title, a space and its text;
    "" for anything else (a bad row)."""
    if isinstance(value, dict) and isinstance(value.get("text"), str):
        title = value.get("title")
        value = (
            f"{title.strip()} {value['text'].strip()}" if isinstance(title, str) and title.strip() else value["text"]
        )
    return value.strip() if isinstance(value, str) else ""


def doc_id(value: Any) -> str:
    """A document's id: a text or an integer, as text; "" for anything else (a bad row)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value.strip() if isinstance(value, str) else ""


def _positives(values: list[Any], file: Path, row: int, pooled: bool, id_column: str) -> list[Any]:
    """The row's positive(s) (`values[1]`, a text or, pooled, a list of them); a DataError for a list where one
    positive is read, or several positives in rows with ids."""
    if len(values) < 2:
        return []
    value = values[1]
    if not isinstance(value, (list, tuple)):
        return [value]
    if not pooled and len(value) != 1:
        raise DataError(
            f"{file} row {row + 1}: the positive is a list of {len(value)} texts, and a row here has one positive; "
            "set data.negatives_per_row = k to draw one of them (and k negatives) per epoch, or give one text"
        )
    if id_column and len(value) > 1:
        raise DataError(
            f"{file} row {row + 1}: {len(value)} positives and an id column ({id_column!r}), which names one "
            "positive; set data.pairs_id_column='' (duplicates are then compared by their token ids)"
        )
    return list(value)


def _shards_joined(path: str, files: Sequence[Path], parts: Sequence[PairRows]) -> PairRows:
    """The rows of a source's shards `files` (`parts`, read each), in order; a DataError when they disagree
    on the row's width or on having ids."""
    pooled = parts[0].positives is not None  # rows of any width
    for f, part in zip(files[1:], parts[1:]):
        wide = len(part.texts[0]) == len(parts[0].texts[0]) or pooled
        if not wide or (part.ids is None) != (parts[0].ids is None):
            what = "ids" if wide else "columns"
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
        [c for part in parts for c in part.positives] if pooled else None,
        _prompts(parts),
    )


def _prompts(parts: Sequence[PairRows]) -> list[str] | None:
    """The rows' instructions of files read apart, joined ("" for the rows of a file without them)."""
    if all(part.prompts is None for part in parts):
        return None
    return [p for part in parts for p in (part.prompts or [""] * len(part.texts))]


def join_sources(parts: Sequence[str], files: Sequence[PairRows], hard_negatives: bool) -> PairRows:
    """The rows of `::`-joined files (`parts`, read each), in order (query and positive only where they disagree
    on the number of hard negatives and `hard_negatives` is false; pooled rows may); a DataError when they
    disagree on it and the negatives are served, or on having an id column."""
    pooled = files[0].positives is not None
    widths = {part: len(f.texts[0]) - 2 for part, f in zip(parts, files)}
    width = None if len(set(widths.values())) == 1 or pooled else 2
    if width and hard_negatives:
        shown = ", ".join(f"{part}: {k}" for part, k in widths.items())
        raise DataError(
            f"data.path={'::'.join(parts)}: the sources hold different numbers of hard negatives per row ({shown}); "
            "give every source the same number, set data.negatives_per_row = k (k of each row's drawn per "
            "epoch), or set data.hard_negatives=false (queries and positives only)"
        )
    with_ids = [part for part, f in zip(parts, files) if f.ids is not None]
    if with_ids and len(with_ids) != len(parts):
        without = next(part for part, f in zip(parts, files) if f.ids is None)
        raise DataError(
            f"data.pairs_id_column: {with_ids[0]} has that column and {without} has not; give every source ids "
            "(they are compared across sources) or set data.pairs_id_column=''"
        )
    return PairRows(
        [row[:width] for f in files for row in f.texts],
        [i for f in files for i in f.ids] if with_ids else None,
        [s for f in files for s in f.scores] if files[0].scores is not None else None,
        sum((f.skipped for f in files), Counter()),
        [c for f in files for c in f.positives] if pooled else None,
        _prompts(files),
    )
