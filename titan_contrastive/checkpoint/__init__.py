"""Checkpointing: the atomic, validated DCP checkpoint manager (`manager.py`) and how it writes a
checkpoint folder, in the loop or in the background (`writer.py`), the one reader every
path loads a checkpoint through, verified against its manifest and unpickled without code
(`reader.py`, which states the trust model), the Stateful adapters of what the manager saves
(`stateful.py`: model, optimizer, lr schedule, counters, RNG streams, and `build_checkpointer`)
and what a resumed run takes from each (`resume.py`)."""

from titan_contrastive.checkpoint.manager import FAULT_ENV, CheckpointManager
from titan_contrastive.checkpoint.reader import MANIFEST, CheckpointError
from titan_contrastive.checkpoint.stateful import (
    LRSchedulerState,
    ModelState,
    OptimizerState,
    RNGState,
    TrainState,
    build_checkpointer,
)

__all__ = [
    "FAULT_ENV",
    "MANIFEST",
    "CheckpointError",
    "CheckpointManager",
    "LRSchedulerState",
    "ModelState",
    "OptimizerState",
    "RNGState",
    "TrainState",
    "build_checkpointer",
]
