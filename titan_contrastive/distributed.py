"""Process-group setup and data-parallel wrapping (torchrun environment, gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

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
        raise RuntimeError("training.device='cuda' but no CUDA device is visible; use --training.device=cpu (or auto)")
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device_choice: str) -> DistInfo:
    """Join the torchrun process group (if launched by torchrun) and pick this rank's device.

    On CPU the cores are split between the local processes so two processes on a 2-core
    machine do not oversubscribe (torch would otherwise start one thread per core in each).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_choice, local_rank)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None)
    if device.type == "cpu":
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def destroy_distributed(barrier: bool = False) -> None:
    """Tear down the process group; with `barrier` (after a successful run) once all ranks are done.

    The barrier keeps a rank from destroying its gloo pairs while a peer is still inside the
    last collective, and the caller drops the model first: FSDP2 keeps the last collective's
    work objects alive, and gloo aborting them at interpreter exit kills the process (SIGABRT
    after a successful run; seen as a flaky exit code in the resume tests). No barrier after
    an error: the other ranks may be inside a different collective.
    """
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


# torch 2.13 renamed the tensor collectives (the old names warn); older torch has only the old ones
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_tensor(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's equal-sized `x` concatenated along dim 0, in rank order (no autograd)."""
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    _all_gather(out, x.contiguous(), group=group)
    return out


def reduce_scatter_sum(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's equal dim-0 slice of the sum of every rank's `x` (no autograd)."""
    mine = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
    _reduce_scatter(mine, x.contiguous(), group=group)
    return mine


class _AllGatherWithGrad(torch.autograd.Function):
    """Concatenate every rank's equal-sized `x` along dim 0; backward returns this rank's slice of
    the gradient summed over all ranks (each rank's loss used every row)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return all_gather_tensor(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return reduce_scatter_sum(grad, ctx.group), None


def all_gather_with_grad(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-gather along dim 0 that autograd differentiates (torch.distributed.nn's is deprecated)."""
    return _AllGatherWithGrad.apply(x, group)
