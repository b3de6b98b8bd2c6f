"""Tensor collectives over the data-parallel group: all-gather (with and without autograd) and
reduce-scatter, equal-sized shards along dim 0, in rank order; the largest of a number over ranks
(`max_over_ranks`, defined in `batching/tokens.py`, whose token budgets need it and which imports
only torch)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from titan_contrastive.batching.tokens import max_over_ranks as max_over_ranks  # re-exported (see above)

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
