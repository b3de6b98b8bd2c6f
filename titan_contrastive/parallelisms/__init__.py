"""Parallelism layer: joining the process group (`process_group.py`), the DP layout
(`parallel_dims.py`), how a model is wrapped (`parallelize.py`), the tensor collectives
(`collectives.py`); when gradients are reduced within a step is `grad_cache/sync.py`'s `grad_sync`."""

from titan_contrastive.parallelisms.collectives import all_gather_tensor, all_gather_with_grad, reduce_scatter_sum
from titan_contrastive.parallelisms.parallel_dims import ParallelDims, gradient_accumulation_steps
from titan_contrastive.parallelisms.parallelize import apply_ac, apply_compile, apply_ddp, apply_fsdp, parallelize_model
from titan_contrastive.parallelisms.process_group import (
    DistInfo,
    collective_failure,
    destroy_distributed,
    host_group,
    init_distributed,
    set_collective_timeout,
)

__all__ = [
    "DistInfo",
    "ParallelDims",
    "all_gather_tensor",
    "all_gather_with_grad",
    "apply_ac",
    "apply_compile",
    "apply_ddp",
    "apply_fsdp",
    "collective_failure",
    "destroy_distributed",
    "gradient_accumulation_steps",
    "host_group",
    "init_distributed",
    "parallelize_model",
    "reduce_scatter_sum",
    "set_collective_timeout",
]
