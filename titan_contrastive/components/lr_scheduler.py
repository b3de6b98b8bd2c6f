"""Linear warmup followed by cosine (or linear, or no) decay, as a LambdaLR (Stateful)."""

from __future__ import annotations

import math

import torch

from titan_contrastive.config.job_config import LRScheduler as LRSchedulerConfig


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, decay_type: str, min_lr_factor: float) -> float:
    """Multiplier of the peak lr for the optimizer step with index `step` (0-based).

    Warmup: (step+1)/(warmup+1), so the first step already moves (torchtitan starts at
    lr/(warmup+1) rather than 0, which would waste a step). Decay: from 1 at the end of warmup
    to `min_lr_factor` at the last step.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    decay_steps = max(total_steps - warmup_steps - 1, 1)
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    if decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif decay_type == "linear":
        shape = 1.0 - progress
    else:
        shape = 1.0
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: LRSchedulerConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Build the scheduler; call `.step()` once after every optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(
            step,
            warmup_steps=cfg.warmup_steps,
            total_steps=total_steps,
            decay_type=cfg.decay_type,
            min_lr_factor=cfg.min_lr_factor,
        ),
    )
