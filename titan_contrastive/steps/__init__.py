"""Gradient steps: one protocol (`base.GradientStep`) for "turn a step's microbatches into gradients
and a loss", one module per kind.

| kind | module | when |
|---|---|---|
| plain accumulation (RescaleAccumulatedLoss) | `accumulate.py` | `[loss] negatives = "microbatch"` |
| GradCache chunks, microbatch negatives | `gradcache.py` | ... and `[gradcache] enabled` |
| one exact problem over the global batch (seed 001) | `global_negatives.py` | `[loss] negatives = "global"` |
| the masked pixel loss (seed 003) | `pixel.py` | the vae family (`ModelSpec.build_step`) |

A new kind is a module here with a `StepBuilder` and one line: an entry in `CONTRASTIVE_STEPS`
(chosen by `[loss] negatives` and whether microbatches are chunked), or `build_step=` in a
family's `ModelSpec` for a family-specific kind.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_contrastive.config import ConfigError, JobConfig
from titan_contrastive.losses import Objective
from titan_contrastive.losses.base import Wrapping, own_documents_only
from titan_contrastive.losses.pairwise import Pairwise
from titan_contrastive.steps.accumulate import AccumulateStep
from titan_contrastive.steps.base import Batch, GradientStep, StepBuilder, StepContext
from titan_contrastive.steps.contrastive import gradcache_chunk
from titan_contrastive.steps.global_negatives import GlobalNegativesStep, StreamingClipStep
from titan_contrastive.steps.gradcache import GradCacheStep
from titan_contrastive.steps.pixel import PixelStep

__all__ = [
    "CONTRASTIVE_STEPS",
    "AccumulateStep",
    "Batch",
    "GlobalNegativesStep",
    "GradCacheStep",
    "GradientStep",
    "PixelStep",
    "StepBuilder",
    "StepContext",
    "StreamingClipStep",
    "build_gradient_step",
    "check_own_documents",
]

# ([loss] negatives, microbatches forwarded in GradCache chunks) -> the step kind's builder
CONTRASTIVE_STEPS: dict[tuple[str, bool], StepBuilder] = {
    ("microbatch", False): AccumulateStep.build,
    ("microbatch", True): GradCacheStep.build,
    ("global", False): GlobalNegativesStep.build,
    ("global", True): GlobalNegativesStep.build,  # the chunks are its re-forward units
}


def build_gradient_step(
    spec: Any, ctx: StepContext, cfg: JobConfig, objective: Objective | None, knobs: dict[str, int] | None = None
) -> GradientStep:
    """The family's own kind (`spec.build_step`), else the contrastive kind the config selects.
    `knobs`: values the memory planner chose (config key -> value), over the config's."""
    knobs = knobs or {}
    build = spec.build_step or CONTRASTIVE_STEPS[(cfg.loss.negatives, gradcache_chunk(ctx, cfg, knobs) is not None)]
    if cfg.gradcache.chunk_tokens and build != GradCacheStep.build:
        raise ConfigError(
            f"gradcache.chunk_tokens={cfg.gradcache.chunk_tokens} packs GradCache chunks, "
            "which only the GradCache step "
            f"with microbatch negatives runs, but {_why_not_gradcache(spec, ctx, cfg)}"
        )
    innermost = objective
    while isinstance(innermost, Wrapping):  # Matryoshka, Distilled: the wrapped objective's masks read the guide
        innermost = innermost.inner
    guide = cfg.loss.guide_model or cfg.loss.guide_embeddings
    if guide and not hasattr(innermost, "with_guide"):  # a registered one
        key = "loss.guide_model" if cfg.loss.guide_model else "loss.guide_embeddings"
        raise ConfigError(
            f"{key}={guide!r}: the objective loss.name={cfg.loss.name!r} has no with_guide "
            f"(losses/base.py), so its masks cannot read a guide; add it or leave {key} empty"
        )
    if not all(cfg.data.in_batch_negatives):
        check_own_documents(cfg, objective, innermost)
    return build(ctx, cfg, objective, knobs)


def check_own_documents(cfg: JobConfig, objective: Objective | None, innermost: Any) -> None:
    """A ConfigError unless the objective can score the queries of `data.in_batch_negatives` = false sources
    against their own documents only (`losses.base.own_documents_only`), as the docs define it."""
    refusal = _why_not_own_documents(cfg, objective, innermost)
    if refusal:
        raise ConfigError(
            f"data.in_batch_negatives={cfg.data.in_batch_negatives} scores some queries against their own documents "
            f"only, and {refusal}"
        )


def _why_not_own_documents(cfg: JobConfig, objective: Objective | None, innermost: Any) -> str:
    """Why the run's objective cannot leave a query its own documents only, and the fix; "" where it can."""
    if objective is None:
        return "the family computes its own loss"
    if isinstance(innermost, Pairwise):
        return f"loss.name={cfg.loss.name!r} ranks each query against the other queries' positives: use clip or siglip"
    if cfg.loss.joint_directions:
        return (
            f"loss.joint_directions={cfg.loss.joint_directions} adds the other queries and documents: leave them empty"
        )
    if cfg.loss.teacher_model or cfg.loss.teacher_embeddings:
        teacher = "loss.teacher_model" if cfg.loss.teacher_model else "loss.teacher_embeddings"
        return f"{teacher} distills over every column of the batch: use teacher scores in the data (loss.distill alone)"
    try:
        own_documents_only(objective, torch.zeros(1, dtype=torch.bool))
    except ValueError as err:
        return str(err)
    return ""


def _why_not_gradcache(spec: Any, ctx: StepContext, cfg: JobConfig) -> str:
    """Why the chosen step is not GradCacheStep, and the fix (for `gradcache.chunk_tokens`)."""
    if spec.build_step is not None:
        return f"the {ctx.family} family has its own step: set gradcache.chunk_tokens=0"
    if cfg.loss.negatives != "microbatch":
        return (
            f"loss.negatives={cfg.loss.negatives!r} "
            "(one problem over the global batch, re-forwarded in gradcache.chunk_sizes "
            "samples): set loss.negatives=microbatch or gradcache.chunk_tokens=0"
        )
    if not cfg.gradcache.enabled:
        return "gradcache.enabled=false: set gradcache.enabled=true or gradcache.chunk_tokens=0"
    return "the memory planner chose whole microbatches (memory.budget_gib): set gradcache.chunk_tokens=0"
