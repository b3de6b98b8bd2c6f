"""The exact streaming distributed contrastive step: one contrastive problem over the whole
global batch, O(N d) memory, gradients identical to the dense loss, for any objective
(`titan_contrastive.losses`: its `streamed` form does B and C).

Order of operations in `StreamingClipStep.__call__` (P data-parallel ranks, C = N/P rows each):
A. per microbatch: capture the RNG, forward without a graph (the cached-gradient engine's first
   pass, `grad_cache.engine`; the last microbatch with its graph, kept for D); all-gather the
   embeddings -> global Zx [N, d] and the columns Zy [N (1 + k), d] on every rank: the positives,
   then the hard negatives, if any (sync 1);
B+C. the objective's streamed form on this rank's rows against all N columns, in blocks of
   `stream_chunk_size` rows (or the fused kernels, `kernel`, where they serve the objective): the
   loss (its statistics merged over ranks), dL/dZx[own], this rank's share of dL/dZy,
   reduce-scattered to the owners (N x d floats), and the rows' shares of dL/ds (and dL/db). For
   the softmax loss each rank reads its own rows of S twice (forward, one recompute), 8 N^2 d
   FLOPs over all ranks, the dense loss's forward and backward; the sigmoid loss needs one pass;
D. per microbatch (the last one first, from the graph A kept: it is not re-run): replay its RNG,
   forward with a graph (with `replay=True`, `encode(microbatch, replay=...)`: A's outputs of that
   microbatch, which a locked tower returns instead of running), backward of the surrogate
   <zx, P gx> + <zy, P gy> + <s, P ds> (+ <b, P db>) (the engine's second pass): the chain rule
   from the cached gradients into the parameters;
E. the data-parallel wrapper's gradient reduction (sync 3) averages over P, which the factor P
   in D turns into the exact sum. It runs after the last microbatch only (`grad_cache.sync`).

`GlobalNegativesStep` is the trainer's step kind for `[loss] negatives = "global"`: the k
accumulation microbatches (cut into `[gradcache]` chunks when enabled) are the re-forward units.
`titan_contrastive.distributed_clip.distributed_train_step` is the same step behind a one-call
interface. Dropout is replayed exactly (RandContext), a learnable temperature gets its exact
gradient once per step, and un-normalized embeddings are an error (checked in O(N d)): a forward
that forgot to normalize is far more often a bug than an intent.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from titan_contrastive.components.memory_planner import doubling
from titan_contrastive.config import ConfigError, JobConfig
from titan_contrastive.grad_cache import engine
from titan_contrastive.losses import InfoNCE, Objective, Ranks, split_documents, split_ids
from titan_contrastive.losses.base import at_step, bind_teacher, columns, own_documents_only, widths_fit
from titan_contrastive.losses.fused import choose_path, preferred_kernel, require_kernel
from titan_contrastive.losses.guide import Guide
from titan_contrastive.losses.streaming import accumulation_dtype
from titan_contrastive.steps.base import Batch, ContrastiveLog, StepContext
from titan_contrastive.steps.contrastive import chunk_knob, gradcache_chunk

__all__ = ["DistributedClipError", "GlobalNegativesStep", "StreamingClipStep"]

logger = logging.getLogger("titan_contrastive")

# (microbatch) -> (z_x, z_y[, exp(logit_scale) or None[, logit_bias or None]]); embeddings L2-normalized;
# z_y [b, d], or [b, 1 + k, d] with k hard negatives per sample (the positive first)
Encode = Callable[[Any], tuple[Tensor | None, ...]]
# |1 - ||z||| allowed whatever the container dtype: a model under bf16 autocast may normalize in bf16
# (off by ~3e-3) and the trainer hands float32 copies over; a forgotten normalize is off by far more
NORM_TOLERANCE = 2e-2
STREAM_KNOB = "loss.stream_chunk_size"


class DistributedClipError(ValueError):
    """Bad input to the streaming step; the message names the value and the fix."""


class StreamingClipStep:
    """Forward + backward of the exact global loss of `objective` (default: CLIP's symmetric
    InfoNCE) for one optimizer step.

    `encode` runs the model on one microbatch; `grad_sync(is_last)` returns the context for
    that microbatch's backward (DDP `no_sync` / FSDP2 deferral, from the caller);
    `backward(surrogate)` runs the backward (a float16 caller scales it first). `replay=True`:
    `encode` takes a keyword `replay`, and D's re-forward passes A's outputs of the microbatch in it
    (`grad_cache.engine.Replay`), so a locked tower returns them instead of running again.
    `grad_average_factor` is what the data-parallel reduction divides by (P for DDP / FSDP2,
    1 for an unwrapped model). `fixed_scale` = 1/tau replaces a learnable temperature, and
    `fixed_bias` the objective's learnable bias (encode's fourth output). The first call checks that the
    embeddings are unit vectors (a forgotten normalize), unless `unit_embeddings` is False (SPLADE's).
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
        objective: Objective | None = None,
        fixed_bias: float | None = None,
        unit_embeddings: bool = True,
    ) -> None:
        if not isinstance(stream_chunk_size, int) or stream_chunk_size < 1:
            raise DistributedClipError(f"STREAM_CHUNK_SIZE={stream_chunk_size!r}: must be an integer >= 1 (e.g. 1024)")
        if fixed_scale is not None and not (math.isfinite(fixed_scale) and fixed_scale > 0):
            raise DistributedClipError(
                f"TAU={1 / fixed_scale if fixed_scale else fixed_scale!r}: must be a number > 0 (e.g. 0.07)"
            )
        if fixed_bias is not None and not math.isfinite(fixed_bias):
            raise DistributedClipError(
                f"BIAS={fixed_bias!r}: must be a finite number (e.g. -10), or None to learn logit_bias"
            )
        self.objective = objective if objective is not None else InfoNCE()
        if fixed_bias is not None and not self.objective.has_bias:
            raise DistributedClipError(f"BIAS={fixed_bias!r}: {self.objective.describe()} has no bias")
        self.chunk = stream_chunk_size
        self._normalization_checked = not unit_embeddings  # SPLADE's are not unit vectors, by design
        self.kernel = kernel  # "auto", "pytorch" or a fused Triton path (losses/fused.py)
        self.compute_dtype = compute_dtype  # the caller's autocast dtype, if any (see fused.loss_dtype)
        self.ranks = Ranks(group)
        self.grad_average_factor = grad_average_factor
        self.fixed_scale = fixed_scale
        self.fixed_bias = fixed_bias
        self.path = ""  # the path the last call took ("pytorch" or a fused kernel)

    def __call__(
        self,
        encode: Encode,
        microbatches: Sequence[Any],
        *,
        grad_sync: Callable[[bool], contextlib.AbstractContextManager] = lambda is_last: contextlib.nullcontext(),
        backward: Callable[[Tensor], None] = lambda t: t.backward(),
        replay: bool = False,
        ids: Tensor | None = None,
        guide: Guide | None = None,
        teacher: Tensor | None = None,
        step: int | None = None,
        own_only: Tensor | None = None,
    ) -> Tensor:
        """Accumulate the exact gradient of the global loss into .grad; return the loss (detached).
        `ids`: the local documents' ids, [b] or [b, 1 + k] like z_y (for an objective that reads them);
        `guide`: a guide's embeddings of the global problem, whose cosines the masks compare;
        `teacher`: a distilled objective's teacher: the data's scores of the local documents [b, 1 + k], or a
        teacher model's embeddings of the global problem; `step`: the optimizer step, for a term with a schedule
        (`losses.base.at_step`); `own_only`: bool [b], the local queries scored against their own documents only
        (`losses.base.own_documents_only`)."""
        # A. no-graph forward per microbatch, RNG captured for the replay (the cached-gradient engine); all-gather
        #    (the last microbatch keeps its graph: D backpropagates it first instead of re-running it)
        outputs, rand = engine.forward_no_grad(
            encode, microbatches, keep_last=lambda: grad_sync(len(microbatches) == 1)
        )
        zx_parts, zy_parts = [o[0] for o in outputs], [o[1] for o in outputs]
        scale, bias = (list(outputs[-1][2:4]) + [None, None])[:2]
        ends = list(itertools.accumulate(len(z) for z in zx_parts))
        zx_local, zy_local = _joined(zx_parts), _joined(zy_parts)
        del zx_parts, zy_parts
        if not replay:  # the joined copies are all that is needed of A's outputs
            outputs = None
        shape_fits = zx_local.dim() == 2 and zy_local.dim() in (2, 3) and len(zy_local) == len(zx_local)
        if not shape_fits or not widths_fit(self.objective, zx_local, zy_local):
            raise DistributedClipError(
                f"z_x {tuple(zx_local.shape)} and z_y {tuple(zy_local.shape)}: z_y must be [batch, dim] like z_x, or "
                "[batch, 1 + k, dim] with k hard negatives per sample"
            )
        if not self._normalization_checked:  # a host sync: once, the forward that normalizes does not change
            self._check_normalized(zx_local, "z_x")
            self._check_normalized(zy_local.flatten(0, -2), "z_y")
            self._normalization_checked = True
        positives, negatives = split_documents(zy_local)
        learnable = self.fixed_scale is None
        if learnable and scale is None:
            raise DistributedClipError(
                "no temperature: the model has no `logit_scale` and TAU is not set; give TAU (e.g. 0.07) or add a "
                "logit_scale parameter"
            )
        acc = accumulation_dtype(zx_local)
        s = (torch.tensor(self.fixed_scale) if not learnable else scale.detach().reshape(())).to(zx_local.device, acc)
        learn_bias = self.objective.has_bias and self.fixed_bias is None
        if learn_bias and bias is None:
            raise DistributedClipError(
                f"no bias: {self.objective.describe()} needs logit_bias as the model's fourth output, or a fixed BIAS "
                "(e.g. -10)"
            )
        b = None
        if self.objective.has_bias:
            b = (torch.tensor(self.fixed_bias) if not learn_bias else bias.detach().reshape(())).to(
                zx_local.device, acc
            )

        # B + C. the objective's streamed form: this rank's rows against all columns
        n, c = len(zx_local) * self.ranks.world, len(zx_local)
        docs = columns(self.ranks.gather(positives), None if negatives is None else self.ranks.gather(negatives))
        col_ids = None
        if ids is not None:
            pos_ids, neg_ids = split_ids(ids)
            col_ids = columns(self.ranks.gather(pos_ids), None if neg_ids is None else self.ranks.gather(neg_ids))
        objective = at_step(self.objective if guide is None else self.objective.with_guide(guide), step)
        if own_only is not None:
            objective = own_documents_only(objective, self.ranks.gather(own_only))
        if teacher is not None:
            objective = bind_teacher(objective, teacher, self.ranks)
        result = self._streamed(objective, zx_local, docs, s, b, n, c, col_ids)
        gx, gy = result.grad_rows, self.ranks.scatter_sum(result.grad_cols[:n])
        if zy_local.dim() == 3:  # the own samples' documents again: [c, 1 + k, d], each positive then its negatives
            gy = gy.unsqueeze(1)
            if negatives is not None:
                gy = torch.cat([gy, self.ranks.scatter_sum(result.grad_cols[n:]).view(c, zy_local.shape[1] - 1, -1)], 1)
        del docs, zx_local, zy_local, positives, negatives

        # D. replayed forward with a graph, backward of the surrogate <z, cached gradient> (the engine);
        #    the cache is x P (in place: these buffers are the step's own): the data-parallel reduction averages
        factor = self.grad_average_factor
        if factor != 1:
            gx, gy = gx.mul_(factor), gy.mul_(factor)

        def gradients(j: int, out: tuple[Tensor | None, ...]) -> list[Tensor | None]:
            rows = slice(ends[j - 1] if j else 0, ends[j])
            grads: list[Tensor | None] = [gx[rows], gy[rows], None, None]
            if learnable:  # dL/ds, this microbatch's rows' share
                grads[2] = (result.scale_rows[rows].sum() * factor).reshape(out[2].shape)
            if learn_bias:  # dL/db, this microbatch's rows' share
                grads[3] = (result.bias_rows[rows].sum() * factor).reshape(out[3].shape)
            return (grads + [None] * len(out))[: len(out)]

        # a locked tower reuses its pass-A embeddings
        engine.forward_backward(
            encode, microbatches, rand, gradients, sync=grad_sync, backward=backward, replay=outputs if replay else None
        )
        return result.loss.detach()

    def _streamed(
        self,
        objective: Objective,
        zx_local: Tensor,
        zy_all: Tensor,
        s: Tensor,
        b: Tensor | None,
        n: int,
        c: int,
        ids: Tensor | None,
    ) -> Any:
        """`objective`'s streamed form on the own rows against all columns `zy_all` (every
        rank's positives, then every rank's hard negatives), on the path `choose_path` picks (the
        fused kernels read the embeddings in their dtype)."""
        try:
            path, dtype = choose_path(self.kernel, objective, zx_local, self.compute_dtype, n, len(zy_all))
        except ValueError as e:
            raise DistributedClipError(str(e)) from None
        if path != self.path and self.kernel != "pytorch" and self.ranks.rank == 0 and path == "pytorch":
            logger.info(f"loss.kernel={self.kernel}: {objective.describe()} runs on the PyTorch path")
        self.path = path
        return objective.streamed(
            zx_local.to(dtype),
            zy_all.to(dtype),
            s,
            b,
            first_row=self.ranks.rank * c,
            num_queries=n,
            chunk=self.chunk,
            ranks=self.ranks,
            kernel=path,
            ids=ids,
        )

    @staticmethod
    def _check_normalized(z: Tensor, name: str) -> None:
        err = (z.detach().to(accumulation_dtype(z)).norm(dim=1) - 1).abs().max().item() if len(z) else 0.0
        if not err <= NORM_TOLERANCE:
            raise DistributedClipError(
                f"{name} is not L2-normalized (max | ||z|| - 1 | = {err:.3g}); normalize in forward: "
                "z = torch.nn.functional.normalize(z, dim=-1)"
            )


def _joined(parts: list[Tensor]) -> Tensor:
    """The microbatches' embeddings as one tensor (one microbatch: itself, not a copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class GlobalNegativesStep(ContrastiveLog):
    """`[loss] negatives = "global"`: the whole global batch is one exact contrastive problem."""

    def __init__(self, ctx: StepContext, streaming: StreamingClipStep, chunk_size: int | None) -> None:
        self.ctx, self.streaming, self.chunk_size = ctx, streaming, chunk_size

    @classmethod
    def build(
        cls, ctx: StepContext, cfg: JobConfig, objective: Objective, knobs: dict[str, int]
    ) -> GlobalNegativesStep:
        try:  # a fused kernel without triton, or one that does not serve the objective, fails here
            require_kernel(cfg.loss.kernel)
        except ImportError as e:
            raise ConfigError(str(e)) from None
        if cfg.loss.kernel in ("triton", "triton_exact") and not objective.fused(1, 1):
            raise ConfigError(
                f"loss.kernel={cfg.loss.kernel}: the fused kernels serve the plain symmetric problems only; "
                f"{objective.describe()} runs on the PyTorch path: set loss.kernel=auto or pytorch"
            )
        try:
            streaming = StreamingClipStep(
                stream_chunk_size=knobs.get(STREAM_KNOB, cfg.loss.stream_chunk_size),
                group=ctx.dp_group,
                grad_average_factor=ctx.dp_degree,
                kernel=cfg.loss.kernel,
                compute_dtype=ctx.precision.compute_dtype,
                objective=objective,
                unit_embeddings=getattr(ctx.model, "unit_embeddings", True),
            )
        except DistributedClipError as e:
            raise ConfigError(str(e)) from None
        return cls(ctx, streaming, gradcache_chunk(ctx, cfg, knobs))

    def __call__(self, microbatches: Sequence[Batch]) -> float:
        chunks = [chunk for mb in microbatches for chunk in self.ctx.split(mb, self.chunk_size)]
        ids = torch.cat([self.ctx.document_ids(c) for c in chunks]) if self.streaming.objective.needs_ids else None
        ctx = self.ctx
        guide, teacher = ctx.frozen_inputs(chunks, None)
        loss = self.streaming(
            ctx.encode, chunks, grad_sync=ctx.grad_sync, backward=ctx.backward, replay=True, ids=ids, guide=guide,
            teacher=teacher, step=ctx.step, own_only=ctx.own_only(chunks),
        )  # fmt: skip
        return loss.item()

    def describe(self) -> str:
        text = (
            f"{self.streaming.objective.describe()}{self.ctx.guide_note}; negatives per contrastive problem: "
            f"{self.ctx.global_batch_size} "
            "(loss.negatives=global: "
            f"one exact problem over the global batch, streamed in blocks of {self.streaming.chunk} rows; the "
            f"{self.ctx.ga_steps} microbatches are re-forward chunks)"
        )
        return text + (f"; GradCache: forwards in chunks of {self.chunk_size} samples" if self.chunk_size else "")

    def knobs(self) -> dict[str, list[int]]:
        """The forward chunk, then the loss's stream chunk on the PyTorch path (~2 x chunk x N floats;
        the fused kernels' panels are fixed). The trainer hands the loss float32 embeddings."""
        knobs = chunk_knob(self.ctx)
        fused = self.streaming.objective.fused(1, 1)
        if not fused or preferred_kernel(self.streaming.kernel, self.ctx.device, torch.float32) == "pytorch":
            n = self.ctx.global_batch_size
            knobs[STREAM_KNOB] = doubling(min(self.streaming.chunk, n), n)
        return knobs
