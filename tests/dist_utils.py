"""Run a test function in N real gloo processes (torch.multiprocessing + env:// rendezvous).

The processes come from a fork server that imported torch, the package and the Hugging Face stack
once per test session (`PRELOAD`): a rank starts in well under a second instead of the two to five
seconds of a fresh interpreter importing all of it (most of a two- or four-rank test's time on two
cores). Each rank gets the test process's environment as it is at the call, as a spawned one would.
Where there is no fork server (not Linux), the ranks are spawned.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from titan_contrastive.parallelisms import destroy_distributed

# a test's world sizes where it runs on two and four processes: the four-process run in the slow suite, which CI
# runs too (the default suite's time; the two-process run stays in it)
TWO_AND_FOUR = [2, pytest.param(4, marks=pytest.mark.slow)]

# imported once in the fork server; a module that is not installed is skipped by multiprocessing
PRELOAD = ["torch", "torch.distributed", "titan_contrastive.train", "transformers", "peft", "tests.dist_utils"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, fn: Callable[..., None], world_size: int, port: int, args: tuple[Any, ...], env: dict[str, str]
) -> None:
    # what the fork server imported lives as long as the rank: out of the collector's sight, a
    # collection (the teardown's below, the trainer's own) scans what this rank made, not ~400K
    # objects of torch and transformers (about 0.5 s a rank, on copy-on-write pages)
    gc.freeze()
    os.environ.clear()  # the caller's environment now, not the fork server's from the session's start
    os.environ.update(env)
    # the platform's default start method for this rank's own children (data workers), as in a rank
    # torchrun starts: a fork server's child inherits "forkserver", which starts each worker slowly
    multiprocessing.set_start_method(None, force=True)
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
    destroy_distributed(barrier=True)  # as the trainer ends: `fn`'s frame, and its wrappers, are gone


def write_once(path: Path, write: Callable[[], object]) -> Path:
    """`path`, `write()` first if it is missing: on rank 0 alone, the other ranks waiting for it, where a process
    group is up (every rank writing would race, one reading what another has half written)."""
    if not dist.is_initialized():
        if not path.exists():
            write()
        return path
    if dist.get_rank() == 0 and not path.exists():
        write()
    dist.barrier()
    return path


def run_distributed(fn: Callable[..., None], world_size: int, *args: Any) -> None:
    """Run `fn(*args)` on `world_size` processes; an exception on any rank fails the test.

    `fn` may init the process group but must not destroy it: a wrapper still alive in its frame
    (DDP's reducer) can hang at teardown; `_entry` barriers and destroys after `fn` has returned."""
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if method == "forkserver":
        mp.set_forkserver_preload(PRELOAD)  # read when the server starts: the first call of the session
    mp.start_processes(
        _entry,
        args=(fn, world_size, free_port(), args, dict(os.environ)),
        nprocs=world_size,
        join=True,
        start_method=method,
    )
