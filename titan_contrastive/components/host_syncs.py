"""Which lines of a callable make the host wait for the GPU: torch's sync debug mode, counted by call site.

A host sync (`.item()`, `float(t)`, `.tolist()`, a copy to the CPU, a data-dependent shape) stops the
CPU until every queued kernel has run, so the GPU idles while the CPU queues the next ones. The
train step makes a few on purpose (docs/performance.md#host-syncs); `sync_sites` finds every other.
"""

from __future__ import annotations

import collections
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["sync_sites"]

_THIS = Path(__file__).resolve()
_PACKAGE = _THIS.parents[1]


def _stack() -> list[tuple[str, str]]:
    """(file, qualified function name) of each frame on the caller's stack, innermost last."""
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        frames.append((code.co_filename, getattr(code, "co_qualname", code.co_name)))  # co_qualname: 3.11+
        frame = frame.f_back
    return frames[::-1]


def _site(frames: list[tuple[str, str]]) -> str:
    """`path:function` of the innermost frame in this package (path relative to it), else of the innermost
    frame; frames of the warnings module and of this one are not sites."""
    frames = [f for f in frames if Path(f[0]).name != "warnings.py" and Path(f[0]).resolve() != _THIS]
    ours = [f for f in frames if Path(f[0]).resolve().is_relative_to(_PACKAGE)]
    filename, function = (ours or frames)[-1]
    path = Path(filename).resolve()
    return f"{path.relative_to(_PACKAGE).as_posix() if path.is_relative_to(_PACKAGE) else path.name}:{function}"


def sync_sites(fn: Callable[[], object]) -> collections.Counter[str]:
    """Run `fn()` with CUDA's sync debug mode on; the synchronizing calls it made, counted per
    `path:Class.function` (the innermost frame of titan_contrastive on the stack). Needs CUDA."""
    sites: collections.Counter[str] = collections.Counter()

    def record(message: Warning | str, *args: object, **kwargs: object) -> None:
        if "synchroniz" in str(message):  # torch's words: "called a synchronizing CUDA operation"
            sites[_site(_stack())] += 1
        else:
            shown(message, *args, **kwargs)

    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the mode's first switch in a process synchronizes once itself
        torch.cuda.set_sync_debug_mode("warn")
        warnings.simplefilter("always")
        warnings.showwarning = record
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites
