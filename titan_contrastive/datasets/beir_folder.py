"""A retrieval set read from a local folder, text or page images (`read_beir`): a test set to evaluate on, or a
split's judged pairs to train on (`judged_pairs`, text pairs' rows).

- **BEIR's files**: `corpus.jsonl` (`_id`, `title`, `text`), `queries.jsonl` (`_id`, `text`), the two also
  compressed (`corpus.jsonl.gz`, as BeIR's Hugging Face repositories hold them; `formats.COMPRESSIONS`), and
  `qrels/{split}.tsv` (`query-id`, `corpus-id`, `score`). A document may name an image instead of or beside its
  text, `"image": "pages/p1.png"` (relative to the folder): a corpus of page images, every document with one.
- **Hugging Face datasets saved to disk**: `corpus/`, `queries/` and `qrels/` `save_to_disk` folders (qrels a
  DatasetDict by split), with MTEB's columns (`_id`, `title`, `text`) or ViDoRe's BEIR sets' (`corpus-id` and an
  `image` column of pages; `query-id`, `query`). Corpus and queries may be DatasetDicts by split too, one set per
  split: NanoBEIR's collections (`sentence-transformers/NanoBEIR-en`: splits `NanoSciFact`, ...; qrels without a
  score column, every listed pair relevant).
- **A dataset repository downloaded to the folder** with configs `corpus`, `queries` and `qrels` (NanoBEIR's and
  ViDoRe's BEIR sets, as `hf download ... --repo-type dataset` leaves them): read by datasets'
  `load_dataset(folder, config, split=...)`, as sentence-transformers' NanoBEIREvaluator reads the hub's copy; the
  same columns as saved to disk.
- **ViDoRe v1's question-answer layout**: one `save_to_disk` folder (a DatasetDict's `split`) with the columns
  `query`, `image` and `image_filename`, read as vidore-benchmark's `ViDoReEvaluatorQA` reads it: each distinct
  query (rows without one hold distractor pages) is relevant to the page of its (last) row, and a page is one
  document however many rows repeat it (by `image_filename`).

Images stay where they are until a batch needs them (`CorpusImages`: decoded per read, as uint8 HWC arrays), so a
corpus of thousands of pages costs its ids and texts in memory. Ids read as strings (ViDoRe's integer ids too);
the corpus is ordered by id, the evaluator's tie order (`retrieval_metrics.top_k`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.formats import COMPRESSIONS, open_text
from titan_contrastive.datasets.image_transforms import decode_image
from titan_contrastive.datasets.tar_shards import read_regular

__all__ = ["BeirSet", "CorpusImages", "beir_splits", "is_beir_folder", "judged_pairs", "read_beir"]

QRELS_HEADER = ["query-id", "corpus-id", "score"]
QA_COLUMNS = ("query", "image", "image_filename")
"""ViDoRe v1's question-answer layout."""


class CorpusImages(Sequence):
    """The corpus's images, read and decoded when indexed: uint8 HWC arrays. Each is a file (`refs` are paths), or
    a row of a saved dataset's `image` column (`table`, its images left encoded; `refs` are row numbers)."""

    def __init__(self, ids: Sequence[str], refs: Sequence[Any], table: Any = None, where: str = "") -> None:
        self.ids, self.refs, self.table, self.where = list(ids), list(refs), table, where

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, i: int) -> np.ndarray:  # type: ignore[override]
        ref = self.refs[i]
        try:
            if self.table is None:
                data: Any = read_regular(ref)
            else:
                cell = self.table[int(ref)]["image"]
                data = cell if isinstance(cell, Image.Image) else cell.get("bytes") or read_regular(cell["path"])
            return np.asarray(decode_image(data))
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            raise DataError(
                f"{self.where or ref}: document {self.ids[i]!r}: its image does not read ({type(e).__name__}: {e}); "
                "fix or drop it"
            ) from None


@dataclass(frozen=True)
class BeirSet:
    """One split of a retrieval set. `qrels[query_id][doc_id]` is a grade > 0 (score-0 rows are dropped)."""

    query_ids: list[str]
    queries: list[str]
    corpus_ids: list[str]  # ascending, the evaluator's tie order
    corpus: list[str]  # title + " " + text, stripped (BEIR's and sentence-transformers' convention); "" = none
    qrels: dict[str, dict[str, int]]
    images: CorpusImages | None = None
    """The documents' images in `corpus_ids` order, where the documents are pages (None: a text corpus)."""


def _beir_file(folder: Path, name: str) -> Path:
    """`folder / name` (`corpus.jsonl`), or its compressed copy where only that is there (`corpus.jsonl.gz`)."""
    return next((p for p in (folder / (name + s) for s in ("", *COMPRESSIONS)) if p.is_file()), folder / name)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, row) of a BEIR jsonl file."""
    if not path.is_file():
        raise DataError(f"{path}: not found; a BEIR folder holds corpus.jsonl, queries.jsonl and qrels/<split>.tsv")
    try:
        with open_text(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{path}:{n}", json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n}: not JSON ({e.msg}); write one JSON object per line") from None
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged compressed file: each decompressor's own error type
        raise DataError(f"{path}: not readable ({type(e).__name__}: {e})") from None


def _datasets(path: Path) -> Any:
    from titan_contrastive.datasets.hf_disk import import_datasets

    return import_datasets(f"eval.beir_path (a Hugging Face dataset folder: {path})")


def _load_from_disk(path: Path, split: str | None = None, only: bool = False) -> Any:
    """A `save_to_disk` folder's Dataset, or a DatasetDict's `split` (None, or `only` and no such split: its only
    split)."""
    datasets = _datasets(path)
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - datasets raises many types for an unreadable folder
        raise DataError(f"{path}: not a readable save_to_disk folder ({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.DatasetDict):
        name = split if split in ds else next(iter(ds)) if (split is None or only) and len(ds) == 1 else None
        if name is None:
            raise DataError(f"{path}: a DatasetDict without split {split!r} (splits: {', '.join(ds)}); save it")
        ds = ds[name]
    return _lazy_images(ds, datasets)


def _lazy_images(ds: Any, datasets: Any) -> Any:
    if "image" in ds.column_names and isinstance(ds.features["image"], datasets.Image):
        ds = ds.cast_column("image", datasets.Image(decode=False))  # read when a batch needs it, not now
    return ds


def _repo_splits(folder: Path, config: str) -> list[str]:
    """The splits of `config` in a dataset repository downloaded to `folder`."""
    try:
        return list(_datasets(folder).get_dataset_split_names(str(folder), config))
    except Exception as e:  # noqa: BLE001 - datasets raises many types for a folder it cannot read
        raise DataError(
            f"{folder}: no {config!r} config datasets can read ({type(e).__name__}: {e}); give corpus/, queries/ and "
            "qrels/ as save_to_disk folders, or a dataset repository with configs corpus, queries and qrels"
        ) from None


def _load_part(folder: Path, part: str, split: str, only: bool) -> Any:
    """`folder`'s corpus, queries or qrels: a `save_to_disk` folder, or the config `part` of a dataset repository
    downloaded to `folder` (NanoBEIR's, read by datasets' load_dataset as sentence-transformers reads it)."""
    if _is_saved_dataset(folder / part):
        return _load_from_disk(folder / part, split, only)
    names = _repo_splits(folder, part)
    name = split if split in names else names[0] if only and len(names) == 1 else None
    if name is None:
        raise DataError(
            f"{folder}: config {part!r} has no split {split!r} (splits: {', '.join(names)}); set eval.beir_split to "
            "one or more of them (or *)"
        )
    datasets = _datasets(folder)
    return _lazy_images(datasets.load_dataset(str(folder), part, split=name), datasets)


def _hf_rows(ds: Any, where: Path) -> tuple[Iterator[tuple[str, Any]], Any]:
    """((where, row) of a dataset's rows without their images, the image column or None)."""
    if "image" not in ds.column_names:
        return ((f"{where}[{n}]", row) for n, row in enumerate(ds)), None
    empty = ds.data.column("image").is_null().to_pylist()
    plain = ds.remove_columns(["image"])
    rows = ((f"{where}[{n}]", dict(row, image=None if empty[n] else n)) for n, row in enumerate(plain))
    return rows, ds.select_columns(["image"])


def _documents(
    rows: Iterable[tuple[str, Any]], what: str, root: Path | None, keep: set[str] | None = None
) -> dict[str, tuple[str, Any]]:
    """id -> (text, image reference or None) of BEIR rows: `_id` (ViDoRe: `corpus-id` / `query-id`); `title`
    (optional) before `text` (a ViDoRe query: `query`); an `image` (a path relative to `root`, or a row number).
    `keep`: the ids to keep (None: every one)."""
    keys = ("_id", "corpus-id" if what == "document" else "query-id")
    texts: dict[str, tuple[str, Any]] = {}
    for where, row in rows:
        key = next((row[k] for k in keys if isinstance(row, dict) and isinstance(row.get(k), (str, int))), None)
        if key is None:
            raise DataError(f"{where}: no string `_id` in {str(row)[:80]!r}; give every {what} an `_id`")
        if keep is not None and str(key) not in keep:
            continue
        title, image = row.get("title") or "", row.get("image")
        text = row.get("text", row.get("query", "" if image is not None else None))
        if not isinstance(text, str) or not isinstance(title, str):
            raise DataError(f"{where}: `text`/`title` of {key!r} is not a string; write them as strings")
        if isinstance(image, str) and root is not None:
            image = str(root / image) if image.strip() else None
        key = str(key)
        if key in texts:
            raise DataError(f"{where}: `_id` {key!r} appears twice; give every {what} its own `_id`")
        texts[key] = ((title + " " + text).strip(), image)
    return texts


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


def _grade(score: str, where: str) -> int:
    """A qrels row's score as an integer grade (a saved dataset's 1.0 too), or a DataError."""
    try:
        value = float(score)
        if value != int(value):
            raise ValueError(score)
    except (ValueError, OverflowError):
        raise DataError(f"{where}: score {score!r} is not an integer; write graded relevance as 0, 1, 2...") from None
    return int(value)


def _images(corpus: dict[str, tuple[str, Any]], ids: list[str], table: Any, where: str) -> CorpusImages | None:
    """The corpus's images in `ids` order: all documents have one, or none (else a DataError)."""
    without = [k for k in ids if corpus[k][1] is None]
    if len(without) == len(ids):
        return None
    if without:
        raise DataError(
            f"{where}: document {without[0]!r} has no image and {len(ids) - len(without)} others do; a corpus of "
            "pages gives every document its image"
        )
    return CorpusImages(ids, [corpus[k][1] for k in ids], table, where)


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_info.json").is_file() or (folder / "dataset_dict.json").is_file()


def read_beir(folder: str | Path, split: str = "test", judged_only: bool = False) -> BeirSet:
    """Read a local retrieval set (the module docstring's layouts); a DataError names what is wrong. `judged_only`:
    of the corpus, the documents the split's qrels name (a training set's rows), the others skipped as read."""
    folder = Path(folder)
    table, root = None, None
    corpus_file = _beir_file(folder, "corpus.jsonl")
    if corpus_file.exists() or not ((folder / "corpus").is_dir() or _is_saved_dataset(folder)):
        documents, root = _jsonl_rows(corpus_file), folder
        queries = _documents(_jsonl_rows(_beir_file(folder, "queries.jsonl")), "query", None)
        judgements: Iterable[tuple[str, Any]] = _tsv_rows(folder / "qrels" / f"{split}.tsv")
    elif not (folder / "corpus").is_dir():
        return _read_qa(folder, split)
    else:
        parts = {part: _load_part(folder, part, split, part != "qrels") for part in ("corpus", "queries", "qrels")}
        documents, table = _hf_rows(parts["corpus"], folder / "corpus")
        queries = _documents(_hf_rows(parts["queries"], folder / "queries")[0], "query", None)
        judgements = _hf_rows(parts["qrels"], folder / "qrels")[0]
    named = [  # (where, query-id, corpus-id, score); NanoBEIR's rows have no score
        (where, *(str(row.get(k, 1 if k == "score" else "")) for k in QRELS_HEADER)) for where, row in judgements
    ]
    corpus = _documents(documents, "document", root, {did for _, _, did, _ in named} if judged_only else None)
    qrels: dict[str, dict[str, int]] = {}
    for where, qid, did, score in named:
        grade = _grade(score, where)
        if qid not in queries:
            raise DataError(f"{where}: query-id {qid!r} is not in the queries; add the query or drop the row")
        if did not in corpus:
            raise DataError(f"{where}: corpus-id {did!r} is not in the corpus; add the document or drop the row")
        if grade > 0:
            qrels.setdefault(qid, {})[did] = grade
    ids = sorted(corpus)
    images = _images(corpus, ids, table, str(folder / "corpus" if table is not None else corpus_file))
    judged = [qid for qid in queries if qid in qrels]  # the split's own queries, as BEIR's loader keeps them
    if not judged:
        raise DataError(f"{folder}: split {split!r} has no query with a relevant document (a qrels score > 0)")
    return BeirSet(judged, [queries[q][0] for q in judged], ids, [corpus[c][0] for c in ids], qrels, images)


def is_beir_folder(path: str | Path) -> bool:
    """Whether `path` is a folder of a retrieval set's corpus and queries (BEIR's files, or saved datasets)."""
    folder = Path(path).expanduser()
    return folder.is_dir() and any(
        _beir_file(folder, f"corpus{suffix}").exists() and _beir_file(folder, f"queries{suffix}").exists()
        for suffix in (".jsonl", "")
    )


def judged_pairs(folder: str | Path, split: str) -> tuple[list[str], list[list[str]], list[list[str]]]:
    """(the split's queries, per query the texts of its relevant documents and their ids) of `read_beir(folder,
    split)`, in the queries' order and each query's qrels' order; a DataError for a corpus of page images."""
    beir = read_beir(folder, split, judged_only=True)
    if beir.images is not None:
        raise DataError(
            f"data.path={folder}: a corpus of page images, and text pairs read texts: train model.name='qwen_vl' on "
            "vl_pairs rows (query_text, doc_image)"
        )
    text = dict(zip(beir.corpus_ids, beir.corpus))
    ids = [list(beir.qrels[q]) for q in beir.query_ids]
    return beir.queries, [[text[d] for d in row] for row in ids], ids


def beir_splits(folder: str | Path, split: str) -> list[str]:
    """The qrels splits `split` names: one name, several separated by commas, or `*` for every one the folder has
    (BEIR's qrels/*.tsv, a saved DatasetDict's splits); a DataError if there are none."""
    names = [name.strip() for name in split.split(",") if name.strip()]
    if names != ["*"]:
        if not names or "*" in names:
            raise DataError(f"eval.beir_split={split!r}: give a split name, several separated by commas, or *")
        return names
    folder = Path(folder)
    if _beir_file(folder, "corpus.jsonl").exists():
        found = sorted(p.stem for p in (folder / "qrels").glob("*.tsv"))
    elif (folder / "corpus").is_dir() and not _is_saved_dataset(folder / "qrels"):
        found = _repo_splits(folder, "qrels")
    else:
        saved = folder / ("qrels" if (folder / "corpus").is_dir() else "") / "dataset_dict.json"
        found = json.loads(saved.read_text()).get("splits", []) if saved.is_file() else []
    if not found:
        raise DataError(f"eval.beir_split='*': {folder} has no qrels splits (qrels/*.tsv, or a saved DatasetDict)")
    return found


def _read_qa(folder: Path, split: str) -> BeirSet:
    """ViDoRe v1's question-answer layout (the module docstring)."""
    ds = _load_from_disk(folder, split)
    missing = [c for c in QA_COLUMNS if c not in ds.column_names]
    if missing:
        raise DataError(
            f"{folder}: a saved dataset without {', '.join(missing)}; a question-answer set has the columns "
            f"{', '.join(QA_COLUMNS)} (else save corpus/, queries/ and qrels/)"
        )
    queries, names = ds["query"], ds["image_filename"]
    pages: dict[str, int] = {}
    for n, name in enumerate(names):
        if not isinstance(name, str) or not name:
            raise DataError(f"{folder}[{n}]: image_filename {name!r}; give every row its page's file name")
        pages.setdefault(name, n)
    page_of = {q: name for q, name in zip(queries, names) if isinstance(q, str) and q.strip()}
    if not page_of:
        raise DataError(f"{folder}: no row has a query; a question-answer set needs queries beside its pages")
    ids = sorted(pages)
    texts = list(page_of)
    query_ids = [str(i) for i in range(len(texts))]
    qrels = {qid: {page_of[text]: 1} for qid, text in zip(query_ids, texts)}
    images = CorpusImages(ids, [pages[p] for p in ids], ds.select_columns(["image"]), str(folder))
    return BeirSet(query_ids, texts, ids, [""] * len(ids), qrels, images)
