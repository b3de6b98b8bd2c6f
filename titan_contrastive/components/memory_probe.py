"""Memory probes: bytes saved for backward (device-independent), peak bytes allocated, and the
largest single tensor any operator produces (what proves "never an N x N block").

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
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LargestTensor", "PeakMemory", "SavedActivations"]


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedActivations:
    """Inside `with SavedActivations(params) as probe:` graphs record their saved tensors;
    `probe.peak` is the most bytes alive at once (including after the block, until backward). A tensor that
    several operators save (relu's output, which log1p then saves as its input) counts once."""

    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        self.params = {p.data_ptr() for p in params}
        self.live = self.peak = 0
        self._holders: dict[tuple[int, int], list[int]] = {}  # (data pointer, bytes) -> [references alive, bytes]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda saved: saved.tensor)

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        saved = _Saved(tensor)
        if tensor.data_ptr() in self.params:
            return saved
        size = tensor.numel() * tensor.element_size()
        key = (tensor.data_ptr(), size)
        holder = self._holders.setdefault(key, [0, size])
        if holder[0] == 0:
            self.live += holder[1]
            self.peak = max(self.peak, self.live)
        holder[0] += 1
        weakref.finalize(saved, self._free, key)  # runs when the graph releases it
        return saved

    def _free(self, key: tuple[int, int]) -> None:
        holder = self._holders[key]
        holder[0] -= 1
        if holder[0] == 0:
            self.live -= holder[1]
            del self._holders[key]

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self._hooks.__exit__(kind, value, tb)


class PeakMemory:
    """Peak bytes allocated inside the block above what was allocated at entry.

    CUDA: the caching allocator's statistics (reset at entry). CPU, which has no resettable
    allocator peak (RSS only grows): every tensor an operator returns inside the block is counted
    once per storage until the last tensor object referring to it is freed. Tensors created
    before the block (parameters, optimizer state) are the baseline, not counted.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0
        self._live = 0
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [bytes, live tensor objects]
        self._mode: TorchDispatchMode | None = None

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0:  # empty or meta
            return
        entry = self._refs.get(key)
        if entry is None:
            entry = self._refs[key] = [storage.nbytes(), 0]
            self._live += entry[0]
            self.peak = max(self.peak, self._live)
        entry[1] += 1
        weakref.finalize(tensor, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self._live -= entry[0]
                del self._refs[key]

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            probe = self

            class _Mode(TorchDispatchMode):
                def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                    out = func(*args, **(kwargs or {}))
                    for t in torch.utils._pytree.tree_leaves(out):
                        if isinstance(t, torch.Tensor) and t.device.type != "meta":
                            probe._track(t)
                    return out

            self._mode = _Mode()
            self._mode.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
        elif self._mode is not None:
            self._mode.__exit__(kind, value, tb)


class LargestTensor(TorchDispatchMode):
    """Inside the block, the largest tensor any operator returns: `largest` elements, `largest_bytes`."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = self.largest_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
                self.largest_bytes = max(self.largest_bytes, t.numel() * t.element_size())
        return out
