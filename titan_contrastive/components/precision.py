"""Mixed precision: which dtype computes, which dtype reduces, and the float16 gradient scaler.

FSDP2 casts parameters itself (MixedPrecisionPolicy: bf16/fp16 copies for compute, fp32 master
weights and, by default, fp32 gradient reduction). DDP and a single device keep fp32 weights and
run the forward under autocast. float16's narrow range needs loss scaling: a GradScaler
(ShardedGradScaler under FSDP, whose gradients are sharded) that skips a step with inf/nan
gradients and lowers the scale; the trainer logs every such skip.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from titan_contrastive.config import ConfigError
from titan_contrastive.config.job_config import Training

logger = logging.getLogger("titan_contrastive")
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Precision:
    param_dtype: torch.dtype  # master weights
    compute_dtype: torch.dtype  # == param_dtype when mixed precision is off
    reduce_dtype: torch.dtype | None  # None: reduce in the gradients' own dtype
    fsdp: bool
    device_type: str
    scaler: torch.amp.GradScaler | None

    @property
    def mixed(self) -> bool:
        return self.compute_dtype != self.param_dtype

    @property
    def fsdp_param_dtype(self) -> torch.dtype | None:
        """MixedPrecisionPolicy.param_dtype (None = keep the parameters' dtype)."""
        return self.compute_dtype if self.mixed else None

    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast for DDP / single device; FSDP2 has already cast the parameters."""
        if self.mixed and not self.fsdp:
            return torch.autocast(self.device_type, dtype=self.compute_dtype)
        return contextlib.nullcontext()

    def optimizer_step(self, optimizer: torch.optim.Optimizer, overflow: str) -> bool:
        """`optimizer.step()`, through the scaler under float16; True when the scaler skipped the
        step (inf/nan gradients), which it logs as `overflow` with the scale before and after."""
        if self.scaler is None:
            optimizer.step()
            return False
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        if self.scaler.get_scale() < before:
            logger.warning(f"{overflow}; optimizer step skipped, loss scale {before:g} -> {self.scaler.get_scale():g}")
            return True
        return False


def build_precision(cfg: Training, *, fsdp: bool, device: torch.device) -> Precision:
    """Resolve `[training] dtype / mixed_precision_param / mixed_precision_reduce`."""
    param = _DTYPES[cfg.dtype]
    compute = _DTYPES[cfg.mixed_precision_param]
    if param == torch.float64 and compute != torch.float32:
        raise ConfigError(
            f"training.mixed_precision_param={cfg.mixed_precision_param!r} with training.dtype='float64': "
            "float64 runs are exactness checks without mixed precision; use mixed_precision_param='float32'"
        )
    if compute == torch.float32:
        compute = param
    mixed = compute != param
    reduce: torch.dtype | None = (
        torch.bfloat16 if cfg.mixed_precision_reduce == "bfloat16" else (torch.float32 if mixed else None)
    )
    scaler = None
    if compute == torch.float16:
        if fsdp:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            scaler = ShardedGradScaler(device.type)
        else:
            scaler = torch.amp.GradScaler(device.type)
    return Precision(param, compute, reduce, fsdp, device.type, scaler)


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Losses and metrics in float32 (or float64 when the model is float64), never in bf16/fp16."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
