"""Checkpointing: the atomic, validated DCP checkpoint manager (`manager.py`) and the Stateful
adapters of what it saves (`stateful.py`: model, optimizer, lr schedule, counters, RNG streams) and what a resumed run
takes from each (`resume.py`)."""

from titan_contrastive.checkpoint.manager import FAULT_ENV, MANIFEST, CheckpointError, CheckpointManager
from titan_contrastive.checkpoint.stateful import LRSchedulerState, ModelState, OptimizerState, RNGState, TrainState

__all__ = ["FAULT_ENV", "MANIFEST", "CheckpointError", "CheckpointManager", "LRSchedulerState", "ModelState", "OptimizerState", "RNGState", "TrainState"]
