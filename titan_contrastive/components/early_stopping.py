"""Early stopping (`[eval] patience`, Hugging Face's EarlyStoppingCallback): the run ends once `checkpoint.keep_best`'s
metric has gone `patience` evaluations in a row without improving on its best by more than `patience_threshold`
(higher is better, lower for a metric named `...loss`, as `checkpoint/best.py` ranks checkpoints; a NaN never
improves). The step it stops at is saved as a run's last step is, and the best checkpoint is the one `best.json`
names. The count is checkpointed, so a resumed run goes on counting, and a run resumed where it stopped trains no
further. Every rank counts the same: an improvement seen on any rank counts on all."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from titan_contrastive.checkpoint.best import BestCheckpoint
from titan_contrastive.parallelisms.collectives import max_over_ranks

__all__ = ["EarlyStopping"]

logger = logging.getLogger("titan_contrastive")


class EarlyStopping:
    """The count of evaluations since the metric's best (a `Stateful`, saved as `early_stopping`)."""

    def __init__(self, metric: str, patience: int, threshold: float = 0.0) -> None:
        self.ranking, self.patience, self.threshold = BestCheckpoint(metric), patience, threshold
        self.best, self.best_step, self.waited = math.nan, 0, 0

    @classmethod
    def for_run(cls, cfg: Any) -> EarlyStopping | None:
        """The run's (`cfg`: the JobConfig); None without `eval.patience`."""
        ev = cfg.eval
        return cls(cfg.checkpoint.keep_best, ev.patience, ev.patience_threshold) if ev.patience else None

    @property
    def stopped(self) -> bool:
        return self.waited >= self.patience

    def update(self, step: int, results: Mapping[str, Any]) -> bool:
        """Count the evaluation `results` of `step` (collective under torch.distributed: every rank calls it at the
        same evaluations); whether the run stops now, which it logs. A metric the evaluation lacks: the one-line error
        of `BestCheckpoint.scores`."""
        value = self.ranking.scores(results)[self.ranking.metric]
        gain = (
            (self.best - value if self.ranking.lower_is_better else value - self.best) if self.best_step else math.inf
        )
        if max_over_ranks(float(not math.isnan(value) and gain > self.threshold)):
            self.best, self.best_step, self.waited = value, step, 0
        else:
            self.waited += 1
        if self.stopped:
            logger.info(
                f"early stop after step {step}: eval {self.ranking.metric} has not improved on {self.best:.6g} (step "
                f"{self.best_step}) by more than {self.threshold:g} in {self.waited} evaluation(s) (eval.patience="
                f"{self.patience}); the best checkpoint is the one best.json names"
            )
        return self.stopped

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "waited": self.waited}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.best, self.best_step, self.waited = (
            float(state_dict["best"]),
            int(state_dict["best_step"]),
            int(state_dict["waited"]),
        )
