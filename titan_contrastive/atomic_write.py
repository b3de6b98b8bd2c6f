"""One way to write a file that a reader sees whole or not at all.

`write_atomically(path, write)` calls `write(temporary path)` on a fresh hidden file beside `path`
(`.NAME.tmp-XXXX<suffix>`: same folder, so the rename stays on one file system; unique, so two
writers never share it; the target's suffix kept, so writers that choose a format by suffix (PIL,
parquet) still do), gives it the permissions a plain `open` would (mkstemp makes 0600), then renames
it over `path`. If `write` raises, or the process is interrupted by an exception, the temporary file
is removed and `path` is untouched. Checkpoint folders keep their own protocol (manifest, fsync,
folder rename: `checkpoint/writer.py`), as does `export.py`'s folder swap.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomically(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` into a hidden temporary file beside `path`, then the rename onto `path`."""
    path = Path(path)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-", suffix=path.suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        tmp.chmod(0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text_atomically(path: str | os.PathLike, text: str) -> Path:
    """`text` (UTF-8) into `path` through `write_atomically`."""
    return write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
