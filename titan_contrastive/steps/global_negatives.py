"""The exact streaming distributed CLIP step (seed 001): one contrastive problem over the whole
global batch, O(N * d) memory, gradients identical to the dense loss; for the softmax loss of
the seed (`loss="clip"`) and for SigLIP's sigmoid loss (`loss="siglip"`).

Order of operations in `StreamingClipStep.__call__` (P data-parallel ranks, C = N/P rows each):
A. per microbatch: capture the RNG, forward without a graph (the cached-gradient engine's first
   pass, `grad_cache.engine`; the last microbatch with its graph, kept for D); all-gather the
   embeddings -> global Zx, Zy [N, d] on every rank (sync 1);
B. this rank's rows of S against all N columns, once, in blocks of `stream_chunk_size` rows (or
   one fused kernel, `kernel`, "auto" on CUDA): its row LSEs and its partial column LSEs; all-gather
   both (sync 2: N + P x N floats), merge the column parts; the loss from the LSEs and the
   diagonal, on every rank;
C. one recompute of the same rows (the PyTorch path starts with B's last block, still in memory):
   dL/dZx[own], and this rank's share of dL/dZy, reduce-scattered to the owners (N x d floats).
   B and C together cost 8 N^2 d FLOPs over all ranks, the dense loss's forward and backward;
B+C for the sigmoid loss, a sum over pairs with no normalizer: one pass of this rank's rows
   against all columns gives its loss terms (all-reduced), dZx[own], its share of dZy
   (reduce-scattered) and its rows' share of dL/db (`streaming_loss.streamed_sigmoid`);
D. per microbatch (the last one first, from the graph A kept: it is not re-run): replay its RNG,
   forward with a graph (with `replay=True`, `encode(microbatch, replay=...)`: A's outputs of that
   microbatch, which a locked tower returns instead of running), backward of the surrogate
   <zx, P gx> + <zy, P gy> + <s, P <zx_detached, gx> / s_detached> (the engine's second pass):
   the chain rule from the cached gradients into the parameters, the temperature's share (and
   the sigmoid loss's bias share <b, P sum of its rows' dL/db>) included;
E. the data-parallel wrapper's gradient reduction (sync 3) averages over P, which the factor P
   in D turns into the exact sum. It runs after the last microbatch only (`grad_cache.sync`).

`GlobalNegativesStep` is the trainer's step kind for `[loss] negatives = "global"`: the k
accumulation microbatches (cut into `[gradcache]` chunks when enabled) are the re-forward units.
The seed's own interface, `distributed_train_step`, is in `titan_contrastive.distributed_clip`.

Where this differs from the seed, and why: the seed computes all N row and column LSEs on every
rank in two passes over S (P-fold redundant), and C recomputes S by rows for dZx and again by
columns for dZy: 4 P N^2 d + 8 N^2 d FLOPs over all ranks (12 N^2 d on one); here each rank
reads its own C rows of S twice (B, C), 8 N^2 d in all, and shares the statistics and the dZy
parts with collectives. The seed replays no randomness, so with dropout its
re-forward differs from the forward it took gradients from; here RandContext replays it. The
seed has a fixed temperature only; a learnable `logit_scale` gets its exact gradient,
once per step. The seed's microbatch loop lets DDP all-reduce after every microbatch; here
only the last one syncs. Its embeddings must be normalized only for the logits to be bounded;
they are checked cheaply (O(N d)) and un-normalized ones are an error, because a forward that
forgot to normalize is far more often a bug than an intent.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from titan_contrastive.components.memory_planner import doubling
from titan_contrastive.components.streaming_loss import (
    KeptBlock,
    accumulation_dtype,
    fused_embedding_grads,
    fused_lse,
    fused_sigmoid,
    infonce_loss_from_lse,
    loss_dtype,
    preferred_kernel,
    require_kernel,
    resolve_kernel,
    streamed_row_col_lse,
    streamed_sigmoid,
    streamed_softmax_grads,
)
from titan_contrastive.config import ConfigError, JobConfig
from titan_contrastive.grad_cache import engine
from titan_contrastive.parallelisms.collectives import all_gather_tensor, reduce_scatter_sum
from titan_contrastive.steps.base import Batch, ContrastiveLog, StepContext
from titan_contrastive.steps.contrastive import chunk_knob, gradcache_chunk

__all__ = ["DistributedClipError", "GlobalNegativesStep", "StreamingClipStep"]

# (microbatch) -> (z_x, z_y[, exp(logit_scale) or None[, logit_bias or None]]); embeddings L2-normalized
Encode = Callable[[Any], tuple[Tensor | None, ...]]
# |1 - ||z||| allowed whatever the container dtype: a model under bf16 autocast may normalize in bf16
# (off by ~3e-3) and the trainer hands float32 copies over; a forgotten normalize is off by far more
NORM_TOLERANCE = 2e-2
STREAM_KNOB = "loss.stream_chunk_size"


class DistributedClipError(ValueError):
    """Bad input to the streaming CLIP step; the message names the value and the fix."""


class StreamingClipStep:
    """Forward + backward of the exact global loss (symmetric InfoNCE, or SigLIP's sigmoid loss
    with `loss="siglip"`) for one optimizer step.

    `encode` runs the model on one microbatch; `grad_sync(is_last)` returns the context for
    that microbatch's backward (DDP `no_sync` / FSDP2 deferral, from the caller);
    `backward(surrogate)` runs the backward (a float16 caller scales it first). `replay=True`:
    `encode` takes a keyword `replay`, and D's re-forward passes A's outputs of the microbatch in it
    (`grad_cache.engine.Replay`), so a locked tower returns them instead of running again.
    `grad_average_factor` is what the data-parallel reduction divides by (P for DDP / FSDP2,
    1 for an unwrapped model). `fixed_scale` = 1/tau replaces a learnable temperature, and
    `fixed_bias` the sigmoid loss's learnable bias (encode's fourth output).
    """

    def __init__(
        self,
        *,
        stream_chunk_size: int,
        group: dist.ProcessGroup | None = None,
        grad_average_factor: int = 1,
        fixed_scale: float | None = None,
        kernel: str = "auto",
        compute_dtype: torch.dtype | None = None,
        loss: str = "clip",
        fixed_bias: float | None = None,
    ) -> None:
        if not isinstance(stream_chunk_size, int) or stream_chunk_size < 1:
            raise DistributedClipError(f"STREAM_CHUNK_SIZE={stream_chunk_size!r}: must be an integer >= 1 (e.g. 1024)")
        if fixed_scale is not None and not (math.isfinite(fixed_scale) and fixed_scale > 0):
            raise DistributedClipError(
                f"TAU={1 / fixed_scale if fixed_scale else fixed_scale!r}: must be a number > 0 (e.g. 0.07)"
            )
        if loss not in ("clip", "siglip"):
            raise DistributedClipError(f"LOSS={loss!r}: choose clip (softmax, InfoNCE) or siglip (sigmoid)")
        if fixed_bias is not None and not math.isfinite(fixed_bias):
            raise DistributedClipError(
                f"BIAS={fixed_bias!r}: must be a finite number (e.g. -10), or None to learn logit_bias"
            )
        self.chunk = stream_chunk_size
        self.kernel = kernel  # "auto", "pytorch" or a fused Triton path (components/streaming_loss.py)
        self.compute_dtype = compute_dtype  # the caller's autocast dtype, if any (see streaming_loss.loss_dtype)
        self.group = group
        self.world = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if self.world > 1 else 0
        self.grad_average_factor = grad_average_factor
        self.fixed_scale = fixed_scale
        self.loss = loss
        self.fixed_bias = fixed_bias

    def __call__(
        self,
        encode: Encode,
        microbatches: Sequence[Any],
        *,
        grad_sync: Callable[[bool], contextlib.AbstractContextManager] = lambda is_last: contextlib.nullcontext(),
        backward: Callable[[Tensor], None] = lambda t: t.backward(),
        replay: bool = False,
    ) -> Tensor:
        """Accumulate the exact gradient of the global loss into .grad; return the loss (detached)."""
        # A. no-graph forward per microbatch, RNG captured for the replay (the cached-gradient engine); all-gather
        #    (the last microbatch keeps its graph: D backpropagates it first instead of re-running it)
        outputs, rand = engine.forward_no_grad(
            encode, microbatches, keep_last=lambda: grad_sync(len(microbatches) == 1)
        )
        zx_parts, zy_parts = [o[0] for o in outputs], [o[1] for o in outputs]
        scale, bias = (list(outputs[-1][2:4]) + [None, None])[:2]
        zx_local, zy_local = torch.cat(zx_parts), torch.cat(zy_parts)
        if zx_local.shape != zy_local.shape:
            raise DistributedClipError(
                f"z_x {tuple(zx_local.shape)} and z_y {tuple(zy_local.shape)} must have the same shape [batch, dim]"
            )
        self._check_normalized(zx_local, "z_x")
        self._check_normalized(zy_local, "z_y")
        learnable = self.fixed_scale is None
        if learnable and scale is None:
            raise DistributedClipError(
                "no temperature: the model has no `logit_scale` and TAU is not set; give TAU (e.g. 0.07) or add a "
                "logit_scale parameter"
            )
        acc = accumulation_dtype(zx_local)
        s = (torch.tensor(self.fixed_scale) if not learnable else scale.detach().reshape(())).to(zx_local.device, acc)
        learn_bias = self.loss == "siglip" and self.fixed_bias is None
        if learn_bias and bias is None:
            raise DistributedClipError(
                "no bias: the sigmoid loss needs logit_bias as the model's fourth output, or a fixed BIAS (e.g. -10)"
            )
        zx_all, zy_all = self._gather(zx_local), self._gather(zy_local)
        c = len(zx_local)
        own = range(self.rank * c, (self.rank + 1) * c)

        # B + C: the loss and this rank's embedding gradients (and, sigmoid, its rows' share of dL/db)
        bias_rows = None
        if self.loss == "siglip":
            b = (torch.tensor(self.fixed_bias) if not learn_bias else bias.detach().reshape(())).to(
                zx_local.device, acc
            )
            loss, gx, gy, bias_rows, zx_local = self._sigmoid(zx_local, zy_all, s, b, own)
        else:
            # each rank reads its own rows of S
            loss, gx, gy, zx_local = self._softmax(zx_local, zx_all, zy_all, s, own)
        del zx_all, zy_all

        # D. replayed forward with a graph, backward of the surrogate <z, cached gradient> (the engine);
        #    the cache is x P: the data-parallel reduction averages
        factor = self.grad_average_factor
        ends = list(itertools.accumulate(len(z) for z in zx_parts))
        del zx_parts, zy_parts

        def gradients(j: int, out: tuple[Tensor | None, ...]) -> list[Tensor | None]:
            rows = slice(ends[j - 1] if j else 0, ends[j])
            grads: list[Tensor | None] = [gx[rows] * factor, gy[rows] * factor, None, None]
            # dL/ds = <Zx, dL/dZx> / s (l depends on s only through s <x, y>), this microbatch's rows' share
            if learnable:
                share = (zx_local[rows].to(gx.dtype) * gx[rows]).sum() / s
                grads[2] = (share * factor).reshape(out[2].shape)
            if learn_bias:  # dL/db, this microbatch's rows' share
                grads[3] = (bias_rows[rows].sum() * factor).reshape(out[3].shape)
            return (grads + [None] * len(out))[: len(out)]

        # a locked tower reuses its pass-A embeddings
        engine.forward_backward(
            encode, microbatches, rand, gradients, sync=grad_sync, backward=backward, replay=outputs if replay else None
        )
        return loss.detach()

    def _softmax(
        self, zx_local: Tensor, zx_all: Tensor, zy_all: Tensor, s: Tensor, own: range
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Symmetric InfoNCE: (loss, dL/dZx[own], dL/dZy[own], the own rows as the loss read them).

        One organisation for both paths (8 N^2 d FLOPs over all ranks), which differ only in the two
        functions: B. this rank's rows of S against all N columns, once: its row LSEs and partial
        column LSEs, gathered and merged over ranks; C. one recompute of the same rows: dZx[own],
        and this rank's share of dZy, reduce-scattered to the owners."""
        dtype = loss_dtype(self.kernel, zx_local.dtype, self.compute_dtype)
        kernel = resolve_kernel(self.kernel, zx_local.to(dtype))
        # the embeddings' own dtype (blocks in the accumulation dtype); C starts with B's last block
        if kernel == "pytorch":
            keep = KeptBlock()
            row_col_lse = functools.partial(streamed_row_col_lse, chunk=self.chunk, keep=keep)
            softmax_grads = functools.partial(streamed_softmax_grads, chunk=self.chunk, keep=keep)
        else:
            zx_local, zx_all, zy_all = zx_local.to(dtype), zx_all.to(dtype), zy_all.to(dtype)
            row_col_lse = functools.partial(fused_lse, kernel=kernel)
            softmax_grads = functools.partial(fused_embedding_grads, kernel=kernel)
        # B. own rows against all columns in one pass: row LSEs, partial column LSEs merged over ranks
        row_own, col_part = row_col_lse(zx_local, zy_all, s)
        row_lse = self._gather(row_own)
        col_lse = self._gather(col_part).view(self.world, -1).logsumexp(0) if self.world > 1 else col_part
        loss = infonce_loss_from_lse(zx_all, zy_all, row_lse, col_lse, s)
        # C. one recompute of the same rows: dZx[own], and dZy's share summed into the owners
        gx, gy_share = softmax_grads(zx_local, zy_all, row_own, col_lse, s, own.start)
        gy = reduce_scatter_sum(gy_share, self.group) if self.world > 1 else gy_share
        return loss, gx, gy, zx_local

    def _sigmoid(
        self, zx_local: Tensor, zy_all: Tensor, s: Tensor, b: Tensor, own: range
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """SigLIP's loss, a sum over pairs, so B and C are one pass over this rank's rows against all
        columns (no log-sum-exp to gather first): (loss, dL/dZx[own], dL/dZy[own], dL/db per own
        row, the own rows as the loss read them)."""
        dtype = loss_dtype(self.kernel, zx_local.dtype, self.compute_dtype)
        kernel = resolve_kernel(self.kernel, zx_local.to(dtype), loss="siglip")
        if kernel == "pytorch":
            loss, gx, gy_share, bias_rows = streamed_sigmoid(zx_local, zy_all, s, b, own.start, self.chunk)
        else:
            zx_local, zy_all = zx_local.to(dtype), zy_all.to(dtype)
            loss, gx, gy_share, bias_rows = fused_sigmoid(zx_local, zy_all, s, b, own.start, kernel)
        if self.world > 1:
            dist.all_reduce(loss, group=self.group)
            gy = reduce_scatter_sum(gy_share, self.group)
        else:
            gy = gy_share
        return loss, gx, gy, bias_rows, zx_local

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


class GlobalNegativesStep(ContrastiveLog):
    """`[loss] negatives = "global"`: the whole global batch is one exact contrastive problem."""

    def __init__(self, ctx: StepContext, streaming: StreamingClipStep, chunk_size: int | None) -> None:
        self.ctx, self.streaming, self.chunk_size = ctx, streaming, chunk_size

    @classmethod
    def build(cls, ctx: StepContext, cfg: JobConfig, loss_name: str, knobs: dict[str, int]) -> GlobalNegativesStep:
        try:  # a fused kernel without triton fails here, before any compute
            require_kernel(cfg.loss.kernel)
        except ImportError as e:
            raise ConfigError(str(e)) from None
        try:
            streaming = StreamingClipStep(
                stream_chunk_size=knobs.get(STREAM_KNOB, cfg.loss.stream_chunk_size),
                group=ctx.dp_group,
                grad_average_factor=ctx.dp_degree,
                kernel=cfg.loss.kernel,
                compute_dtype=ctx.precision.compute_dtype,
                loss=loss_name,
            )
        except DistributedClipError as e:
            raise ConfigError(str(e)) from None
        return cls(ctx, streaming, gradcache_chunk(ctx, cfg, knobs))

    def __call__(self, microbatches: Sequence[Batch]) -> float:
        chunks = [chunk for mb in microbatches for chunk in self.ctx.split(mb, self.chunk_size)]
        return self.streaming(
            self.ctx.encode, chunks, grad_sync=self.ctx.grad_sync, backward=self.ctx.backward, replay=True
        ).item()

    def describe(self) -> str:
        text = (
            f"{self.streaming.loss} loss; negatives per contrastive problem: {self.ctx.global_batch_size} "
            "(loss.negatives=global: "
            f"one exact problem over the global batch, streamed in blocks of {self.streaming.chunk} rows; the "
            f"{self.ctx.ga_steps} microbatches are re-forward chunks)"
        )
        return text + (f"; GradCache: forwards in chunks of {self.chunk_size} samples" if self.chunk_size else "")

    def knobs(self) -> dict[str, list[int]]:
        """The forward chunk, then the loss's stream chunk on the PyTorch path (~2 x chunk x N floats;
        the fused kernels' panels are fixed). The trainer hands the loss float32 embeddings."""
        knobs = chunk_knob(self.ctx)
        if preferred_kernel(self.streaming.kernel, self.ctx.device, torch.float32) == "pytorch":
            n = self.ctx.global_batch_size
            knobs[STREAM_KNOB] = doubling(min(self.streaming.chunk, n), n)
        return knobs
