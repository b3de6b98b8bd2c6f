"""The run's length and intervals in epochs (`training.epochs`, `eval.every_epoch`, `checkpoint.every_epoch`),
made optimizer steps once the train set's loader says how many loader steps an epoch is (`run_steps`, called by the
trainer after the data is built, before the first step)."""

from __future__ import annotations

import logging

from titan_contrastive.config.job_config import JobConfig
from titan_contrastive.config.manager import ConfigError, check_keep_best, check_profiling

__all__ = ["run_steps"]

logger = logging.getLogger("titan_contrastive")


def run_steps(cfg: JobConfig, epoch_steps: int, ga_steps: int) -> int:
    """The run's optimizer steps: `training.epochs` passes of `epoch_steps` loader steps (each `ga_steps` of them one
    optimizer step), written to `cfg.training.steps` and checked as the config's steps are; `training.steps` where
    epochs is 0. The intervals given in epochs are written to `eval.freq` and `checkpoint.interval` first."""
    _epoch_intervals(cfg, epoch_steps, ga_steps)
    epochs = cfg.training.epochs
    if not epochs:
        return cfg.training.steps
    steps = epochs * epoch_steps // ga_steps
    if steps < 1:
        raise ConfigError(
            f"training.epochs={epochs}: {epochs} x {epoch_steps} loader steps an epoch make no optimizer step of "
            f"{ga_steps} accumulation steps; raise training.epochs or lower training.global_batch_size"
        )
    check_profiling(cfg, steps)
    cfg.training.steps = steps
    logger.info(f"training.epochs={epochs}: {steps} steps ({epoch_steps} loader steps an epoch, {ga_steps} a step)")
    return steps


def _epoch_intervals(cfg: JobConfig, epoch_steps: int, ga_steps: int) -> None:
    """`eval.freq` and `checkpoint.interval` of the sections with `every_epoch`: an epoch's optimizer steps, or a
    ConfigError where an epoch ends inside an optimizer step."""
    asked = [
        (name, key) for name, key in (("eval", "freq"), ("checkpoint", "interval")) if getattr(cfg, name).every_epoch
    ]
    if not asked:
        return
    if epoch_steps % ga_steps or not epoch_steps:
        name, key = asked[0]
        raise ConfigError(
            f"{name}.every_epoch=true: an epoch is {epoch_steps} loader steps, not a whole number of optimizer steps "
            f"of {ga_steps} accumulation steps; set {name}.{key} in steps instead, or a training.global_batch_size "
            f"whose accumulation steps divide {epoch_steps}"
        )
    for name, key in asked:
        setattr(getattr(cfg, name), key, epoch_steps // ga_steps)
        logger.info(f"{name}.every_epoch: {name}.{key}={epoch_steps // ga_steps} (an epoch's optimizer steps)")
    check_keep_best(cfg, epochs_known=True)
