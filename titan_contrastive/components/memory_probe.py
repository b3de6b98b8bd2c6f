"""SavedActivations: peak bytes of tensors saved for backward, a device-independent memory probe.

Why: what a chunked loss saves or frees is a property of the autograd graph, not of the device.
Counting the tensors that autograd saves (and their release when the graph is freed) measures it
on a CPU test machine exactly, and a GPU run then adds only the allocator's transient buffers.
Parameters that backward holds on to are references, not copies, and are not counted.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from types import TracebackType

import torch

__all__ = ["SavedActivations"]


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedActivations:
    """Inside `with SavedActivations(params) as probe:` graphs record their saved tensors;
    `probe.peak` is the most bytes alive at once (including after the block, until backward)."""

    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        self.params = {p.data_ptr() for p in params}
        self.live = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda saved: saved.tensor)

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        saved = _Saved(tensor)
        size = 0 if tensor.data_ptr() in self.params else tensor.numel() * tensor.element_size()
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(saved, self._free, size)  # runs when the graph releases it
        return saved

    def _free(self, size: int) -> None:
        self.live -= size

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self._hooks.__exit__(kind, value, tb)
