"""Documents by id for vl_pairs rows (`data.corpus`): tevatron's multimodal rows (`query_text`, `query_image`,
`positive_document_ids`, `negative_document_ids`) beside a corpus of `{docid, image, text}` rows, as tevatron's
`TrainDataset` reads them (DSE's page screenshots, OmniEmbed's sets).

A corpus row is an id (`corpus.ID_COLUMNS`), an `image` (a path, relative to the corpus file's folder or to
`data.image_root`, or the image held in the cell: `held_images`) and a `text` (`text` or `contents`, a `title` before
it as a text corpus reads one); only the documents the rows name are kept, chosen by Arrow where the corpus is a
table (`corpus.numbered_rows`). A row's ids become its documents (`resolved_rows`): its first positive its `doc_image`
and `doc_text`, all its positives `doc_positives` where it names several (an epoch serves one of them,
`pools.Pools`, with `data.negatives_per_row`), its negatives `doc_negatives` of the documents' kind. A document the
corpus does not hold is an empty one, so its row is a bad sample when it is served (counted; the next good row takes
its slot), and the load says how many rows name one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.corpus import ID_COLUMNS, TEXT_COLUMNS, corpus_files, numbered_rows
from titan_contrastive.datasets.held_images import ImageStore
from titan_contrastive.datasets.pair_rows import cell_text, doc_id
from titan_contrastive.datasets.sources import rooted
from titan_contrastive.datasets.tables import guarded_rows
from titan_contrastive.datasets.vl_rows import as_list

__all__ = ["NEGATIVE_IDS", "POSITIVES_COLUMN", "POSITIVE_IDS", "by_id", "read_corpus", "resolved_rows"]

POSITIVE_IDS, NEGATIVE_IDS = "positive_document_ids", "negative_document_ids"
POSITIVES_COLUMN = "doc_positives"
"""A row's positives where it names several: `{"image", "text"}` documents, one served per epoch."""
EMPTY = {"image": "", "text": ""}


def by_id(row: dict[str, Any]) -> dict[str, Any]:
    """A row of document ids in the columns `vl_files` keeps: its positives' ids under `POSITIVES_COLUMN`, its
    negatives' under `doc_negatives` (until `resolved_rows` puts the documents in their place)."""
    out = {k: v for k, v in row.items() if k not in (POSITIVE_IDS, NEGATIVE_IDS)}
    out[POSITIVES_COLUMN] = [doc_id(v) for v in as_list(row.get(POSITIVE_IDS))]
    out["doc_negatives"] = [doc_id(v) for v in as_list(row.get(NEGATIVE_IDS))]
    return out


def read_corpus(path: str, wanted: set[str], store: ImageStore, image_root: Path | None) -> dict[str, dict[str, str]]:
    """{id: {"image": absolute path or "", "text": text or ""}} of the `wanted` documents of the corpus at `path`; a
    DataError naming data.corpus for a row of no id, or an id given two documents."""
    docs: dict[str, dict[str, str]] = {}
    for file in corpus_files(path, "data.corpus", "an id, and an image or a text"):
        root = str((image_root or file.parent).absolute())
        for n, row in guarded_rows(file, numbered_rows(file, wanted, ("image", *TEXT_COLUMNS))):
            ident = next((c for c in ID_COLUMNS if c in row), None) if isinstance(row, dict) else None
            if ident is None:
                raise DataError(
                    f"{file} row {n + 1}: a vl_pairs corpus row holds an id ({'/'.join(ID_COLUMNS)}) and an image "
                    "and/or a text; fix data.corpus"
                )
            key = doc_id(row[ident])
            if key not in wanted:
                continue
            image = store.path(row.get("image"))
            text = next((row[c] for c in TEXT_COLUMNS if isinstance(row.get(c), str)), "")
            doc = {
                "image": rooted(root, image) if isinstance(image, str) and image.strip() else "",
                "text": cell_text({"title": row.get("title"), "text": text}),
            }
            if docs.setdefault(key, doc) != doc:
                raise DataError(
                    f"data.corpus={path}: document {key!r} is given two documents ({file} row {n + 1} differs from "
                    "an earlier row); give each document one id"
                )
    return docs


def resolved_rows(
    rows: Sequence[Sequence[Any]], columns: Sequence[str], docs: dict[str, dict[str, str]], doc_kind: str
) -> Iterator[list[Any]]:
    """`rows` (values of `columns`, read `by_id`) with their documents in place of their ids (module docstring):
    negatives as texts, image paths or `{"image", "text"}` objects by the documents' kind `doc_kind`."""
    for values in rows:
        row = dict(zip(columns, values))
        positives = [docs.get(i, EMPTY) for i in row[POSITIVES_COLUMN]]
        first = positives[0] if positives else EMPTY
        row["doc_image"], row["doc_text"] = first["image"], first["text"]
        row[POSITIVES_COLUMN] = positives if len(positives) > 1 else []
        negatives = [docs.get(i, EMPTY) for i in row["doc_negatives"]]
        row["doc_negatives"] = [n if doc_kind == "multi" else n[doc_kind] for n in negatives]
        yield [row.get(c) for c in columns]
