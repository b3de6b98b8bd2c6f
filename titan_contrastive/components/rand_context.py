"""RandContext: replay the random numbers of a forward pass in a later re-forward.

Cached-gradient methods (the streaming CLIP step, GradCache) run each chunk's forward twice:
once without a graph to get embeddings, once with a graph to backpropagate into the parameters.
The embeddings' gradients were computed from the first forward, so the second must produce the
very same embeddings: dropout masks (and any other torch randomness) must repeat. A RandContext
captures the CPU generator and the current CUDA device's generator right before the first
forward; entering it later forks the RNG, restores those states for the re-forward, and on exit
puts the outer stream back where it was, so code after the step sees the same random stream as
it would have without the replay.
"""

from __future__ import annotations

from types import TracebackType

import torch


class RandContext:
    """Capture now; `with ctx:` replays the captured CPU (and CUDA) RNG state, then restores."""

    def __init__(self) -> None:
        self.cpu_state = torch.get_rng_state()
        self.cuda_device: int | None = None
        self.cuda_state: torch.Tensor | None = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.cuda_device = torch.cuda.current_device()
            self.cuda_state = torch.cuda.get_rng_state(self.cuda_device)
        self._fork = None

    def __enter__(self) -> RandContext:
        devices = [self.cuda_device] if self.cuda_device is not None else []
        self._fork = torch.random.fork_rng(devices=devices, enabled=True)
        self._fork.__enter__()
        torch.set_rng_state(self.cpu_state)
        if self.cuda_state is not None:
            torch.cuda.set_rng_state(self.cuda_state, self.cuda_device)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        assert self._fork is not None, "RandContext exited without being entered"
        self._fork.__exit__(exc_type, exc, tb)
        self._fork = None
