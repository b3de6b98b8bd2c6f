"""Checkpointing: the atomic, validated DCP checkpoint manager (`manager.py`) and the Stateful
adapters of what it saves (`stateful.py`: model, optimizer, counters, RNG streams)."""

from titan_contrastive.checkpoint.manager import FAULT_ENV, MANIFEST, CheckpointError, CheckpointManager
from titan_contrastive.checkpoint.stateful import ModelState, OptimizerState, RNGState, TrainState

__all__ = ["FAULT_ENV", "MANIFEST", "CheckpointError", "CheckpointManager", "ModelState", "OptimizerState", "RNGState", "TrainState"]
