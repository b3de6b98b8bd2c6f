"""The best checkpoint by an evaluation metric (`[checkpoint] keep_best`, Hugging Face's
`metric_for_best_model`).

Each checkpoint saved at a step that was evaluated records that evaluation in its manifest
(`"eval"`: {metric: value}); the best is read back from the manifests of the checkpoints present,
so it needs no state of its own and survives restarts and rewinds. Higher is better, except for
a metric whose name ends in `loss`. Ties go to the earlier step (a later one must improve on it).
Pruning (`keep_latest_k`) spares the best; `best.json` in the checkpoint folder names it
({"metric", "step", "value", "path"}), rewritten atomically after every save.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from titan_contrastive.atomic_write import write_text_atomically
from titan_contrastive.checkpoint.reader import MANIFEST, CheckpointError

BEST_FILE = "best.json"

__all__ = ["BEST_FILE", "BestCheckpoint", "scores"]


def scores(results: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of an evaluation's `results`, as a manifest records them."""
    return {k: float(v) for k, v in results.items() if isinstance(v, int | float) and not isinstance(v, bool)}


class BestCheckpoint:
    """Which of a folder's checkpoints scores best on `metric` (module docstring)."""

    def __init__(self, metric: str) -> None:
        self.metric = metric
        self.lower_is_better = metric.endswith("loss")

    def scores(self, results: Mapping[str, Any]) -> dict[str, float]:
        """The numbers of an evaluation's `results`, to record in a manifest; a CheckpointError naming the
        evaluation's metrics when `metric` is not one of them (checked on every rank before the save)."""
        numbers = scores(results)
        if self.metric not in numbers:
            named = ", ".join(sorted(k for k in numbers if not k.endswith("num_samples"))) or "none"
            raise CheckpointError(
                f"checkpoint.keep_best={self.metric!r} is not a metric of this run's evaluation ({named}); "
                "set checkpoint.keep_best to one of them"
            )
        return numbers

    def best(self, folder: Path, steps: Iterable[int]) -> tuple[int, float] | None:
        """(step, value) of the best of `steps` in `folder` whose manifest records `metric` (a NaN never
        wins), or None when none does."""
        found: tuple[int, float] | None = None
        for step in sorted(steps):
            try:
                value = json.loads((folder / f"step-{step}" / MANIFEST).read_text())["eval"][self.metric]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if math.isnan(value):
                continue
            if found is None or (value < found[1] if self.lower_is_better else value > found[1]):
                found = (step, value)
        return found

    def write(self, folder: Path, best: tuple[int, float] | None) -> None:
        """`best.json` naming `best` (removed when there is none), written to a temporary file and renamed."""
        target = folder / BEST_FILE
        if best is None:
            target.unlink(missing_ok=True)
            return
        step, value = best
        record = {"metric": self.metric, "step": step, "value": value, "path": str(folder / f"step-{step}")}
        write_text_atomically(target, json.dumps(record, indent=1) + "\n")
