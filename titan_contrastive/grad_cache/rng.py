"""The global random-number streams of a process: capture, restore, and replay around a re-forward.

One place reads and writes torch's global generators (the CPU one and each CUDA device's), for
every user of them: `RandContext` (the cached-gradient engine's replay), the checkpointed
`RNGState` and the memory planner's snapshot. It lives in
`grad_cache/` because the engine needs it and the package imports nothing else of the project.

Why `RandContext`: cached-gradient methods (GradCache, the streaming global-negatives step) run
each chunk's forward twice, once without a graph to get embeddings and once with a graph to
backpropagate into the parameters. The embeddings' gradients were computed from the first
forward, so the second must produce the very same embeddings: dropout masks (and any other torch
randomness) must repeat. A RandContext captures the generators right before the first forward;
entering it later forks the RNG, restores the captured states for the re-forward, and on exit puts
the outer streams back where they were, so code after the step sees the same random stream as it
would have without the replay.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType

import torch

__all__ = ["RNGSnapshot", "RandContext", "capture_rng", "cuda_devices_in_use", "cuda_index", "restore_rng"]


@dataclass
class RNGSnapshot:
    """The CPU generator's state and the states of the CUDA devices it was taken on."""

    cpu: torch.Tensor
    cuda: dict[int, torch.Tensor] = field(default_factory=dict)


def cuda_devices_in_use() -> list[int]:
    """The CUDA devices whose generators a forward of this process draws from: the current
    device once CUDA is initialized (one device per rank), none before that or on CPU. Touching
    another device's generator would create a context there (hundreds of MB)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return [torch.cuda.current_device()]
    return []


def cuda_index(device: int | torch.device) -> int:
    """The index of a CUDA device (`cuda` alone: the current one)."""
    if isinstance(device, int):
        return device
    return device.index if device.index is not None else torch.cuda.current_device()


def capture_rng(cuda_devices: Sequence[int | torch.device] | None = None) -> RNGSnapshot:
    """The CPU state and that of each of `cuda_devices` (default: `cuda_devices_in_use()`)."""
    devices = cuda_devices_in_use() if cuda_devices is None else [cuda_index(d) for d in cuda_devices]
    return RNGSnapshot(torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in devices})


def restore_rng(snapshot: RNGSnapshot) -> None:
    """Set the generators to a snapshot (states may come from a checkpoint: moved to the CPU)."""
    torch.set_rng_state(snapshot.cpu.cpu())
    for device, state in snapshot.cuda.items():
        torch.cuda.set_rng_state(state.cpu(), device)


class RandContext:
    """Capture now; `with ctx:` replays the captured RNG states, then restores the outer ones."""

    def __init__(self) -> None:
        self.snapshot = capture_rng()
        self._fork = None

    def __enter__(self) -> RandContext:
        self._fork = torch.random.fork_rng(devices=list(self.snapshot.cuda), enabled=True)
        self._fork.__enter__()
        restore_rng(self.snapshot)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._fork is not None, "RandContext exited without being entered"
        self._fork.__exit__(exc_type, exc, tb)
        self._fork = None
