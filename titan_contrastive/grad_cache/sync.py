"""When data-parallel gradients are reduced inside a step that runs several backwards.

Every step kind (gradient accumulation, GradCache chunks, the streaming global step's re-forward
chunks, the pixel step) runs one backward per microbatch or chunk, and only the last one needs
the data-parallel reduction: reducing earlier ones moves the same bytes k times. This is the one
helper they all use, whatever the wrapper:

- DDP: `no_sync()` around every backward but the last; its reducer all-reduces the accumulated
  gradients in the last one's backward.
- FSDP2 (also HSDP): `set_requires_gradient_sync(sync)` when deferral is asked for. Deferral
  trades memory for traffic: unsharded gradients are held on every rank until the last
  backward. Without it FSDP2 reduce-scatters after every backward and keeps its memory saving,
  which is why the trainer defers only with `[parallelism] defer_grad_sync` (GradCache and
  `grad_sync` itself defer by default: their chunks are small by design).
- A plain module (one process): nothing to defer.

It lives in `grad_cache/` because GradCache defers by default and the package imports nothing
else of the project; the step kinds and `distributed_clip` import it from here.
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["grad_sync"]


def grad_sync(module: nn.Module, sync: bool, *, defer_fsdp: bool = True) -> contextlib.AbstractContextManager:
    """The context for one backward: let the data-parallel wrapper reduce gradients only if `sync`.

    Enter it around the forward *and* backward of that microbatch (DDP decides in forward)."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if sync else module.no_sync()
    if isinstance(module, FSDPModule) and defer_fsdp:
        module.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()
