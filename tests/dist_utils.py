"""Run a test function in N real gloo processes (torch.multiprocessing.spawn + env:// rendezvous)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., None], world_size: int, port: int, args: tuple[Any, ...]) -> None:
    # the same variables torchrun sets, so the code under test joins exactly as in a real launch
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    fn(*args)
    # tear down as the trainer does: drop wrappers holding collective work, then barrier +
    # destroy, or gloo aborts the process at interpreter exit
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., None], world_size: int, *args: Any) -> None:
    """Run `fn(*args)` on `world_size` processes; an exception on any rank fails the test.

    `fn` may init the process group but must not destroy it: a wrapper still alive in its frame
    (DDP's reducer) can hang at teardown; `_entry` barriers and destroys after `fn` has returned."""
    mp.spawn(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)
