"""Resuming a checkpoint on another number of data-parallel ranks.

Global states (model, optimizer, schedule, counters) reshard by themselves: DCP saves DTensors by their global
shape and loads them into any layout. The per-rank states are saved under `{name}/dp_rank_{r}` for each of the
W ranks of the saving run; a run on W' ranks loads all W of them into every rank and hands them to the
stateful's `load_resharded(states, dp_rank)`, which maps them onto this rank:

- the data loader (`datasets.loader.EpochLoader.load_resharded`): the epoch's order is one global permutation
  cut into whole optimizer steps, whatever the ranks, so the samples of every later step are the ones the
  saving run would have taken;
- the RNG streams (`stateful.RNGState.load_resharded`): rank r continues saved rank r mod W's.

A per-rank state without `load_resharded` makes such a resume an error, as does a position that cannot be split
(`EpochLoader.load_resharded`'s ValueError), both one line before any step.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from torch.distributed.checkpoint.stateful import Stateful

from titan_contrastive.checkpoint.reader import CheckpointError
from titan_contrastive.checkpoint.writer import PickledState

logger = logging.getLogger("titan_contrastive")


def reshard_for(
    per_rank_states: dict[str, Stateful], manifest: dict[str, Any], dp_degree: int, step: int, config: dict | None
) -> Reshard | None:
    """The mapping of the per-rank states of checkpoint `step` (its `manifest`) onto `dp_degree` ranks of this run's
    local batch, None where it was saved by as many of the same; CheckpointError where a state cannot be mapped.
    `config`: this run's, as a dict (a manifest without one, or a run without it, keeps the local batch)."""
    local = (config or {}).get("training", {}).get("local_batch_size")
    saved = Layout(int(manifest["dp_degree"]), manifest.get("config", {}).get("training", {}).get("local_batch_size"))
    now = Layout(dp_degree, local if saved.local is not None else None)
    return Reshard(per_rank_states, saved, now, step, config) if saved != now else None


class Layout(NamedTuple):
    """How a run splits a loader step: its data-parallel ranks and their local batch (None: not known)."""

    ranks: int
    local: int | None

    def __str__(self) -> str:
        ranks = f"{self.ranks} data-parallel rank{'s' if self.ranks > 1 else ''}"
        return ranks + ("" if self.local is None else f" of local batch {self.local}")


class _Collected:
    """A Stateful that keeps the state DCP loads into it (the saving rank's, unpickled by PickledState)."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = state_dict


class Reshard:
    """The per-rank states of a checkpoint saved by the `saved` layout, loaded on the `now` one."""

    def __init__(
        self, per_rank_states: dict[str, Stateful], saved: Layout, now: Layout, step: int, config: dict | None
    ) -> None:
        self.per_rank_states, self.saved, self.now, self.step = per_rank_states, saved, now, step
        self.fix = f"resume with {saved} or start a new run (set checkpoint.folder to a new folder)"
        fixed = [name for name, state in per_rank_states.items() if not hasattr(state, "load_resharded")]
        if fixed:
            raise CheckpointError(
                f"checkpoint step-{step} was saved by {saved}, this run has {now}, and its {', '.join(fixed)} state "
                f"cannot be mapped onto them; {self.fix}"
            )
        self.collected = {name: [_Collected() for _ in range(saved.ranks)] for name in per_rank_states}
        self.said = (  # rank 0 logs it once applied
            f"checkpoint step-{step} was saved by {saved} and resumes on {now}: the data continues in the order it "
            f"would have; rank r continues the random streams of its rank r mod {saved.ranks}"
        )
        self.warned, microbatch = "", (config or {}).get("loss", {}).get("negatives") == "microbatch"
        if microbatch and now.local and saved.local and now.local * now.ranks != saved.local * saved.ranks:
            self.warned = (
                f"loss.negatives=microbatch: each contrastive problem now holds the {now.local * now.ranks} samples "
                f"of a microbatch on every rank, {saved.local * saved.ranks} before the resume (negatives=global "
                "keeps a step's whole batch one problem on any number of ranks)"
            )

    def dcp_state(self) -> dict[str, Stateful]:
        """The entries to load: each name's state of every saved rank."""
        return {
            f"{name}/dp_rank_{r}": PickledState(box, f"{name}/dp_rank_{r}.pickle")
            for name, boxes in self.collected.items()
            for r, box in enumerate(boxes)
        }

    def apply(self, dp_rank: int) -> None:
        """Map the loaded states onto this rank; CheckpointError where the data position cannot be split."""
        for name, stateful in self.per_rank_states.items():
            try:
                stateful.load_resharded([box.state for box in self.collected[name]], dp_rank)
            except ValueError as exc:
                raise CheckpointError(
                    f"checkpoint step-{self.step} ({self.saved}) cannot resume on {self.now}: {exc}; {self.fix}"
                ) from None
        if dp_rank == 0:
            logger.info(self.said)
            if self.warned:
                logger.warning(self.warned)
