"""What a non-finite loss or gradient norm does: `[training] on_nonfinite` and `max_consecutive_skips`.

`stop` ends the run (exit code 3) naming the step and which values were non-finite. `skip` skips
the optimizer step, logs it and counts it (metric `skipped_steps`), but only up to
`max_consecutive_skips` steps in a row: a run that does nothing but skip is stuck, and without this
limit it would train on to the end and exit 0 with an unchanged model. The count in a row
starts again after any finite step (and at a resume). `streak_start` is the first step of the
current run of skipped steps (None when the last step was finite): checkpoint pruning spares the
newest checkpoint before it, and the stop message names that checkpoint, the state to go back to.
"""

from __future__ import annotations

import logging
import math

logger = logging.getLogger("titan_contrastive")


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient norm with `on_nonfinite = "stop"`, or too many skips in a row."""


class NonFiniteGuard:
    def __init__(self, on_nonfinite: str, max_consecutive_skips: int) -> None:
        self.on_nonfinite, self.limit, self.in_row, self.last_step = on_nonfinite, max_consecutive_skips, 0, 0

    @property
    def streak_start(self) -> int | None:
        return self.last_step - self.in_row + 1 if self.in_row else None

    def check(self, step: int, loss: float, grad_norm: float, skipped_so_far: int) -> bool | None:
        """None for finite values (the step goes on); True: skip this optimizer step; raises to stop."""
        self.last_step = step
        bad = ", ".join(
            f"{name}={value}" for name, value in (("loss", loss), ("grad_norm", grad_norm)) if not math.isfinite(value)
        )
        if not bad:
            self.in_row = 0
            return None
        self.in_row += 1
        if self.on_nonfinite == "stop":
            raise NonFiniteError(
                f"step {step}: non-finite {bad}; lower optimizer.lr, check the data, "
                "or set training.on_nonfinite=skip to skip such steps"
            )
        if self.in_row > self.limit:
            raise NonFiniteError(
                f"step {step}: non-finite {bad}, {self.in_row} steps in a row, past training.max_consecutive_skips="
                f"{self.limit}; the run is stuck: lower optimizer.lr or check the data, then resume from the last "
                f"checkpoint before step {self.streak_start}"
            )
        logger.warning(
            f"step {step}: non-finite {bad}; optimizer step skipped ({skipped_so_far + 1} so far, {self.in_row} in a "
            "row)"
        )
        return True
