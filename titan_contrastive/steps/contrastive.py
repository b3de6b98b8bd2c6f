"""What the contrastive step kinds share: their training loss, their GradCache chunk, how they
describe a microbatch problem, and the chunk knob they offer the memory planner."""

from __future__ import annotations

from titan_contrastive.components.memory_planner import doubling
from titan_contrastive.config import ConfigError, JobConfig
from titan_contrastive.losses import MicrobatchLoss, Objective, RescaleAccumulatedLoss
from titan_contrastive.steps.base import StepContext

__all__ = ["CHUNK_KNOB", "chunk_knob", "gradcache_chunk", "microbatch_problem", "train_loss"]

CHUNK_KNOB = "gradcache.chunk_sizes"


def train_loss(ctx: StepContext, objective: Objective) -> RescaleAccumulatedLoss:
    """The objective over the microbatches of all DP ranks, divided by the accumulation steps, at the step the
    context says (`StepContext.step`)."""
    return RescaleAccumulatedLoss(MicrobatchLoss(objective, ctx.dp_group, lambda: ctx.step), ctx.ga_steps)


def gradcache_chunk(ctx: StepContext, cfg: JobConfig, knobs: dict[str, int]) -> int | None:
    """Samples per GradCache / re-forward chunk, None for whole microbatches. A planned chunk as
    large as the local batch means no chunking; a configured one is taken as given."""
    sizes = cfg.gradcache.chunk_sizes
    if cfg.gradcache.enabled and len(set(sizes)) > 1:
        raise ConfigError(
            f"gradcache.chunk_sizes={sizes}: the {ctx.family} family runs both towers in one forward; "
            f"give one chunk size (e.g. --gradcache.chunk_sizes={min(sizes)})"
        )
    if CHUNK_KNOB in knobs:
        return knobs[CHUNK_KNOB] if knobs[CHUNK_KNOB] < ctx.local_batch_size else None
    return sizes[0] if cfg.gradcache.enabled else None


def chunk_knob(ctx: StepContext) -> dict[str, list[int]]:
    """The samples forwarded at once: 1, 2, 4, ... up to the whole microbatch (no GradCache)."""
    return {CHUNK_KNOB: doubling(1, ctx.local_batch_size)}


def microbatch_problem(ctx: StepContext, objective: str, chunk: int | None) -> str:
    """The start log's account of a microbatch problem; `objective`: its description."""
    text = (
        f"{objective}{ctx.guide_note}; negatives per contrastive problem: {ctx.local_batch_size * ctx.dp_degree} "
        "(loss.negatives=microbatch: accumulation adds no negatives)"
    )
    return text + (f"; GradCache: forwards in chunks of {chunk} samples" if chunk else "")
