"""Parallelism layer: the DP layout (`parallel_dims.py`) and how a model is wrapped (`parallelize.py`)."""

from titan_contrastive.parallelisms.parallel_dims import ParallelDims
from titan_contrastive.parallelisms.parallelize import apply_ac, apply_compile, apply_ddp, apply_fsdp, parallelize_model

__all__ = ["ParallelDims", "apply_ac", "apply_compile", "apply_ddp", "apply_fsdp", "parallelize_model"]
