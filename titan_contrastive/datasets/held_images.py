"""Images held in a table's cells, as files: a Parquet file's Hugging Face `Image` column (each cell `{"bytes",
"path"}`, as `datasets` and the hub write it) or a column of encoded image bytes becomes paths, so that vl_pairs rows
read them as images on disk, the rows themselves staying small (`packed_rows`).

Each image is written once, named by its key (`image_keys.image_key`: the SHA-1 of its bytes, what a frozen model's
embeddings are keyed by, so the same as for the image saved as a file by hand), in a folder per two first hex digits,
through `atomic_write`; an image already there is not written again (by another run). The ranks of a machine share
the writing (`ImageStore`'s `share`: each writes the images whose key falls to its local rank, then waits for the
others, `vl_pairs`), so each machine holds every image in its own cache folder, or in one all machines share. A cell
of no bytes is its `path`, read as any image path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from titan_contrastive.atomic_write import write_atomically
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.image_keys import image_key

__all__ = ["ImageStore", "default_folder", "held", "local_share"]


def default_folder() -> Path:
    """`data.image_cache`'s default: `titan_contrastive/images` in the user's cache folder (`$XDG_CACHE_HOME`, else
    `~/.cache`), as Hugging Face's caches are placed."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "titan_contrastive" / "images"


def local_share() -> tuple[int, int]:
    """(this process's rank on its machine, the ranks on it), as torchrun gives them (`LOCAL_RANK`,
    `LOCAL_WORLD_SIZE`); (0, 1) outside torchrun."""
    return int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def held(value: Any) -> bool:
    """Whether a cell holds an image rather than its path: encoded bytes, or a `{"bytes", "path"}` struct."""
    return isinstance(value, (bytes, bytearray)) or isinstance(value, dict) and "bytes" in value


class ImageStore:
    """Writes the images held in cells to `folder` (`data.image_cache`) and gives their paths; `images` counts the
    cells it was given, `written` the files it wrote (the others were there, or fall to another rank). `share`: (this
    process's local rank, the local world size): it writes the images whose key falls to it, by the key's value."""

    def __init__(self, folder: str | os.PathLike, share: tuple[int, int] = (0, 1)) -> None:
        self.folder, self.share = Path(folder).expanduser(), share
        self.images = self.written = 0
        self._made: set[Path] = set()  # the folders this store has made (or found): one mkdir each

    def path(self, value: Any) -> Any:
        """The path of the image `value` holds (its file, written now unless there); a struct without bytes: its own
        `path`; any other value as it is."""
        if not held(value):
            return value
        data, named = (value.get("bytes"), value.get("path")) if isinstance(value, dict) else (value, None)
        if not data:
            return named or ""
        data = bytes(data)
        digest = image_key(data)
        suffix = Path(named).suffix.lower() if isinstance(named, str) else ""
        file = self.folder / digest[:2] / (digest + (suffix if suffix[1:].isalnum() else ""))
        self.images += 1
        rank, world = self.share
        if int(digest[:8], 16) % world == rank and not file.is_file():
            try:
                if file.parent not in self._made:
                    file.parent.mkdir(parents=True, exist_ok=True)
                    self._made.add(file.parent)
                write_atomically(file, lambda tmp: tmp.write_bytes(data))
            except OSError as e:
                raise DataError(
                    f"data.image_cache={str(self.folder)!r}: cannot write the images held in the rows' cells there "
                    f"({type(e).__name__}: {e}); set data.image_cache to a writable folder"
                ) from None
            self.written += 1
        return str(file)
