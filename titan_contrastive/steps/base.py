"""The step protocol: what the trainer's loop calls to turn one optimizer step's microbatches into
accumulated gradients and the step's loss, and the explicit objects every step works with.

Why a protocol: the ways to compute a step's gradients (plain accumulation, GradCache chunks, one
exact problem over the global batch, the masked pixel loss) differ in everything but their
contract. The trainer builds one step at start (`steps.build_gradient_step`) and its loop only
calls it, so a new kind is a new module, not a new branch in the loop, the start log, the
memory planner and the evaluation.

Contract of a step, per call with this rank's k microbatches:
1. the caller has zeroed the gradients;
2. the step runs forwards and backwards so that `.grad` holds exactly the gradient of the
   step's loss (as its kind defines it), data-parallel reduction included (deferred to the last
   backward through `StepContext.grad_sync`), float16-scaled through `StepContext.backward`;
3. it returns the step's loss as a float, the same on every rank.
The caller then unscales, clips, steps the optimizer.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from titan_contrastive.batching import (
    DOC_IDS,
    FROZEN_DOCS,
    FROZEN_QUERIES,
    NEGATIVES,
    OWN_GROUP,
    TEACHER_SCORES,
    BatchError,
    document_ids,
    with_negatives,
)
from titan_contrastive.components.precision import Precision, at_least_fp32
from titan_contrastive.config import JobConfig
from titan_contrastive.datasets.layouts import DataLayout
from titan_contrastive.grad_cache.sync import grad_sync
from titan_contrastive.losses.base import Ranks
from titan_contrastive.losses.guide import Guide

__all__ = ["Batch", "GradientStep", "StepBuilder", "StepContext"]

Batch = dict[str, Tensor]


def _moved(x: Any, device: torch.device) -> Any:
    if isinstance(x, Mapping):
        return {key: _moved(value, device) for key, value in x.items()}
    return x.to(device, non_blocking=True)


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, Mapping):
        return {key: _cast(value, dtype) for key, value in x.items()}
    return x.to(dtype) if x.is_floating_point() else x


class GradientStep(Protocol):
    """Microbatches -> accumulated gradients and the loss; see the module docstring."""

    def __call__(self, microbatches: Sequence[Batch]) -> float:
        """Accumulate the step's gradient into `.grad`; return the step's loss."""

    def describe(self) -> str:
        """How the step forms its problems, for the start log (after the batch arithmetic)."""

    def knobs(self) -> dict[str, list[int]]:
        """The chunk sizes the memory planner may choose, config key -> candidates (the first must
        fit); the chosen values are passed back to `build_gradient_step` as `knobs`."""

    def log_values(self) -> dict[str, float]:
        """Extra values for the train log line (e.g. the temperature)."""


@dataclass
class StepContext:
    """The explicit objects a step works with; the trainer builds it once, a step never sees the trainer."""

    model: nn.Module
    """The module the optimizer owns (the FSDP2 root, or the plain model under DDP)."""
    dp_model: nn.Module
    """What a training forward calls: the DDP wrapper, or `model` itself (FSDP2 wraps in place)."""
    input_keys: tuple[str, ...]
    """The batch entries passed to the model, in order (`ModelSpec.input_keys`)."""
    layout: DataLayout
    """How a batch is cut into chunks (GradCache, re-forward chunks)."""
    precision: Precision
    device: torch.device
    dp_group: dist.ProcessGroup | None
    """The data-parallel group whose ranks share a contrastive problem (None: one process)."""
    dp_degree: int
    ga_steps: int
    local_batch_size: int
    defer_fsdp_sync: bool = False
    """`[parallelism] defer_grad_sync`: FSDP2 reduce-scatters only after the last backward."""
    family: str = ""
    device_transforms: dict[str, Callable[[Tensor], Tensor]] = field(default_factory=dict)
    """Batch key -> what `inputs` applies to a uint8 entry once on the device (the data's
    `DataBundle.device_transforms`: normalization of pixels sent as uint8)."""
    guide: nn.Module | None = None
    """The frozen model (`guide_of`): `[loss] guide_model`'s, whose embeddings decide the false-negative
    masks (GISTEmbed, `losses/guide.py`), and/or `[loss] teacher_model`'s, a distillation's targets; or None."""
    guide_masks: bool = True
    """Whether the frozen model's embeddings decide the masks (`[loss] guide_model` / `guide_embeddings`)."""
    guide_teaches: bool = False
    """Whether they are the distillation's teacher (`[loss] teacher_model` / `teacher_embeddings`)."""
    frozen_in_data: bool = False
    """Whether the batches carry the frozen model's embeddings, computed ahead (`[loss] guide_embeddings` /
    `teacher_embeddings`: `batching.FROZEN_QUERIES`, `FROZEN_DOCS`), instead of a guide model running."""
    step: int = field(default=0, init=False)
    """The optimizer step being computed (0-based), set by the trainer before each gradient step: what a term
    with a schedule of its own reads (`losses.base.at_step`)."""
    last_scalars: tuple[Tensor, ...] = field(default=(), init=False)
    """What the last contrastive forward returned after the embeddings (exp(logit_scale)[, logit_bias]), for the log."""
    takes_replay: bool = field(default=False, init=False)
    """Whether the model's forward has a `replay` parameter (the families with locked towers), so
    that a cached-gradient re-forward hands it the first pass's outputs (`encode`)."""

    def __post_init__(self) -> None:
        self.takes_replay = "replay" in inspect.signature(self.model.forward).parameters

    @classmethod
    def for_run(
        cls,
        cfg: JobConfig,
        spec: Any,
        model: nn.Module,
        dp_model: nn.Module,
        precision: Precision,
        process: Any,
        dp_degree: int,
        ga_steps: int,
        device_transforms: dict[str, Callable[[Tensor], Tensor]] | None = None,
        guide: nn.Module | None = None,
    ) -> StepContext:
        """The context of a training run (`spec`: the family's ModelSpec; `process`: this process's
        parallelisms.DistInfo); every process is a data-parallel rank, so the DP group is the world
        when the run is distributed."""
        device, distributed = process.device, process.is_distributed
        return cls(
            model=model,
            dp_model=dp_model,
            input_keys=spec.input_keys,
            layout=spec.layout,
            precision=precision,
            device=device,
            dp_group=dist.group.WORLD if distributed else None,
            dp_degree=dp_degree,
            ga_steps=ga_steps,
            local_batch_size=cfg.training.local_batch_size,
            defer_fsdp_sync=cfg.parallelism.defer_grad_sync,
            family=cfg.model.name,
            device_transforms=dict(device_transforms or {}),
            guide=guide,
            guide_masks=bool(cfg.loss.guide_model or cfg.loss.guide_embeddings),
            guide_teaches=bool(cfg.loss.teacher_model or cfg.loss.teacher_embeddings),
            frozen_in_data=bool(cfg.loss.guide_embeddings or cfg.loss.teacher_embeddings),
        )

    @property
    def global_batch_size(self) -> int:
        return self.local_batch_size * self.ga_steps * self.dp_degree

    @property
    def pad_ids(self) -> dict[str, int]:
        """The model's right-padded token-id inputs {batch key: pad id} (its `padded_inputs`), else none."""
        return dict(getattr(self.model, "padded_inputs", None) or {})

    @property
    def doc_pad_id(self) -> int | None:
        """The pad id of the second input's token ids, if the model names one."""
        return self.pad_ids.get(self.input_keys[1])

    def document_ids(self, batch: Batch) -> Tensor:
        """The ids of a batch's documents (the second input, with its hard negatives): [B] or
        [B, 1 + k], for the duplicate mask: the data's own (`batch["doc_id"]`, e.g. a pairs file's
        id column) when it serves them, else equal for equal token ids (`batching.document_ids`)."""
        docs, negs = batch[self.input_keys[1]], batch.get(NEGATIVES)
        if DOC_IDS not in batch:
            return document_ids(docs, negs, self.doc_pad_id).to(self.device)
        ids = batch[DOC_IDS]
        want = (len(docs),) if negs is None else (len(docs), 1 + negs.shape[1])
        if tuple(ids.shape) != want or ids.dtype != torch.int64:
            raise BatchError(
                f"batch[{DOC_IDS!r}] is {ids.dtype} {tuple(ids.shape)}; the documents (with hard negatives) need "
                f"int64 {want}: one id per served document"
            )
        return ids.to(self.device)

    def inputs(self, batch: Batch, negatives: bool = True) -> list[Tensor]:
        """The model inputs of a batch on the device (a dict input: each of its tensors, e.g. SigLIP 2's
        patches, mask and grids), floating ones in the parameter dtype (copied asynchronously from
        pinned memory, then normalized (uint8 pixels, `device_transforms`) and cast on the device). Hard negatives
        (`batch["neg"]`) join the second input, 1 + k documents per sample (`with_negatives`),
        unless `negatives` is false."""
        inputs = [_moved(batch[key], self.device) for key in self.input_keys]
        for i, key in enumerate(self.input_keys):
            if key in self.device_transforms and isinstance(inputs[i], Tensor) and inputs[i].dtype == torch.uint8:
                inputs[i] = self.device_transforms[key](inputs[i])
        if negatives and NEGATIVES in batch:
            negs = batch[NEGATIVES].to(self.device, non_blocking=True)
            inputs[1] = with_negatives(inputs[1], negs, self.doc_pad_id)
        return [_cast(x, self.precision.param_dtype) for x in inputs]

    def run(self, batch: Batch, **kwargs: Any) -> Any:
        """The data-parallel model on one batch under this run's autocast."""
        with self.precision.autocast():
            return self.dp_model(*self.inputs(batch), **kwargs)

    def encode(self, batch: Batch, replay: Sequence[Tensor | None] | None = None) -> tuple[Tensor, ...]:
        """A contrastive forward: (first tower's embeddings, second tower's, exp(logit_scale), ...)
        in float32 or better, whatever the compute dtype; with hard negatives the second is
        [B, 1 + k, d], each sample's positive then its negatives. `replay`: in a cached-gradient re-forward
        (GradCache, global negatives), the first pass's outputs of `batch` (`grad_cache.engine.Replay`),
        passed to a model that `takes_replay`: its locked towers return them instead of running."""
        outputs = self.run(batch, replay=replay) if replay is not None and self.takes_replay else self.run(batch)
        if NEGATIVES in batch:  # the documents per sample: [B, 1 + k, d], the positive first
            outputs = (outputs[0], outputs[1].reshape(len(outputs[0]), -1, outputs[1].shape[-1]), *outputs[2:])
        self.last_scalars = tuple(out.detach() for out in outputs[2:])
        return tuple(at_least_fp32(out) for out in outputs)

    def guide_of(self, batches: Sequence[Batch], chunk_size: int | None) -> Guide | None:
        """The guide's embeddings of the problem these batches make with the other DP ranks' (`Guide`,
        gathered), forwarded without a graph in chunks of `chunk_size` samples; None without a guide.
        The guide is in eval mode: it draws no random numbers, so a replayed step is unchanged. With
        `frozen_in_data`, the batches' own embeddings of the model instead (`carried_guide`)."""
        if self.frozen_in_data:
            return self.carried_guide(batches)
        if self.guide is None:
            return None
        queries, docs = [], []
        with torch.no_grad(), self.precision.autocast():
            for chunk in (c for batch in batches for c in self.split(batch, chunk_size)):
                zq, zd = (at_least_fp32(z) for z in self.guide(*self.inputs(chunk))[:2])
                queries.append(zq)
                docs.append(zd.reshape(len(zq), -1, zd.shape[-1]) if NEGATIVES in chunk else zd)
        return Guide.gathered(torch.cat(queries), torch.cat(docs), Ranks(self.dp_group))

    def carried_guide(self, batches: Sequence[Batch]) -> Guide:
        """The frozen model's embeddings the batches carry (`frozen_in_data`), normalized in the accumulation
        dtype on the device and gathered over the DP ranks like `guide_of`'s."""
        if any(FROZEN_QUERIES not in b or FROZEN_DOCS not in b for b in batches):
            raise BatchError(
                f"a batch without {FROZEN_QUERIES!r} and {FROZEN_DOCS!r}: loss.guide_embeddings / teacher_embeddings "
                "need data that serves a frozen model's embeddings (text pairs or image-text data)"
            )
        acc = torch.promote_types(self.precision.param_dtype, torch.float32)
        q, d = (
            F.normalize(torch.cat([b[key] for b in batches]).to(self.device, non_blocking=True).to(acc), dim=-1)
            for key in (FROZEN_QUERIES, FROZEN_DOCS)
        )
        return Guide.gathered(q, d, Ranks(self.dp_group))

    @property
    def guide_note(self) -> str:
        """The start log's account of the frozen model (after the objective's)."""
        if self.guide is None and not self.frozen_in_data:
            return ""
        ahead = " (embedded ahead, from the data)" if self.frozen_in_data else ""
        masks = f"; the margin and relative masks compare the frozen guide's cosines{ahead}"
        teaches = f"; the distillation's targets are the frozen teacher's cosines{ahead}"
        return (masks if self.guide_masks else "") + (teaches if self.guide_teaches else "")

    def frozen_inputs(self, batches: Sequence[Batch], chunk_size: int | None) -> tuple[Guide | None, Any]:
        """(the guide's embeddings for the masks, the distillation's teacher) of the problem these
        batches make: the frozen model's embeddings in the roles it has (`guide_of`), and the data's
        teacher scores when no teacher model gives them (None where none)."""
        frozen = self.guide_of(batches, chunk_size)
        teacher = frozen if self.guide_teaches else self.teacher_scores(batches)
        return (frozen if self.guide_masks else None), teacher

    def loss_inputs(self, batch: Batch, ids: bool, chunk_size: int | None = None) -> dict[str, Any]:
        """What a microbatch's loss reads besides the embeddings: its documents' ids when the objective
        reads them (`ids`), the guide's embeddings and the teacher's scores where the run has them
        (`frozen_inputs`), and which queries see their own documents only where the data says (`own_only`)."""
        inputs: dict[str, Any] = {"ids": self.document_ids(batch)} if ids else {}
        guide, teacher = self.frozen_inputs([batch], chunk_size)
        inputs |= {key: value for key, value in (("guide", guide), ("teacher", teacher)) if value is not None}
        if OWN_GROUP in batch:
            inputs["own_only"] = self.own_only([batch])
        return inputs

    def own_only(self, batches: Sequence[Batch]) -> Tensor | None:
        """bool [B] on the device: the batches' queries scored against their own documents only (their source's
        `data.in_batch_negatives` is false); None when the data flags none."""
        if not batches or OWN_GROUP not in batches[0]:
            return None
        return torch.cat([b[OWN_GROUP] for b in batches]).to(self.device, torch.bool)

    def teacher_scores(self, batches: Sequence[Batch]) -> Tensor | None:
        """The data's teacher scores of these batches' documents [B, 1 + k] on the device, in the
        accumulation dtype; None when the data serves none."""
        if not batches or TEACHER_SCORES not in batches[0]:
            return None
        scores = torch.cat([b[TEACHER_SCORES] for b in batches]).to(self.device, non_blocking=True)
        return scores.to(torch.promote_types(self.precision.param_dtype, torch.float32))

    def grad_sync(self, is_last: bool) -> AbstractContextManager:
        """The context around one microbatch's forward + backward (`grad_cache.sync`)."""
        return grad_sync(self.dp_model, is_last, defer_fsdp=self.defer_fsdp_sync)

    def backward(self, loss: Tensor) -> None:
        """Backward of a loss, scaled first under float16 loss scaling."""
        (self.precision.scaler.scale(loss) if self.precision.scaler else loss).backward()

    def split(self, batch: Batch, chunk_size: int | None) -> list[Batch]:
        """A microbatch cut into chunks of `chunk_size` samples (None: the microbatch itself)."""
        return self.layout.split(batch, chunk_size) if chunk_size else [batch]


# (context, config, the family's loss name, planner-chosen knob values) -> step
StepBuilder = Callable[[StepContext, JobConfig, Any, "dict[str, int]"], GradientStep]
"""(context, config, the run's objective (a `losses.Objective`; None for a family with its own loss),
the planner's knobs) -> the step."""


class ContrastiveLog:
    """The temperature (and the sigmoid loss's bias) in the train log, for the contrastive step kinds."""

    ctx: StepContext

    def log_values(self) -> dict[str, float]:
        return {name: value.item() for name, value in zip(("logit_scale", "logit_bias"), self.ctx.last_scalars)}
