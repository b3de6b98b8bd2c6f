"""A `data.path` that names several files of one dataset: a glob pattern (`data/train-*.parquet`; `**` reaches
into subfolders) or a folder of data files that is no `save_to_disk` folder, as a Hugging Face dataset
repository's snapshot holds them (`train-00000-of-00004.parquet`, ...). Its files are read in sorted order as
one source of rows; `::` still joins sources, each with its own weight and prompts."""

from __future__ import annotations

import glob
import re
from collections.abc import Collection
from pathlib import Path

from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.formats import data_suffix, file_kind, formats_named

__all__ = ["is_pattern", "shard_files"]

SAVED = ("dataset_dict.json", "state.json")
"""What a `save_to_disk` folder holds (a DatasetDict's, a Dataset's): such a folder is one dataset."""

METADATA = ("dataset_info.json", "dataset_infos.json", *SAVED)
"""JSON files that say what a dataset is, never its rows (a Hugging Face repository's, a saved dataset's)."""

ASIDE = (".json", ".txt")
"""Formats whose files beside files of another format say what those are (a `shards.json`, a `LICENSE.txt`)."""


SPLIT_SHARD = re.compile(r"^(?P<split>.+)-\d{5}-of-\d{5}\.")
"""A Hugging Face repository's shard name, `{split}-00000-of-00004.parquet`: the split it belongs to."""


def is_pattern(path: str) -> bool:
    return any(c in path for c in "*?[")


def shard_files(path: str, suffixes: Collection[str], field: str = "data.path") -> list[Path] | None:
    """The data files `path` names when it names several (see the module), sorted: a pattern's matches or a
    folder's own files with one of `suffixes` (other files are not data, nor `METADATA`, nor `ASIDE` files beside files
    of another format: a `shards.json`, a `_stats.json`, a `README.txt`). None for anything else: one file,
    a `save_to_disk` folder, a path that does not exist (its reader says so). A DataError, one line naming the
    `field`, when the pattern or folder holds no such file, files of more than one format, or (a folder) the shards of
    more than one split (`SPLIT_SHARD`: a repository's `train-*` beside its `test-*`, MMEB-train's `original-*`
    beside `diverse_instruction-*`), which would be read as one source."""
    target = Path(path).expanduser()
    if is_pattern(path):
        found = [Path(p) for p in glob.glob(str(target), recursive=True)]
        where = f"{field}={path}: the pattern matches"
    elif target.is_dir() and not any((target / name).is_file() for name in SAVED):
        found = list(target.iterdir())
        where = f"{field}={path}: the folder (not a save_to_disk folder) holds"
    else:
        return None
    files = sorted(p for p in found if p.is_file() and data_suffix(p) in suffixes and p.name not in METADATA)
    if any(data_suffix(p) not in ASIDE for p in files):
        files = [p for p in files if data_suffix(p) not in ASIDE]
    if not files:
        raise DataError(f"{where} no {formats_named(suffixes)} file; point it at the dataset's data files")
    splits = sorted({m["split"] for m in map(SPLIT_SHARD.match, (p.name for p in files)) if m})
    if len(splits) > 1 and not is_pattern(path):
        shown = Path(path) / f"{'train' if 'train' in splits else splits[0]}-*{file_kind(files[0])}"
        raise DataError(
            f"{where} the shards of {len(splits)} splits ({', '.join(splits)}, by their names); name one, e.g. {shown}"
        )
    kinds = sorted({file_kind(p) for p in files})
    if len(kinds) > 1:
        raise DataError(
            f"{where} files of {len(kinds)} formats ({', '.join(kinds)}); name one format, e.g. "
            f"{Path(path) / ('*' + kinds[0]) if not is_pattern(path) else path.rsplit('.', 1)[0] + kinds[0]}"
        )
    return files
