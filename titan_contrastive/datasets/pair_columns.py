"""Which columns of a text-pairs row are its texts, its id and its teacher's scores, by the conventions of the tools
whose files users bring (`pair_rows` reads the rows).

FlagEmbedding's rows: without `data.pairs_columns`, a file with `query`, `pos` and `neg` columns has those as its
texts, `pos_scores` + `neg_scores` as the teacher's scores, and a row's `prompt` as the instruction before its query
(`PairRows.prompts`); the rest is left, named in the log. tevatron's rows: without `data.pairs_columns`, a file with
`query`, `positive_passages` and `negative_passages` columns has those as its texts (its `query_id` left).

Documents by id (`by_id`, a run with data.corpus): every document value of a row (positive, negatives) is an id
(a text or an integer) into the corpus, resolved by `corpus.resolve_documents`; the query stays a text.
tevatron's rows of ids, `query_text` (or `query`), `positive_document_ids`, `negative_document_ids`, are read so
without `data.pairs_columns`, and without data.corpus they are a one-line error.

sentence-transformers' label columns (`SCORE_COLUMNS`) hold a teacher's scores of a row's documents (a list) or a
scored pair's label (one number, refused without loss.distill = "cosent").
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from titan_contrastive.datasets.base import DataError

logger = logging.getLogger("titan_contrastive")

SCORE_COLUMNS = ("label", "labels", "score", "scores")  # sentence-transformers' label columns
FLAG_TEXTS = ("query", "pos", "neg")  # FlagEmbedding's (BGE's) fine-tuning rows
FLAG_SCORES = ("pos_scores", "neg_scores")  # its teacher's scores of them
FLAG_PROMPT = "prompt"  # its per-row query instruction
TEVATRON_TEXTS = ("query", "positive_passages", "negative_passages")  # tevatron's training rows
TEVATRON_IDS = ("positive_document_ids", "negative_document_ids")  # its rows that name a corpus's documents
FLAG_SCORED = "pos_scores + neg_scores"  # the score column of such rows, read as one list


def parsed(value: Any) -> Any:
    """A score column's value, a JSON text (a CSV/TSV cell) read as JSON; None for text that is not JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return None


def flag_columns(file: Path, keys: set[str], teacher: str) -> bool:
    """Whether rows of these columns are FlagEmbedding's (query, pos, neg; its scores and prompt beside them),
    said once in the log with what is read of them."""
    if not set(FLAG_TEXTS) <= keys:
        return False
    read = [", ".join(FLAG_TEXTS) + " as the texts"]
    read += [f"{FLAG_SCORED} as the teacher's scores"] if teacher and _flag_scored(keys) else []
    read += [f"{FLAG_PROMPT} as each row's instruction before its query"] if FLAG_PROMPT in keys else []
    left = sorted(keys - set(FLAG_TEXTS) - ({FLAG_PROMPT} | (set(FLAG_SCORES) if teacher else set())))
    logger.info(f"{file}: FlagEmbedding's rows: {'; '.join(read)}" + (f" (left: {', '.join(left)})" if left else ""))
    return True


def tevatron_columns(file: Path, keys: set[str]) -> bool:
    """Whether rows of these columns are tevatron's (query, positive_passages, negative_passages; its query_id beside
    them), said once in the log."""
    if not set(TEVATRON_TEXTS) <= keys:
        return False
    left = sorted(keys - set(TEVATRON_TEXTS))
    logger.info(
        f"{file}: tevatron's rows: {', '.join(TEVATRON_TEXTS)} as the texts"
        + (f" (left: {', '.join(left)})" if left else "")
    )
    return True


def tevatron_ids(file: Path, keys: set[str], by_id: bool) -> tuple[str, ...]:
    """The columns of tevatron's rows of document ids (its query's, `TEVATRON_IDS`), said once in the log; () for
    other rows. A DataError for such rows without a corpus (`by_id`) or without a query."""
    if not set(TEVATRON_IDS) <= keys:
        return ()
    query = next((c for c in ("query_text", "query") if c in keys), "")
    if not by_id or not query:
        fix = (
            "set data.corpus (embed: --corpus; mine: --corpus with --ids) to the file of their documents (docid, "
            "text[, title] rows)"
        )
        raise DataError(
            f"{file}: tevatron's rows name their documents by id ({', '.join(TEVATRON_IDS)}) "
            + (f"and no corpus is given: {fix}" if query else "and hold no query_text or query column: add one")
        )
    left = sorted(keys - {query, *TEVATRON_IDS})
    logger.info(
        f"{file}: tevatron's rows of document ids: {query}, {', '.join(TEVATRON_IDS)} (ids into data.corpus)"
        + (f" (left: {', '.join(left)})" if left else "")
    )
    return (query, *TEVATRON_IDS)


def _flag_scored(keys: set[str]) -> bool:
    """Whether FlagEmbedding's rows of these columns give the teacher's scores as its two lists (no other
    score column)."""
    return set(FLAG_SCORES) <= keys and not keys & set(SCORE_COLUMNS)


def check_columns(
    file: Path,
    names: list[str] | None,
    dicts: bool,
    first: Any,
    keys: set[str],
    columns: Sequence[str],
    id_column: str,
    teacher: str,
) -> tuple[bool, str]:
    """(whether the rows have an id column, the teacher's scores column or ""); a DataError for a
    column that is not there or not allowed (`keys`: the file's columns; `dicts`: whether every row is a dict,
    `first` the first of them)."""
    if id_column and id_column in columns:
        raise DataError(
            f"data.pairs_id_column={id_column!r} is also in data.pairs_columns={list(columns)}: the id is not a "
            "text; take it out of one of them"
        )
    named = names is not None or dicts and bool(keys)  # JSON lines of objects name their columns too
    missing = [c for c in columns if named and c not in keys]
    if missing:
        shown = ", ".join(names if names is not None else sorted(keys))
        raise DataError(f"{file}: no column {missing[0]!r} (columns: {shown}); fix data.pairs_columns")
    if id_column and id_column not in keys and id_column != "id":
        raise DataError(
            f"data.pairs_id_column={id_column!r}: {file} has no such column (columns: {', '.join(map(str, keys))}); "
            "name the positive's id column, or set it to '' for none"
        )
    has_ids, scored = bool(id_column) and id_column in keys, [c for c in SCORE_COLUMNS if c in keys]
    if teacher and tuple(columns) == FLAG_TEXTS and _flag_scored(keys):
        return has_ids, FLAG_SCORED
    if teacher:
        if len(scored) != 1 or names is None and not dicts:
            raise DataError(
                f"loss.distill={teacher}: {file} needs the teacher's scores in one named column, label, labels, score "
                f"or scores, or FlagEmbedding's {' and '.join(FLAG_SCORES)} (found: {', '.join(scored) or 'none'}); "
                "add it, or leave loss.distill empty"
            )
        return has_ids, scored[0]
    if scored and not columns:
        if len(scored) == 1 and _score_list(None if first is None else first.get(scored[0])):
            logger.info(
                f"{file}: the teacher's scores in its {scored[0]!r} column are not read (loss.distill reads them)"
            )
            return has_ids, scored[0]
        raise DataError(
            f"{file}: a {scored[0]!r} column: scored pairs train with loss.distill=cosent (CoSENT), which reads it; "
            "set it, drop the column, or name the text columns in data.pairs_columns"
        )
    texts = [k for k in (names if names is not None else sorted(keys)) if k != id_column]
    if not columns and named and len(texts) == 1:
        raise DataError(
            f"{file}: its rows hold one text column, {texts[0]!r}, and a row is a query and its positive: give both, "
            f"or train each text as its own positive (unsupervised SimCSE: the model's dropout makes the two views) "
            f'with data.pairs_columns = ["{texts[0]}", "{texts[0]}"]'
        )
    return has_ids, ""


def _score_list(value: Any) -> bool:
    """Whether a score column's value is a list of scores (a teacher's, of a row's documents), not one label."""
    value = parsed(value)
    return isinstance(value, (list, tuple)) and len(value) >= 2
