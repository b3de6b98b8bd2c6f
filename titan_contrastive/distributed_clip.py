"""The exact streaming distributed CLIP step (seed 001): one contrastive problem over the whole
global batch, O(N * d) memory, gradients identical to the dense loss.

Order of operations in `StreamingClipStep.__call__` (P data-parallel ranks, C = N/P rows each):
A. per microbatch: capture the RNG (RandContext), forward without a graph; all-gather the
   embeddings -> global Zx, Zy [N, d] on every rank (sync 1);
B. this rank's row LSEs (its rows of S) and column LSEs (its columns), streamed in blocks of
   `stream_chunk_size` x N; all-gather both (sync 2: 2N numbers); the loss from the LSEs and
   the diagonal, on every rank;
C. this rank's embedding gradients dL/dZx[own], dL/dZy[own] (streamed, same blocks);
   with the fused kernels (`kernel`, "auto" on CUDA) B and C take this rank's rows against all
   columns once each instead: B all-gathers row LSEs and partial column LSEs (P x N floats), C
   reduce-scatters each rank's share of dZy (N x d floats);
D. per microbatch: replay its RNG, forward with a graph, backward of the surrogate
   P * (<zx, gx> + <zy, gy> + s * <zx_detached, gx> / s_detached): the chain rule from the
   cached gradients into the parameters, the temperature's share included;
E. the data-parallel wrapper's gradient reduction (sync 3) averages over P, which the factor P
   in D turns into the exact sum. DDP reduces after the last microbatch only (`no_sync`).

Where this differs from the seed, and why: the seed computes all N row and column LSEs on every
rank (P-fold redundant O(N^2 d) work); here each rank computes its own C rows and columns and
shares them with a 2N-float all-gather. The seed replays no randomness, so with dropout its
re-forward differs from the forward it took gradients from; here RandContext replays it. The
seed has a fixed temperature only; a learnable `logit_scale` gets its exact gradient,
once per step. The seed's microbatch loop lets DDP all-reduce after every microbatch; here
only the last one syncs. Its embeddings must be normalized only for the logits to be bounded;
they are checked cheaply (O(N d)) and un-normalized ones are an error, because a forward that
forgot to normalize is far more often a bug than an intent.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, ContextManager, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from titan_contrastive.components.rand_context import RandContext
from titan_contrastive.components.streaming_loss import (
    accumulation_dtype, fused_embedding_grads, fused_lse, infonce_loss_from_lse, loss_dtype, require_kernel, resolve_kernel,
    streamed_embedding_grads, streamed_lse,
)
from titan_contrastive.distributed import all_gather_tensor, reduce_scatter_sum

# (microbatch) -> (z_x, z_y, exp(logit_scale) or None); embeddings L2-normalized
Encode = Callable[[Any], tuple[Tensor, Tensor, Tensor | None]]
# |1 - ||z||| allowed whatever the container dtype: a model under bf16 autocast may normalize in bf16
# (off by ~3e-3) and the trainer hands float32 copies over; a forgotten normalize is off by far more
NORM_TOLERANCE = 2e-2


class DistributedClipError(ValueError):
    """Bad input to the streaming CLIP step; the message names the value and the fix."""


class StreamingClipStep:
    """Forward + backward of the exact global symmetric InfoNCE for one optimizer step.

    `encode` runs the model on one microbatch; `grad_sync(is_last)` returns the context for
    that microbatch's backward (DDP `no_sync` / FSDP2 deferral, from the caller);
    `backward(surrogate)` runs the backward (a float16 caller scales it first).
    `grad_average_factor` is what the data-parallel reduction divides by (P for DDP / FSDP2,
    1 for an unwrapped model). `fixed_scale` = 1/tau replaces a learnable temperature.
    """

    def __init__(self, *, stream_chunk_size: int, group: dist.ProcessGroup | None = None,
                 grad_average_factor: int = 1, fixed_scale: float | None = None, kernel: str = "auto",
                 compute_dtype: torch.dtype | None = None) -> None:
        if not isinstance(stream_chunk_size, int) or stream_chunk_size < 1:
            raise DistributedClipError(f"STREAM_CHUNK_SIZE={stream_chunk_size!r}: must be an integer >= 1 (e.g. 1024)")
        if fixed_scale is not None and not (math.isfinite(fixed_scale) and fixed_scale > 0):
            raise DistributedClipError(f"TAU={1 / fixed_scale if fixed_scale else fixed_scale!r}: must be a number > 0 (e.g. 0.07)")
        self.chunk = stream_chunk_size
        self.kernel = kernel  # "auto", "pytorch" or a fused Triton path (components/streaming_loss.py)
        self.compute_dtype = compute_dtype  # the caller's autocast dtype, if any (see streaming_loss.loss_dtype)
        self.group = group
        self.world = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if self.world > 1 else 0
        self.grad_average_factor = grad_average_factor
        self.fixed_scale = fixed_scale

    def __call__(self, encode: Encode, microbatches: Sequence[Any], *,
                 grad_sync: Callable[[bool], ContextManager] = lambda is_last: contextlib.nullcontext(),
                 backward: Callable[[Tensor], None] = lambda t: t.backward()) -> Tensor:
        """Accumulate the exact gradient of the global loss into .grad; return the loss (detached)."""
        # A. no-graph forward per microbatch, RNG captured for the replay; all-gather
        rand, zx_parts, zy_parts, scale = [], [], [], None
        with torch.no_grad():
            for mb in microbatches:
                rand.append(RandContext())
                zx, zy, scale = encode(mb)
                zx_parts.append(zx)
                zy_parts.append(zy)
        zx_local, zy_local = torch.cat(zx_parts), torch.cat(zy_parts)
        if zx_local.shape != zy_local.shape:
            raise DistributedClipError(f"z_x {tuple(zx_local.shape)} and z_y {tuple(zy_local.shape)} must have the same shape [batch, dim]")
        self._check_normalized(zx_local, "z_x")
        self._check_normalized(zy_local, "z_y")
        learnable = self.fixed_scale is None
        if learnable and scale is None:
            raise DistributedClipError("no temperature: the model has no `logit_scale` and TAU is not set; give TAU (e.g. 0.07) or add a logit_scale parameter")
        s = torch.tensor(self.fixed_scale) if not learnable else scale.detach().reshape(())
        s = s.to(zx_local.device, accumulation_dtype(zx_local))
        zx_all, zy_all = self._gather(zx_local), self._gather(zy_local)
        c = len(zx_local)
        own = range(self.rank * c, (self.rank + 1) * c)

        dtype = loss_dtype(self.kernel, zx_local.dtype, self.compute_dtype)
        kernel = resolve_kernel(self.kernel, zx_local.to(dtype))
        if kernel == "pytorch":
            # B. own rows' and columns' LSEs, gathered; the loss
            row_lse = self._gather(streamed_lse(zx_local, zy_all, s, self.chunk))
            col_lse = self._gather(streamed_lse(zy_local, zx_all, s, self.chunk))
            loss = infonce_loss_from_lse(zx_all, zy_all, row_lse, col_lse, s)
            # C. own embedding gradients
            gx, gy = streamed_embedding_grads(zx_all, zy_all, own, row_lse, col_lse, s, self.chunk)
        else:
            zx_local, zx_all, zy_all = zx_local.to(dtype), zx_all.to(dtype), zy_all.to(dtype)
            # B. own rows against all columns in one pass: row LSEs, partial column LSEs merged over ranks
            row_own, col_part = fused_lse(zx_local, zy_all, s, kernel)
            row_lse = self._gather(row_own)
            col_lse = self._gather(col_part).view(self.world, -1).logsumexp(0)
            loss = infonce_loss_from_lse(zx_all, zy_all, row_lse, col_lse, s)
            # C. one recompute of the same rows: dZx[own], and dZy's share summed into the owners
            gx, gy_share = fused_embedding_grads(zx_local, zy_all, row_own, col_lse, s, own.start, kernel)
            gy = reduce_scatter_sum(gy_share, self.group) if self.world > 1 else gy_share
        del zx_all, zy_all, zx_parts, zy_parts

        # D. replayed forward with a graph; surrogate backward (x P: the reduction averages)
        start = 0
        for j, mb in enumerate(microbatches):
            with grad_sync(j == len(microbatches) - 1):
                with rand[j]:
                    zx, zy, scale_j = encode(mb)
                rows = slice(start, start + len(zx))
                start = rows.stop
                surrogate = (zx.to(gx.dtype) * gx[rows]).sum() + (zy.to(gy.dtype) * gy[rows]).sum()
                if learnable:  # dL/ds = <Zx, dL/dZx> / s, this microbatch's rows' share
                    share = (zx_local[rows].to(gx.dtype) * gx[rows]).sum() / s
                    surrogate = surrogate + (scale_j.reshape(()).to(gx.dtype) * share)
                backward(surrogate * self.grad_average_factor)
        return loss.detach()

    def _gather(self, x: Tensor) -> Tensor:
        return all_gather_tensor(x, self.group) if self.world > 1 else x

    @staticmethod
    def _check_normalized(z: Tensor, name: str) -> None:
        err = (z.detach().to(accumulation_dtype(z)).norm(dim=1) - 1).abs().max().item() if len(z) else 0.0
        if not err <= NORM_TOLERANCE:
            raise DistributedClipError(
                f"{name} is not L2-normalized (max | ||z|| - 1 | = {err:.3g}); normalize in forward: "
                "z = torch.nn.functional.normalize(z, dim=-1)"
            )


def build_streaming_step(loss: Any, *, group: dist.ProcessGroup | None, dp_degree: int,
                         compute_dtype: torch.dtype | None) -> StreamingClipStep | None:
    """The trainer's step from its `[loss]` section: None for microbatch negatives. The kernel is
    checked now (ImportError without triton), not at the first step."""
    require_kernel(loss.kernel)
    if loss.negatives != "global":
        return None
    return StreamingClipStep(stream_chunk_size=loss.stream_chunk_size, group=group, grad_average_factor=dp_degree, kernel=loss.kernel,
                             compute_dtype=compute_dtype)


# ------------------------------------------------------------------ the seed's interface

_KEYS = ("GLOBAL_BATCH_SIZE", "MICRO_BATCH_SIZE", "STREAM_CHUNK_SIZE", "TAU")


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _positive_int(config: Mapping[str, Any], key: str) -> int:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DistributedClipError(f"config['{key}']={value!r}: must be an integer >= 1")
    return value


def distributed_train_step(model: nn.Module, optimizer: torch.optim.Optimizer, local_x: Tensor, local_y: Tensor,
                           config: Mapping[str, Any]) -> float:
    """One optimizer step of the exact global symmetric InfoNCE; returns the global loss on every rank.

    model: DDP-wrapped, FSDP2 (`fully_shard`), or plain on a single process; `forward(x, y)`
    returns L2-normalized `(z_x, z_y)` (or `(z_x, z_y, exp(logit_scale))`). config: N =
    GLOBAL_BATCH_SIZE (= local batch x world size), MICRO_BATCH_SIZE (re-forward chunk),
    STREAM_CHUNK_SIZE (rows per logit block), TAU (fixed temperature; None = learn the
    model's `logit_scale`: s = exp(logit_scale), optionally clamped to s <= config
    ["MAX_LOGIT_SCALE"], e.g. 100 as in CLIP). Optional KERNEL: "auto" (default: the fused
    Triton kernels on CUDA), "pytorch", "triton" or "triton_exact" (components/streaming_loss.py).
    """
    missing = [k for k in _KEYS if k not in config]
    if missing:
        raise DistributedClipError(f"config lacks {', '.join(missing)}; it needs {', '.join(_KEYS)} (TAU=None learns logit_scale)")
    n, micro = _positive_int(config, "GLOBAL_BATCH_SIZE"), _positive_int(config, "MICRO_BATCH_SIZE")
    chunk = _positive_int(config, "STREAM_CHUNK_SIZE")
    world = dist.get_world_size() if dist.is_initialized() else 1
    wrapped = isinstance(model, nn.parallel.DistributedDataParallel) or _is_fsdp(model)
    if world > 1 and not wrapped:
        raise DistributedClipError(f"model is not DDP- or FSDP2-wrapped but WORLD_SIZE={world}: wrap it, or its gradients are never reduced")
    if n % world:
        raise DistributedClipError(f"GLOBAL_BATCH_SIZE={n} is not divisible by WORLD_SIZE={world}; use a multiple of {world}")
    if len(local_x) != len(local_y):
        raise DistributedClipError(f"local_x has {len(local_x)} samples but local_y has {len(local_y)}; they must be pairs")
    if len(local_x) != n // world:
        raise DistributedClipError(f"local batch is {len(local_x)} but GLOBAL_BATCH_SIZE / WORLD_SIZE = {n} / {world} = {n // world}; pass each rank its N/P samples")
    tau = config["TAU"]
    if tau is not None and not (isinstance(tau, (int, float)) and not isinstance(tau, bool) and tau > 0):
        raise DistributedClipError(f"config['TAU']={tau!r}: must be a number > 0 (e.g. 0.07), or None to learn logit_scale")
    max_scale = config.get("MAX_LOGIT_SCALE")
    kernel = config.get("KERNEL", "auto")
    try:
        require_kernel(kernel)
    except (ValueError, ImportError) as e:
        raise DistributedClipError(str(e).replace("loss.kernel=", "config['KERNEL']=")) from None
    logit_scale = getattr(_unwrap(model), "logit_scale", None)

    def encode(mb: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor | None]:
        out = model(*mb)
        zx, zy = out[0], out[1]
        scale = out[2] if len(out) > 2 else None
        if scale is None and tau is None and logit_scale is not None:
            if hasattr(logit_scale, "placements"):  # a DTensor shard: FSDP2 unshards it only inside forward
                raise DistributedClipError("FSDP2 shards logit_scale outside forward; return exp(logit_scale) as forward's third output")
            scale = logit_scale.exp()
        if scale is not None and max_scale is not None:
            scale = scale.clamp(max=max_scale)
        return zx, zy, scale

    step = StreamingClipStep(stream_chunk_size=chunk, group=dist.group.WORLD if world > 1 else None,
                             grad_average_factor=world if wrapped else 1, fixed_scale=None if tau is None else 1.0 / tau,
                             kernel=kernel)
    microbatches = [(local_x[i : i + micro], local_y[i : i + micro]) for i in range(0, len(local_x), micro)]
    is_ddp = isinstance(model, nn.parallel.DistributedDataParallel)

    def grad_sync(is_last: bool) -> ContextManager:
        return model.no_sync() if is_ddp and not is_last else contextlib.nullcontext()

    optimizer.zero_grad(set_to_none=True)
    loss = step(encode, microbatches, grad_sync=grad_sync)
    optimizer.step()
    return loss.item()
