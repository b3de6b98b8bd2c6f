"""Hugging Face `datasets` on local disk: opening one (`open_hf_dataset`, shared by the image-text
source `HfSource` and the text pairs of `pairs`) and the image-text source itself.

One place decides what a path means, so both loaders read a dataset folder alike and fail the
same way: a `save_to_disk` folder (a DatasetDict gives the split asked for), or a file (or a pattern or
folder of shards, `shards.py`) read with `load_dataset(<format>, data_files=...)` (image-text: Parquet /
JSON / Arrow / CSV; text pairs read their other formats themselves and take `.arrow` files here). The
hub is never contacted (HF_DATASETS_OFFLINE and HF_HUB_OFFLINE are set before `datasets` is imported), and
the package is imported only when used: it is the optional `[data]` extra.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.formats import data_suffix, formats_named
from titan_contrastive.datasets.shards import shard_files
from titan_contrastive.datasets.sources import (
    BadSample,
    Record,
    caption_text,
    first_negative_count,
    negative_captions,
    read_file,
)
from titan_contrastive.extras import import_failure

__all__ = ["HF_FORMATS", "HfSource", "import_datasets", "list_feature", "open_hf_dataset"]

HF_FORMATS: Mapping[str, str] = {
    ".parquet": "parquet",
    ".json": "json",
    ".jsonl": "json",
    ".arrow": "arrow",
    ".csv": "csv",
}
"""File suffix -> the `load_dataset` builder that reads it."""


def import_datasets(what: str) -> Any:
    """The `datasets` module, offline and quiet; a DataError naming the extra when it is missing
    (`what`: who needs it, for the message)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError as e:
        raise DataError(import_failure(e, what, "data")) from None
    datasets.disable_progress_bars()
    return datasets


def open_hf_dataset(path: str, split: str, *, kind: str = "hf", suffixes: Mapping[str, str] = HF_FORMATS) -> Any:
    """The `datasets.Dataset` at `path`: a `save_to_disk` folder (a DatasetDict: its `split`), a file whose
    suffix is in `suffixes`, or a pattern or folder of such files (`shards.shard_files`), read as one. Every
    failure is one DataError naming the path."""
    datasets = import_datasets(f"data.dataset={kind!r} (data.path={path})")
    target, files = Path(path).expanduser(), shard_files(path, suffixes)
    try:
        if files is not None:  # a pattern or a folder of shards: one dataset
            names = [str(f) for f in files]
            ds = datasets.load_dataset(suffixes[data_suffix(files[0])], data_files=names, split="train")
        elif target.is_dir():
            ds = datasets.load_from_disk(str(target))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DataError(
                        f"data.path={path}: a DatasetDict without split {split!r} (splits: {', '.join(ds)}); "
                        "save the split you want or point data.path at it"
                    )
                ds = ds[split]
        elif target.is_file() and data_suffix(target) in suffixes:
            ds = datasets.load_dataset(suffixes[data_suffix(target)], data_files=str(target), split="train")
        else:
            raise DataError(
                f"data.path={path}: not a save_to_disk folder or a {formats_named(suffixes)} file; "
                "give one of those (nothing is fetched from the hub)"
            )
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many types for an unreadable folder or file
        raise DataError(f"data.path={path}: not a readable Hugging Face dataset ({type(e).__name__}: {e})") from None
    return ds


def list_feature(feature: Any) -> Any | None:
    """The element feature of a list-valued column (`List`, `LargeList`, older `Sequence`), else None."""
    datasets = import_datasets("a Hugging Face column")
    kinds = tuple(
        t for t in (getattr(datasets, n, None) for n in ("List", "LargeList", "Sequence")) if isinstance(t, type)
    )
    if isinstance(feature, list):  # a bare [Value] in a features dict
        return feature[0] if feature else None
    return feature.feature if kinds and isinstance(feature, kinds) else None


class HfSource:
    """A Hugging Face `datasets` dataset on local disk: a `save_to_disk` folder, or Parquet / JSON
    / Arrow / CSV files read with `load_dataset(<format>, data_files=...)` (`open_hf_dataset`; never a hub
    download). Images: an `Image` column (read undecoded), bytes, or paths. `negative_columns`:
    string columns of negative captions, or one column holding a list of them."""

    def __init__(
        self,
        path: str,
        *,
        image_column: str = "image",
        text_column: str = "text",
        split: str = "train",
        negative_columns: Sequence[str] = (),
    ) -> None:
        ds = open_hf_dataset(path, split)
        datasets = import_datasets("data.dataset='hf'")
        self.location, self.losses = path, []
        missing = [c for c in (image_column, text_column) if c not in ds.column_names]
        if missing:
            raise DataError(
                f"{path}: no column {missing[0]!r} (columns: {', '.join(ds.column_names)}); "
                "set data.hf_image_column / data.hf_text_column"
            )
        if isinstance(ds.features[image_column], datasets.Image):
            ds = ds.cast_column(image_column, datasets.Image(decode=False))  # decode here, where a bad image is counted
        self._ds, self._image, self._text = ds, image_column, text_column
        target, files = Path(path).expanduser(), shard_files(path, HF_FORMATS)
        self._folder = files[0].parent if files else target.parent if target.is_file() else target  # relative paths
        self._negative_columns = list(negative_columns)
        self.num_negatives = self._count_negatives(ds, path, self._negative_columns)

    @staticmethod
    def _count_negatives(ds: Any, path: str, columns: list[str]) -> int:
        """Negative captions per row: one per string column, or the first row's count of one list column."""
        fix = f"fix data.hf_negative_columns={columns}: string columns, or one column of lists of strings"
        for c in columns:
            if c not in ds.column_names:
                raise DataError(f"{path}: no column {c!r} (columns: {', '.join(ds.column_names)}); {fix}")
            element = list_feature(ds.features[c])
            if getattr(ds.features[c] if element is None else element, "dtype", None) not in ("string", "large_string"):
                raise DataError(f"{path}: column {c!r} holds {ds.features[c]}, not captions; {fix}")
        lists = [c for c in columns if list_feature(ds.features[c]) is not None]
        if not lists:
            return len(columns)
        if len(columns) > 1:
            raise DataError(f"{path}: {lists[0]!r} holds lists beside other columns; {fix}")
        setting = f"data.hf_negative_columns={columns}"
        return first_negative_count(lambda i: [ds[i][lists[0]]], len(ds), setting, path)

    def __len__(self) -> int:
        return len(self._ds)

    def read(self, index: int) -> Record:
        row, key = self._ds[index], f"row {index}"
        image = row[self._image]
        if isinstance(image, dict):  # datasets.Image(decode=False): {"bytes", "path"}
            image = image.get("bytes") or image.get("path")
        if isinstance(image, str):
            path = Path(image) if os.path.isabs(image) else self._folder / image
            image = read_file(str(path), self.location, key)
        if image is None:
            raise BadSample("missing_image", self.location, key)
        caption = caption_text(row[self._text], self.location, key)
        values = [row[c] for c in self._negative_columns]
        negatives = negative_captions(values, self.num_negatives, self.location, key) if self.num_negatives else ()
        return Record(image, caption, self.location, key, negatives)
