"""How a checkpoint folder is written (`reader.py` is how it is read): the per-rank states as
pickled bytes, the manifest with every file's size and SHA-256, the rename into place, the test for
a full disk, and a save that finishes in the background (`[checkpoint] async_mode`).

A background save (torchtitan's `async_mode = "async"`): `dcp.async_save` copies the state to
host memory before it returns (the training step that follows cannot change what is saved), then
writes the files in a thread; a thread of ours waits for them and finishes the save exactly as a
synchronous one does (barrier, manifest with checksums on rank 0, rename, pruning), on a process
group of its own (gloo), so that the training loop's collectives never interleave with the save's.
The next save, the last step's save and a stop's save wait for it first; an error in it (a full
disk, a failed write) is raised there, in the training loop, as the synchronous save would have.
`async_mode = "async_with_pinned_mem"` (torchtitan's name) keeps that host copy between saves
(`reused_stager`) and fills it in a thread of DCP's (on CUDA on a stream of its own) while the next step
computes its forward and backward: the save returns at once, and the training loop calls the manager's
`wait_for_staging` before the optimizer step, the first write to the state. The next save waits for the
one before, so no write reads a copy being refilled.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.stateful import Stateful

from titan_contrastive.checkpoint import reader
from titan_contrastive.checkpoint.reader import MANIFEST, CheckpointError, describe
from titan_contrastive.components.preflight import free_bytes

__all__ = [
    "BackgroundSave",
    "PickledState",
    "failing_as",
    "fsync_dir",
    "install",
    "out_of_space",
    "reused_stager",
    "stager_survives_reuse",
    "write_manifest",
    "written",
]


class PickledState:
    """Stores a per-rank Stateful as one pickled bytes object (why: `manager.py`'s docstring), read
    back with the allowlisting unpickler (`reader.unpickle_state`)."""

    def __init__(self, inner: Stateful, key: str) -> None:
        self.inner = inner
        self.key = key

    def state_dict(self) -> dict[str, bytes]:
        return {"pickle": pickle.dumps(self.inner.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(reader.unpickle_state(state_dict["pickle"], f"checkpoint item {self.key!r}"))


def out_of_space(exc: BaseException, folder: Path) -> bool:
    """Whether a failed save ran out of space: ENOSPC anywhere in the error (DCP wraps each rank's),
    or a nearly full folder (torch's zip writer reports a short write as "unexpected pos")."""
    todo, seen = [exc], set()
    while todo:
        error = todo.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        if (isinstance(error, OSError) and error.errno == errno.ENOSPC) or "No space left on device" in str(error):
            return True
        if isinstance(error, CheckpointException):
            todo += [failure for failure, _ in error.failures.values()]
        todo += [e for e in (error.__cause__, error.__context__) if e is not None]
    return free_bytes(folder) < 1 << 20


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_manifest(tmp: Path, record: dict[str, Any]) -> None:
    """`record` plus {"files": {relative path: {"bytes", "sha256"}}} of every file under `tmp`, as
    `tmp/manifest.json`, flushed to disk before the folder is renamed."""
    files = {
        p.relative_to(tmp).as_posix(): {"bytes": p.stat().st_size, "sha256": reader.sha256(p)}
        for p in sorted(tmp.rglob("*"))
        if p.is_file()
    }
    with open(tmp / MANIFEST, "w") as f:
        json.dump({**record, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def install(tmp: Path, final: Path) -> None:
    """Rename the finished `tmp` to `final`, replacing an older save of the same step (a run that
    restarted from an earlier checkpoint): the old one is set aside first, removed after."""
    stale = final.with_name(final.name + ".stale")
    if final.exists():
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(final, stale)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(stale, ignore_errors=True)


def reused_stager() -> DefaultStager:
    """DCP's stager with its cache: the first save allocates the host copy of each tensor (pinned where
    CUDA is available, so the device-to-host copy runs at full bandwidth), later saves copy into it.
    The copy runs in the stager's thread (`dcp.async_save` returns before it is done; the stager's
    `synchronize_staging` waits for it), on CUDA as non-blocking copies on the stager's stream."""
    cuda = torch.cuda.is_available()
    options = StagingOptions(
        use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=cuda
    )
    return DefaultStager(options)


def stager_survives_reuse() -> bool:
    """Whether a DCP stager can copy twice. torch 2.11's closes its cache at the end of every copy, and
    the next copy then fails (KeyError; pytorch/pytorch#183413, fixed in later releases): there the
    manager makes a fresh stager for each save, which allocates its host copy anew."""
    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        for _ in range(2):
            stager.stage({"probe": torch.zeros(1)})
        return True
    except KeyError:
        return False
    finally:
        stager.close()


@contextlib.contextmanager
def failing_as(what: str) -> Iterator[None]:
    """A DCP error as a one-line CheckpointError that names the checkpoint. DCP gathers the errors of
    all ranks into one CheckpointException (a BaseException, so `except Exception` misses it) on
    every rank, so all ranks raise together."""
    try:
        yield
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"{what} failed: {describe(exc)}") from exc


def written(future: Future, what: str) -> None:
    """Wait for a background DCP write (in the save's thread)."""
    with failing_as(what):
        future.result()


class BackgroundSave:
    """At most one save finishing in a thread; `wait` joins it and raises what it raised."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, finish: Callable[[], None]) -> None:
        self.wait()

        def run() -> None:
            try:
                finish()
            except BaseException as exc:  # noqa: BLE001 - handed to the training loop by `wait`
                self._error = exc

        self._thread = threading.Thread(target=run, name="checkpoint-save", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is None:
            return
        self._thread.join()
        self._thread, error, self._error = None, self._error, None
        if error is not None:
            raise error
