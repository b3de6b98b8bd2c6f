"""Counting the samples a dataset skipped, and stopping when there are too many.

A dataset that meets a bad record (see `files.FileImageTextDataset`) fills the slot with the next
good one and lists the skip under `BAD_SAMPLES` in the batch. `BadSampleLog.update(batch)` (run
by the loader, in the training process, whatever the number of workers) takes that list out of
the batch, logs one warning per skip (file or shard, sample key, reason), counts it by reason,
and raises `DataError` once this rank's skips exceed

    max_bad_fraction x max(samples loaded so far, samples in one epoch on this rank)  (at least 1),

so one bad sample never stops a run, early noise is judged against a whole epoch, and a damaged
dataset stops within its first epoch with the file and key of the last skip. The counts are part
of the loader's checkpointed state, so a resumed run continues them.

Shards that indexing left out or cut short (`sources.ShardLoss`, logged once when the source was
opened) are reported beside them as `bad_shards`, `bad_shards/<reason>` and
`bad_shards/samples_lost`. They are found again at every start, so they are not checkpointed,
and they do not count against `data.max_bad_fraction`: the samples they lost are never loaded.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

from titan_contrastive.datasets.base import DataError

logger = logging.getLogger("titan_contrastive")

BAD_SAMPLES = "bad_samples"
"""Batch key of the list of skipped records (`sources.BadSample`); never reaches the model."""


def too_many_bad(skipped: Counter[str], total: int, max_bad_fraction: float) -> bool:
    """Whether the `skipped` records (counted by reason) of `total` exceed `max_bad_fraction` of them, at least one
    always allowed: the one rule every reader applies to `data.max_bad_fraction`."""
    return sum(skipped.values()) > max(1, int(max_bad_fraction * total))


class BadSampleLog:
    def __init__(self, max_bad_fraction: float, epoch_samples: int, shard_losses: Sequence[Any] = ()) -> None:
        self.max_bad_fraction = max_bad_fraction
        self.epoch_samples = epoch_samples
        self.counts: Counter[str] = Counter()
        self.seen = 0
        self.shard_losses = list(shard_losses)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def update(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Take the skips out of `batch` (returned without them), count, log, and enforce the limit."""
        bad = batch.pop(BAD_SAMPLES, None) or []
        self.seen += len(batch["index"]) + len(bad)
        for skip in bad:
            self.counts[skip.reason] += 1
            logger.warning(f"skipped bad sample: {skip} ({self.total} skipped of {self.seen} loaded on this rank)")
        if bad and too_many_bad(self.counts, max(self.seen, self.epoch_samples), self.max_bad_fraction):
            last = bad[-1]
            raise DataError(
                f"{last.where}: {self.total} bad samples of {self.seen} loaded exceed data.max_bad_fraction="
                f"{self.max_bad_fraction} ({dict(self.counts)}; last: sample {last.key}, {last.reason}); fix or "
                "remove the damaged files, or raise data.max_bad_fraction"
            )
        return batch

    def values(self) -> dict[str, int]:
        """For the train log and metrics.jsonl: `bad_samples` and `bad_samples/<reason>` (this rank), and
        `bad_shards`, `bad_shards/<reason>`, `bad_shards/samples_lost` when indexing lost any."""
        out = (
            {"bad_samples": self.total, **{f"bad_samples/{k}": v for k, v in sorted(self.counts.items())}}
            if self.counts
            else {}
        )
        if self.shard_losses:
            reasons = Counter(loss.reason for loss in self.shard_losses)
            out.update(
                {
                    "bad_shards": len(self.shard_losses),
                    **{f"bad_shards/{k}": v for k, v in sorted(reasons.items())},
                    "bad_shards/samples_lost": sum(loss.lost for loss in self.shard_losses),
                }
            )
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counts, self.seen = Counter(state.get("counts", {})), int(state.get("seen", 0))
