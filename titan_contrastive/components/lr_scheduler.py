"""Linear warmup, an optional stable phase, then cosine, linear, square-root or no decay, as a LambdaLR
(Stateful)."""

from __future__ import annotations

import math
import warnings

import torch

from titan_contrastive.config.job_config import LRScheduler as LRSchedulerConfig


def decay_start(*, warmup_steps: int, total_steps: int, decay_ratio: float | None) -> int:
    """The step whose lr is the last at the peak: the end of warmup, or with `decay_ratio` the start of the
    last round(decay_ratio x total_steps) steps (at least one; never inside warmup)."""
    if decay_ratio is None:
        return warmup_steps
    return max(warmup_steps, total_steps - max(round(decay_ratio * total_steps), 1))


def lr_factor(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    decay_type: str,
    min_lr_factor: float,
    decay_ratio: float | None = None,
) -> float:
    """Multiplier of the peak lr for the optimizer step with index `step` (0-based).

    Warmup: (step+1)/(warmup+1), so the first step already moves (torchtitan starts at
    lr/(warmup+1) rather than 0, which would waste a step). Then the peak until `decay_start`
    (warmup-stable-decay where `decay_ratio` is set), and the decay from 1 there to
    `min_lr_factor` at the last step, over progress p in [0, 1]: cosine (1 + cos(pi p)) / 2,
    linear 1 - p, sqrt 1 - sqrt(p).
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    start = decay_start(warmup_steps=warmup_steps, total_steps=total_steps, decay_ratio=decay_ratio)
    progress = min(max(step - start, 0) / max(total_steps - start - 1, 1), 1.0)
    if decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        shape = 1.0
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: LRSchedulerConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Build the scheduler; `advance` it once after every optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(
            step,
            warmup_steps=cfg.warmup_steps,
            total_steps=total_steps,
            decay_type=cfg.decay_type,
            min_lr_factor=cfg.min_lr_factor,
            decay_ratio=cfg.decay_ratio,
        ),
    )


def advance(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """`scheduler.step()` after an optimizer step, a skipped one too: the schedule follows the steps, so torch's
    warning of a schedule stepped before its optimizer (after a skipped first step) is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        scheduler.step()
