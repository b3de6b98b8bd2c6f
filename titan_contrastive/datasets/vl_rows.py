"""A vl_pairs row's cells as `vl_pairs` reads them: VLM2Vec's MMEB-train columns and colpali-engine's training set's
taken as ours (`from_vlm2vec`, `from_colpali`; VLM2Vec's texts without its image placeholders, `plain_text`), a
negatives cell as a list (`as_list`) and a negative's text and image path (`negative_parts`), a text or path as
written (`written`)."""

from __future__ import annotations

import itertools
import re
from typing import Any

__all__ = [
    "COLPALI",
    "VLM2VEC",
    "as_list",
    "from_colpali",
    "from_vlm2vec",
    "negative_parts",
    "plain_text",
    "written",
]

VLM2VEC = {"qry": "query_text", "qry_image_path": "query_image", "pos_text": "doc_text", "pos_image_path": "doc_image"}
"""VLM2Vec's MMEB-train columns -> ours; its hard negatives' `neg_text` / `neg_image_path` (a value or a list each, the
two lists side by side) become `doc_negatives` of the documents' kind (`from_vlm2vec`)."""
COLPALI = {"query": "query_text", "image": "doc_image"}
"""colpali-engine's training set's columns (vidore/colpali_train_set: a page `image`, a `query` of it) -> ours."""
NEGATIVES = {"text": ("neg_text",), "image": ("neg_image_path",), "multi": ("neg_text", "neg_image_path")}
"""The documents' kind -> the VLM2Vec columns its hard negatives are read from (multi: `{"image", "text"}` objects)."""

_PLACEHOLDER = re.compile(r"\s*(?:<\|image_1\|>|<image>)\s*")
"""The image tokens VLM2Vec writes into its texts (Phi-3-V's `<|image_1|>`, LLaVA's `<image>`), with the white space
around them."""


def plain_text(value: Any) -> Any:
    """A VLM2Vec text without its image placeholders (the run's templates place each image, `{image}`)."""
    return _PLACEHOLDER.sub(" ", value).strip() if isinstance(value, str) else value


def from_vlm2vec(row: dict[str, Any], doc_kind: str = "text") -> dict[str, Any]:
    """A row of VLM2Vec's columns (`qry` and none of ours) in ours, its texts without the image placeholders; its
    hard negatives (`NEGATIVES` of `doc_kind`, the documents' kind; VLM2Vec's empty ones left out) its
    `doc_negatives` where it has none. Any other row as it is."""
    if "qry" not in row or any(ours in row for ours in VLM2VEC.values()):
        return row
    out = {k: v for k, v in row.items() if k not in VLM2VEC}
    for theirs, ours in VLM2VEC.items():
        value = row.get(theirs)
        out[ours] = plain_text(value) if ours.endswith("_text") else value
    if "doc_negatives" not in row:
        texts, paths = (as_list(row.get(column)) for column in ("neg_text", "neg_image_path"))
        given = {"neg_text": [plain_text(t) for t in texts], "neg_image_path": paths}
        pairs = itertools.zip_longest(*(given[c] for c in NEGATIVES.get(doc_kind, ())), fillvalue="")
        kept = [pair for pair in pairs if any(map(_given, pair))]
        out["doc_negatives"] = (
            [{"text": t, "image": i} for t, i in kept] if doc_kind == "multi" else [p[0] for p in kept]
        )
    return out


def from_colpali(row: dict[str, Any]) -> dict[str, Any]:
    """A row of colpali-engine's columns (`query` and `image`, and none of ours) in ours; any other row as it is."""
    if not all(theirs in row for theirs in COLPALI) or any(ours in row for ours in COLPALI.values()):
        return row
    return {COLPALI.get(k, k): v for k, v in row.items()}


def _given(value: Any) -> bool:
    return bool(written(value).strip())


def written(value: Any) -> str:
    """A text or image path as written ("" for a value that is none)."""
    return value if isinstance(value, str) else ""


def as_list(value: Any) -> list[Any]:
    """A negatives cell as a list: a list (JSONL, Parquet) as it is, one non-empty value or object as one, else none."""
    if value is None or isinstance(value, str):
        return [value] if value and value.strip() else []
    if isinstance(value, dict):
        return [value]
    if isinstance(value, (list, tuple)):
        return list(value)
    return list(value.tolist()) if hasattr(value, "tolist") else [value]  # a list read as an array


def negative_parts(kind: str, value: Any) -> tuple[str, str]:
    """(text, image path) of a hard negative of documents of `kind` as written ("" for what it lacks or the kind does
    not read): a text, an image path, or a multi document's `{"image", "text"}` object."""
    if kind == "multi":
        return (written(value.get("text")), written(value.get("image"))) if isinstance(value, dict) else ("", "")
    return (written(value), "") if kind == "text" else ("", written(value))
