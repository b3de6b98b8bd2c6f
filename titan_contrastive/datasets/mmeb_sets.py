"""MMEB's evaluation sets (VLM2Vec's MMEB-eval, `TIGER-Lab/MMEB-eval`), read for `components/mmeb_eval.py`: each row
a query (`qry_text`, `qry_img_path`) and its own candidates (`tgt_text`, `tgt_img_path`: two lists side by side, the
right candidate first). A set is a file (.parquet, .jsonl, .json, .arrow, a saved dataset) named by its stem,
or a folder's files: each file a set, and each sub-folder's files one set named by the sub-folder (the hub's layout,
`ImageNet-1K/test-00000-of-00001.parquet`). Image paths are relative to `image_root` (VLM2Vec's `image_dir`, where
its `eval_images` were unpacked), else to the file's folder; a side's kind (text, image, or multi: an image and a
text) is what the set's items hold, and VLM2Vec's image placeholders leave the texts (`vl_rows.plain_text`: the run's
templates place each image). Every image is checked to exist when the set is read, before any compute."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.formats import data_suffix
from titan_contrastive.datasets.retrieval import MODES
from titan_contrastive.datasets.tables import column_rows
from titan_contrastive.datasets.vl_rows import as_list, plain_text, written

__all__ = ["COLUMNS", "MmebSet", "read_mmeb"]

COLUMNS = ("qry_text", "qry_img_path", "tgt_text", "tgt_img_path")
SUFFIXES = (".parquet", ".jsonl", ".json", ".arrow")

ROOT_KEYS = ("eval.mmeb_path", "eval.mmeb_image_root")
"""The settings a reading error names: the sets' path and their images' folder (the trainer's; `evaluate`'s flags)."""

Item = tuple[str, str]
"""(text, image path): "" for what the item lacks."""


@dataclass(frozen=True)
class MmebSet:
    """One MMEB task: its distinct queries and candidates, and each row's query and candidates by index (the right
    one first)."""

    queries: list[Item]
    candidates: list[Item]
    rows: list[tuple[int, np.ndarray]]
    """Per row, its query's index and its candidates' (int32: MMEB's 1,000 a row over 36 tasks stay small)."""
    mode: str
    """The retrieval mode of its queries' and candidates' kinds (`retrieval.MODES`): m2t for classification and VQA."""


def read_mmeb(path: str, image_root: str = "", keys: tuple[str, str] = ROOT_KEYS) -> dict[str, MmebSet]:
    """The sets at `path` by name (see the module docstring); a DataError, one line naming `keys` (the path's and the
    image root's setting), for a path that holds none, a file without MMEB's columns, an item without its side's
    image, or an image that is not there."""
    where = Path(path).expanduser()
    key = keys[0]
    if where.is_file() or _readable(where):
        groups = {where.name.split(".")[0]: [where]}
    elif where.is_dir():
        groups = {f.name.split(".")[0]: [f] for f in sorted(where.iterdir()) if _readable(f)}
        for folder in sorted(p for p in where.iterdir() if p.is_dir() and not _readable(p)):
            files = sorted(f for f in folder.iterdir() if _readable(f))
            if files:
                groups[folder.name] = files
    else:
        raise DataError(f"{key}={path!r} is neither a file nor a folder; give an MMEB-eval set or a folder of them")
    if not groups:
        raise DataError(
            f"{key}={path!r}: no set in it (files {', '.join(SUFFIXES)}, or folders of them); give MMEB-eval's files"
        )
    root = Path(image_root).expanduser() if image_root else None
    return {name: _read_set(files, root, keys) for name, files in groups.items()}


def _readable(file: Path) -> bool:
    """A table file, or a saved dataset's folder."""
    if file.is_dir():
        return (file / "dataset_info.json").is_file() or (file / "dataset_dict.json").is_file()
    return data_suffix(file) in SUFFIXES


def _read_set(files: list[Path], root: Path | None, keys: tuple[str, str]) -> MmebSet:
    key = keys[0]
    queries: dict[Item, int] = {}
    candidates: dict[Item, int] = {}
    rows: list[tuple[int, np.ndarray]] = []
    for file in files:
        table = column_rows(file, COLUMNS, "test", f"{key}: {file}")
        base = root or file.parent
        for n, row in enumerate(table):
            texts, images = as_list(row["tgt_text"]), as_list(row["tgt_img_path"])
            if not texts and not images or texts and images and len(texts) != len(images):
                raise DataError(
                    f"{key}: {file} row {n}: {len(texts)} candidate text(s) beside {len(images)} image path(s); "
                    'give one of each per candidate ("" for none), the right one first'
                )
            query = _item(row["qry_text"], row["qry_img_path"], base)
            pairs = zip(texts or [""] * len(images), images or [""] * len(texts))
            own = [candidates.setdefault(_item(t, i, base), len(candidates)) for t, i in pairs]
            rows.append((queries.setdefault(query, len(queries)), np.array(own, dtype=np.int32)))
    kinds = tuple(_kind(list(items), side, files[0], key) for side, items in (("query", queries), ("doc", candidates)))
    mode = next(m for m, k in MODES.items() if k == kinds)
    _check_images([i for items in (queries, candidates) for _, i in items if i], files[0], keys)
    return MmebSet(list(queries), list(candidates), rows, mode)


def _item(text: Any, image: Any, base: Path) -> Item:
    path = written(image).strip()
    return plain_text(written(text)), str(base / path) if path else ""


def _kind(items: list[Item], side: str, file: Path, key: str) -> str:
    """The kind the side's items hold: multi where some hold an image and some a text, image or text where all hold
    only that; a DataError where an item lacks the image its side's others have."""
    imaged = [bool(i) for _, i in items]
    texted = any(t for t, _ in items)
    if any(imaged) and not all(imaged):
        n = imaged.index(False)
        raise DataError(
            f"{key}: {file}: a {side} without an image ({items[n][0][:40]!r}) beside {side}s with one; an MMEB set's "
            f"{side}s are of one kind"
        )
    return "multi" if all(imaged) and texted else "image" if all(imaged) else "text"


def _check_images(paths: list[str], file: Path, keys: tuple[str, str]) -> None:
    gone = [p for p in dict.fromkeys(paths) if not Path(p).is_file()]
    if gone:
        raise DataError(
            f"{keys[0]}: {file}: {len(gone)} image(s) not found, the first {gone[0]!r}; set {keys[1]} to the folder "
            "MMEB's images were unpacked in (the rows' paths are relative to it)"
        )
