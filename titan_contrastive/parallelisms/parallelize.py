"""apply_ac / apply_compile / apply_fsdp / apply_ddp, applied per block in torchtitan's order.

Order of operations in `parallelize_model`:
1. activation checkpointing on each block (so the recompute happens inside the block);
2. torch.compile on each block (the compiled region includes the checkpoint);
3. data parallelism: FSDP2 `fully_shard` on each block, then on the root (or HSDP on the 2-D
   mesh), or DDP on the replicate group, or nothing on one process.

AC and compile modify each block in place (its `forward`, `Module.compile`) rather than
wrapping it in a new module, so parameter names - and with them checkpoint keys - are the same
whichever features are on.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from titan_contrastive.config import ConfigError
from titan_contrastive.parallelisms.parallel_dims import ParallelDims

logger = logging.getLogger("titan_contrastive")

# Ops whose outputs selective AC keeps: the expensive ones (matmuls, attention). Everything else
# (norms, GELU, residual adds, softmax pieces) is recomputed in backward.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.convolution.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(blocks: list[nn.Module], mode: str) -> None:
    """Checkpoint each block's activations: `full` saves only the block input; `selective`
    also saves matmul/attention outputs (recomputing only cheap ops)."""
    if mode == "none":
        return
    context_fn: Callable[[], Any] | None = None
    if mode == "selective":
        context_fn = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
    for block in blocks:
        inner = block.forward

        def forward(*args: Any, _inner: Callable = inner, **kwargs: Any) -> Any:
            extra = {"context_fn": context_fn} if context_fn is not None else {}
            return checkpoint(_inner, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)

        block.forward = forward  # type: ignore[method-assign]


def apply_compile(blocks: list[nn.Module], backend: str) -> None:
    """Compile each block in place (repeated blocks share one compiled graph)."""
    for block in blocks:
        block.compile(backend=backend, fullgraph=False)


def apply_fsdp(
    model: nn.Module,
    blocks: list[nn.Module],
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
) -> None:
    """FSDP2: shard each block, then the root (its remaining parameters: embeddings,
    projections, logit_scale). A 2-D (replicate, shard) mesh gives HSDP."""
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def apply_ddp(model: nn.Module, mesh: DeviceMesh, device: torch.device, reduce_dtype: torch.dtype | None) -> nn.Module:
    """DDP over the replicate group; bfloat16 reduction through DDP's compression hook."""
    group = mesh["dp_replicate"].get_group()
    ddp = DistributedDataParallel(
        model, process_group=group, device_ids=[device.index] if device.type == "cuda" else None
    )
    if reduce_dtype == torch.bfloat16:
        ddp.register_comm_hook(group, default_hooks.bf16_compress_hook)
    return ddp


def parallelize_model(
    model: nn.Module,
    blocks: list[nn.Module],
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    cfg: Any,
    precision: Any,
    device: torch.device,
) -> nn.Module:
    """Apply AC (`[activation_checkpoint]`), compile (`[compile]`) and data parallelism (dtypes from
    `precision`, a components.precision.Precision); `cfg` is the JobConfig. Returns the module to call
    in the train step (the DDP wrapper, or the model itself: FSDP2 modifies the model in place)."""
    ac_mode, compile_backend = cfg.activation_checkpoint.mode, cfg.compile.backend if cfg.compile.enable else None
    if not blocks and (dims.fsdp_enabled or ac_mode != "none" or compile_backend is not None):
        raise ConfigError(
            f"model.name={cfg.model.name!r}: the model has no per-layer blocks to shard, checkpoint or compile (a "
            "Hugging Face model that declares no _no_split_modules and holds no list of repeated layers, as ALBERT); "
            "set parallelism.data_parallel_shard_degree=1 (DDP), parallelism.fsdp_one_device=false, "
            "activation_checkpoint.mode='none' and compile.enable=false"
        )
    param_dtype, reduce_dtype = precision.fsdp_param_dtype, precision.reduce_dtype
    apply_ac(blocks, ac_mode)
    if compile_backend is not None:
        apply_compile(blocks, compile_backend)
    if dims.fsdp_enabled:
        assert mesh is not None
        apply_fsdp(
            model,
            blocks,
            mesh if dims.dp_replicate > 1 else mesh["dp_shard"],
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
        )
        return model
    if dims.ddp_enabled:
        assert mesh is not None
        return apply_ddp(model, mesh, device, reduce_dtype)
    return model
