"""Preflight: the run's output folders are usable before any data is read or any step computed.

Why: a dump folder that is a file, read-only or on a full disk would otherwise be found only at
the first write: metrics at the first log, the checkpoint folder at the first save, after the
compute up to it was lost (a full disk surfaces there as torch's "unexpected pos ..."). Each folder
is probed with a file written, fsynced and removed in it (or in its nearest existing ancestor,
so nothing is created); a failure is a one-line ConfigError naming the key, the folder and the
reason. Free space is reported; whether a checkpoint fits is checked once its size is known
(`CheckpointManager.preflight`, with `checkpoint_bytes`).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
from pathlib import Path

import torch
from torch import nn

from titan_contrastive.config import ConfigError
from titan_contrastive.config.job_config import Checkpoint

logger = logging.getLogger("titan_contrastive")


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _nearest_existing(path: str | Path) -> Path:
    """`path` itself if it exists, else its nearest existing ancestor (where it would be created)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    """Free space where `path` is or would be created (its nearest existing ancestor)."""
    return shutil.disk_usage(_nearest_existing(path)).free


def check_writable(path: str | Path, key: str) -> int:
    """Whether files can be written at `path` (or, before it exists, in its nearest existing
    ancestor: nothing is created, so a run that fails later leaves no folder behind); returns the
    free bytes there. A probe file is written, fsynced and removed. ConfigError if unusable."""
    path, existing = Path(path).absolute(), _nearest_existing(path)
    probe = existing / f".write-test-{socket.gethostname()}-{os.getpid()}"
    if not existing.is_dir():
        raise ConfigError(
            f"{key}={path}: cannot write there ({existing} is a file, not a folder); choose another folder "
            f"(--{key}=...)"
        )
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(
            f"{key}={path}: cannot write there ({reason}{'' if existing == path else f' in {existing}'}); "
            f"choose a writable folder with free space (--{key}=...)"
        ) from None
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:  # e.g. a read-only file system, where it was never created
            pass
    return shutil.disk_usage(existing).free


def checkpoint_bytes(model: nn.Module, optimizer_states_per_param: int = 2) -> int:
    """About how many bytes one checkpoint of `model` takes: its state (parameters and buffers,
    full size even when FSDP shards them), AdamW's two moments of each trainable parameter, and
    DCP's ~2 KiB per stored tensor (serialization and `.metadata`; without this term a small
    model's checkpoint, many small tensors, is badly underestimated)."""

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()  # a DTensor's numel is the global one

    state = [t for t in model.state_dict().values() if isinstance(t, torch.Tensor)]
    trainable = [p for p in model.parameters() if p.requires_grad]
    tensors = len(state) + (optimizer_states_per_param + 1) * len(trainable)  # + AdamW's step counts
    return sum(map(nbytes, state)) + optimizer_states_per_param * sum(map(nbytes, trainable)) + 2048 * tensors


def check_output_folders(dump_folder: str, checkpoint: Checkpoint, log: bool) -> None:
    """The dump folder and (when `checkpoint.enable`) `{dump_folder}/{checkpoint.folder}`, checked writable."""
    folders = {"job.dump_folder": Path(dump_folder)}
    if checkpoint.enable:
        folders["checkpoint.folder"] = Path(dump_folder) / checkpoint.folder
    free = {key: check_writable(path, key) for key, path in folders.items()}
    if log:
        logger.info(
            "output folders: " + ", ".join(f"{folders[key]} ({format_bytes(n)} free)" for key, n in free.items())
        )
