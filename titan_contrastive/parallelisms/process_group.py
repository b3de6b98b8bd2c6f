"""Process-group setup: join the torchrun job, pick this rank's device, tear down cleanly.

Backend: gloo on CPU, NCCL on CUDA. Collectives live in `collectives.py`.

Timeouts (`[comm]`, torchtitan's names): the group starts with `init_timeout_seconds`; after the
first train step the trainer calls `set_collective_timeout(train_timeout_seconds)`, which applies
to every process group (the device mesh's included). A rank that waits longer than that for a
peer (stalled, stopped, dead) raises; `collective_failure` recognises the error, so the trainer
ends with one line naming the timeout (exit code 4) rather than hanging until the job is killed.
"""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from titan_contrastive.config import ConfigError

logger = logging.getLogger("titan_contrastive")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def resolve_device(choice: str, local_rank: int) -> torch.device:
    """`auto` -> CUDA when available, else CPU; `cuda` without a GPU is an error."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device='cuda' but no CUDA device is visible; use --training.device=cpu (or auto)")
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


_timeout = {"key": "comm.init_timeout_seconds", "seconds": 0}  # the one in force, for error messages


def init_distributed(
    device_choice: str, init_timeout_seconds: int = 300, *, one_device_group: bool = False
) -> DistInfo:
    """Join the torchrun process group (if launched by torchrun) and pick this rank's device; with
    `one_device_group` a single process gets a group of one too (for FSDP2 on one device).

    On CPU the cores are split between the local processes so two processes on a 2-core
    machine do not oversubscribe (torch would otherwise start one thread per core in each).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_choice, local_rank)
    if (world_size > 1 or one_device_group) and not dist.is_initialized():
        alone = {"store": dist.HashStore(), "rank": 0, "world_size": 1} if world_size == 1 else {}
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            device_id=device if device.type == "cuda" else None,
            timeout=timedelta(seconds=init_timeout_seconds),
            **alone,
        )
        _timeout.update(key="comm.init_timeout_seconds", seconds=init_timeout_seconds)
    if device.type == "cpu":
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def host_group() -> dist.ProcessGroup | None:
    """Every rank, for collectives over tensors in host memory: the default group where its backend is gloo, else a
    gloo group of the same ranks (made here: every rank calls this at the same point); None in a single process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def set_collective_timeout(seconds: int, key: str = "comm.train_timeout_seconds") -> None:
    """Give every process group (default and sub-groups) this timeout; no-op when not distributed."""
    if not dist.is_initialized():
        return
    for group in list(distributed_c10d._world.pg_map):
        distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)
    _timeout.update(key=key, seconds=seconds)


def collective_failure(exc: BaseException) -> str | None:
    """One line for a collective that timed out or lost its peer, else None (not such an error).

    Gloo raises a plain RuntimeError ("Timed out waiting 5000ms for recv operation", "Connection
    closed by peer"), NCCL a DistBackendError; DDP re-raises it from backward."""
    text = " ".join(str(exc).split())
    if not dist.is_initialized() or not (
        isinstance(exc, dist.DistError)
        or any(
            marker in text for marker in ("Timed out waiting", "Connection closed by peer", "Connection reset by peer")
        )
    ):
        return None
    detail = text.split("] ", 1)[-1][:200]  # drop gloo's source-location prefix
    return (
        f"a collective did not complete ({detail}): another rank stalled or died (see its log); "
        f"{_timeout['key']}={_timeout['seconds']} is the wait allowed; raise it if a step, evaluation or "
        "checkpoint save really takes longer"
    )


def destroy_distributed(barrier: bool = False) -> None:
    """Tear down the process group; with `barrier` (after a successful run) once all ranks are done.

    The barrier keeps a rank from destroying its gloo pairs while a peer is still inside the
    last collective, and the caller drops the model first (a garbage collection here frees it):
    FSDP2 keeps the last collective's work objects alive, and gloo aborting them at interpreter
    exit kills the process (SIGABRT after a successful run: a spurious failing exit code). No
    barrier after an error: the other ranks may be inside a different collective.
    """
    if dist.is_initialized():
        gc.collect()
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
