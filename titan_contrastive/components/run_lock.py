"""One run per run folder: a lock file in `job.dump_folder`, held from start-up to exit.

Why: two runs on one folder would overwrite each other's checkpoints and interleave their
`metrics.jsonl` lines, silently. Rank 0 creates `{dump_folder}/.titan_contrastive.lock`
(`LOCK_FILE`) with `os.open(O_CREAT | O_EXCL)`, atomic also on NFS, holding JSON
`{"pid", "host", "started", "pid_start"}`; it does so after the preflight folder check and before
anything else is written there, and shares the outcome with the other ranks so that all of them
stop together. A second run on a locked folder stops with one line (exit code 2) before any data
is read or any step computed. The lock is released at exit, also after errors; folders created
only to hold it are removed again when the run wrote nothing else in them (a run that fails at
start-up leaves no folder behind, as the preflight promises).

A lock left by a run that died without releasing it (SIGKILL, a crashed node): on the same host,
a holder whose pid is gone, or now belongs to a process started at another time (a reused pid),
is dead, and the lock is taken over with a warning. So is a lock written by an earlier incarnation
of the same Slurm job (same `SLURM_JOB_ID`, lower `SLURM_RESTART_COUNT`): Slurm requeues a job only
after it ended, possibly onto another node. Otherwise, on another host, nothing here can tell, so
the run stops naming the host and pid and how to remove the lock once that job is known dead.
Other tools that write into run folders recognise a run folder by this file.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from titan_contrastive.config import ConfigError

LOCK_FILE = ".titan_contrastive.lock"

logger = logging.getLogger("titan_contrastive")


class RunLockError(ConfigError):
    """The run folder is in use (or its lock cannot be made); the message says by whom and what to do (exit code 2)."""


def _process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat field 22), None where unknown."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(holder: dict[str, Any]) -> bool:
    """Whether the lock's holder (on this host) still runs: its pid exists and started when it says."""
    pid = int(holder["pid"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    started = holder.get("pid_start")
    return started is None or _process_start(pid) in (None, started)


def _slurm() -> dict[str, Any]:
    """This process's Slurm job id and restart count (empty outside Slurm)."""
    job = os.environ.get("SLURM_JOB_ID")
    return (
        {"slurm_job_id": job, "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)}
        if job
        else {}
    )


def _earlier_incarnation(holder: dict[str, Any]) -> bool:
    """Whether the holder is this Slurm job before a requeue (it has ended: Slurm requeues ended jobs)."""
    me = _slurm()
    if not me or holder.get("slurm_job_id") != me["slurm_job_id"]:
        return False
    try:
        return int(holder.get("slurm_restart_count", 0)) < me["slurm_restart_count"]
    except (TypeError, ValueError):
        return False


def _describe(holder: dict[str, Any]) -> str:
    started = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"]))
        if "started" in holder
        else "at an unknown time"
    )
    return f"pid {holder['pid']} on host {holder['host']} (started {started})"


class RunLock:
    """The lock of one run folder: `acquire` on every rank (rank 0 takes it), `release` at exit."""

    def __init__(self) -> None:
        self.path: Path | None = None  # set while held
        self._content = ""
        self._created: list[Path] = []  # folders made to hold the lock, outermost first

    def acquire(self, folder: str | Path, *, rank: int, distributed: bool) -> None:
        """Take the lock of `folder` on rank 0; every rank raises RunLockError when it is held elsewhere."""
        error = None
        if rank == 0:
            try:
                self._take(Path(folder).absolute())
            except RunLockError as exc:
                error = str(exc)
            except OSError as exc:
                error = (
                    f"job.dump_folder={folder}: cannot create its lock file {LOCK_FILE} ({exc.strerror or exc}); "
                    "choose another folder"
                )
        if distributed:
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if error is not None:
            self.release()
            raise RunLockError(error)

    def release(self) -> None:
        """Remove the lock (if still ours) and the empty folders made for it; safe to call twice."""
        if self.path is not None:
            try:
                if self.path.read_text() == self._content:
                    self.path.unlink()
            except OSError:
                pass
            self.path = None
        for folder in reversed(self._created):
            try:
                folder.rmdir()  # only when empty: the run wrote nothing else there
            except OSError:
                break
        self._created = []

    def _take(self, folder: Path) -> None:
        missing = [p for p in (folder, *folder.parents) if not p.exists()]
        folder.mkdir(parents=True, exist_ok=True)
        self._created = list(reversed(missing))
        path = folder / LOCK_FILE
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.time(),
            "pid_start": _process_start(os.getpid()),
            **_slurm(),
        }
        for _ in range(3):  # a lock released or taken over meanwhile: look again
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_dead(path)
                continue
            self._content = json.dumps(me)
            with os.fdopen(fd, "w") as f:
                f.write(self._content)
                f.flush()
                os.fsync(f.fileno())
            self.path = path
            return
        raise RunLockError(
            f"job.dump_folder={folder}: its lock {path} changed hands while this run was taking it; "
            "another run started on this folder at the same moment: wait for it or choose another job.dump_folder"
        )

    def _take_over_if_dead(self, path: Path) -> None:
        """Remove the lock at `path` when its holder is known dead; RunLockError when it is alive or unknown."""
        try:
            content = path.read_text()
        except FileNotFoundError:  # released meanwhile
            return
        folder = path.parent
        try:
            holder = json.loads(content)
            holder["pid"], holder["host"] = int(holder["pid"]), str(holder["host"])
        except (ValueError, KeyError, TypeError):
            raise RunLockError(
                f"job.dump_folder={folder} has a lock file it cannot read ({path}: {content[:60]!r}); if no run "
                f"uses this folder, remove it (rm {path}) and rerun, or choose another job.dump_folder"
            ) from None
        # a requeued Slurm job's earlier incarnation has ended, on whichever node it ran
        if not _earlier_incarnation(holder):
            if holder["host"] != socket.gethostname():
                raise RunLockError(
                    f"job.dump_folder={folder} is in use by {_describe(holder)}, which this host cannot check; if "
                    f"that job is dead, remove its lock (rm {path}) and rerun, else wait for it or choose another "
                    "job.dump_folder"
                )
            if _alive(holder):
                raise RunLockError(
                    f"job.dump_folder={folder} is in use by {_describe(holder)}, still running; wait for it to "
                    "finish or choose another job.dump_folder"
                )
        # dead: move it aside (atomic, so of two runs taking over only one removes it) and check it was the dead one
        aside = path.with_name(f"{LOCK_FILE}.stale-{os.getpid()}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return
        try:
            if aside.read_text() != content:  # a live lock taken meanwhile: put it back
                os.link(aside, path)
            else:
                logger.warning(f"run lock {path}: its holder, {_describe(holder)}, is gone; taking the folder over")
        except OSError:
            pass
        finally:
            aside.unlink(missing_ok=True)
