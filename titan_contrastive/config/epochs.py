"""The run's length and intervals in epochs (`training.epochs`, `eval.every_epoch`, `checkpoint.every_epoch`),
made optimizer steps once the train set's loader says how many loader steps an epoch is (`run_steps`, called by the
trainer after the data is built, before the first step); when an evaluation or a save is due (`every`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from titan_contrastive.config.job_config import JobConfig
from titan_contrastive.config.manager import ConfigError, check_profiling

__all__ = ["Interval", "every", "run_steps"]

logger = logging.getLogger("titan_contrastive")


@dataclass(frozen=True)
class Interval:
    """The optimizer steps (from 1) on which a periodic action is due: every `steps` steps (0: none), or where
    `epoch_steps` is set, the step in which each epoch of that many loader steps ends (its last loader step among the
    step's `ga_steps`): the step after an epoch's last batch, whether or not the epoch is a whole number of steps."""

    steps: int = 0
    epoch_steps: int = 0
    ga_steps: int = 1

    def __call__(self, step: int) -> bool:
        if self.epoch_steps:
            return step * self.ga_steps // self.epoch_steps > (step - 1) * self.ga_steps // self.epoch_steps
        return self.steps > 0 and step % self.steps == 0

    def until(self, last: int) -> list[int]:
        """The due steps up to `last`, in order."""
        if self.epoch_steps:
            ends = (
                (e * self.epoch_steps + self.ga_steps - 1) // self.ga_steps
                for e in range(1, last * self.ga_steps // self.epoch_steps + 1)
            )
            return sorted(set(ends))
        return list(range(self.steps, last + 1, self.steps)) if self.steps else []


def every(section: Any, epoch_steps: int, ga_steps: int) -> Interval:
    """The interval of `section` (`[eval]`: `freq`; `[checkpoint]`: `interval`), in epochs where it is `every_epoch`."""
    if section.every_epoch:
        return Interval(epoch_steps=epoch_steps, ga_steps=ga_steps)
    return Interval(steps=section.freq if hasattr(section, "freq") else section.interval)


def run_steps(cfg: JobConfig, epoch_steps: int, ga_steps: int) -> tuple[int, Interval]:
    """(the run's optimizer steps, the steps it evaluates on besides the last). The steps: `training.epochs` passes of
    `epoch_steps` loader steps (each `ga_steps` of them one optimizer step), written to `cfg.training.steps` and
    checked as the config's steps are; `training.steps` where epochs is 0. The intervals given in epochs are said,
    and checked against the steps (`checkpoint.keep_best`)."""
    epochs = cfg.training.epochs
    if epochs:
        steps = epochs * epoch_steps // ga_steps
        if steps < 1:
            raise ConfigError(
                f"training.epochs={epochs}: {epochs} x {epoch_steps} loader steps an epoch make no optimizer step "
                f"of {ga_steps} accumulation steps; raise training.epochs or lower training.global_batch_size"
            )
        check_profiling(cfg, steps)
        cfg.training.steps = steps
        logger.info(f"training.epochs={epochs}: {steps} steps ({epoch_steps} loader steps an epoch, {ga_steps} a step)")
    _epoch_intervals(cfg, epoch_steps, ga_steps)
    return cfg.training.steps, every(cfg.eval, epoch_steps, ga_steps)


def _epoch_intervals(cfg: JobConfig, epoch_steps: int, ga_steps: int) -> None:
    """Say the steps of the sections with `every_epoch`; with `checkpoint.keep_best`, an evaluation at each of the
    run's saves before the last (which evaluates), or a ConfigError naming the first save without one."""
    asked = [name for name in ("eval", "checkpoint") if getattr(cfg, name).every_epoch]
    if not asked:
        return
    last = cfg.training.steps
    ends = Interval(epoch_steps=epoch_steps, ga_steps=ga_steps).until(last)
    shown = ", ".join(map(str, ends[:4])) + (", ..." if len(ends) > 4 else "")
    tail = "" if ends and ends[-1] == last else f" and the last, {last}"
    for name in asked:
        logger.info(f"{name}.every_epoch: after steps {shown or 'none'} (where an epoch ends){tail}")
    if cfg.checkpoint.keep_best:
        evaluates, saves = (every(getattr(cfg, name), epoch_steps, ga_steps) for name in ("eval", "checkpoint"))
        unscored = next((s for s in saves.until(last - 1) if not evaluates(s)), None)
        if unscored is not None:
            raise ConfigError(
                f"checkpoint.keep_best={cfg.checkpoint.keep_best!r} needs an evaluation at every checkpoint, and the "
                f"save after step {unscored} has none (eval.every_epoch={cfg.eval.every_epoch}, eval.freq="
                f"{cfg.eval.freq}, checkpoint.every_epoch={cfg.checkpoint.every_epoch}, checkpoint.interval="
                f"{cfg.checkpoint.interval}): evaluate where it saves (eval.every_epoch=true with "
                "checkpoint.every_epoch=true, or an eval.freq that divides checkpoint.interval)"
            )
