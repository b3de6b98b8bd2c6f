"""Stateful adapters: the pieces of a training run that the checkpoint manager saves, made Stateful.

Each follows torch.distributed.checkpoint's `Stateful` protocol (`state_dict()` /
`load_state_dict()`), so `CheckpointManager` hands them to DCP as they are. The data loader
(EpochLoader) already follows it and needs no wrapper.

Hyperparameters come from the config, state from the checkpoint (the resume table in
`checkpoint/resume.py`): `OptimizerState` restores moments and step counts but keeps the param
groups' lr, betas, eps and weight decay that the config built, and `LRSchedulerState` restores
only the position in the schedule and recomputes the lr from the config's schedule. Loading
the plain objects would bring back the old peak lr (LambdaLR saves its `base_lrs`) and the old
AdamW settings, silently ignoring a changed config.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from titan_contrastive.checkpoint.manager import CheckpointManager
from titan_contrastive.config import ConfigError
from titan_contrastive.config.epochs import every
from titan_contrastive.grad_cache.rng import RNGSnapshot, capture_rng, cuda_index, restore_rng


class ModelState:
    """The model's parameters and buffers through DCP's state-dict API.

    `get_model_state_dict` strips wrapper prefixes (DDP's `module.`, compile's `_orig_mod.`)
    and keeps FSDP2 parameters as DTensors, so the saved FQNs are those of the plain model and
    DCP can reshard FSDP shards when a run resumes on a different number of processes.
    `trainable_only` (LoRA): frozen parameters are neither saved nor loaded (DCP's
    `ignore_frozen_params`): the run rebuilds them identically from the model folder, and a
    checkpoint holds the adapters alone.
    """

    def __init__(self, model: nn.Module, trainable_only: bool = False) -> None:
        self.model = model
        self.options = StateDictOptions(ignore_frozen_params=True, strict=False) if trainable_only else None

    def state_dict(self) -> dict[str, Any]:
        state = get_model_state_dict(self.model, options=self.options)
        # DCP leaves out a frozen parameter under its first name only: a shared tower's second name stays
        return state if self.options is None else without_frozen(self.model, state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict, options=self.options)


def without_frozen(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """`state` without the entries of `model`'s frozen parameters, under every name they have."""
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in state.items() if k not in frozen}


class OptimizerState:
    """The optimizer state keyed by parameter FQN (not by position), so it reshards like the model.

    On a fresh optimizer `get_optimizer_state_dict` first creates the state with a zero-lr step,
    which gives DCP tensors of the right shape to load into.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        configured = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=state_dict)
        for group, hyperparameters in zip(self.optimizer.param_groups, configured, strict=True):
            group.update(hyperparameters)


class LRSchedulerState:
    """A LambdaLR's position (steps taken), saved in LambdaLR's own format; on load the lr is
    recomputed from this run's schedule at that position (the config's peak, warmup, decay and
    total steps), instead of LambdaLR's saved `base_lrs`."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        scheduler = self.scheduler
        scheduler.last_epoch, scheduler._step_count = int(state_dict["last_epoch"]), int(state_dict["_step_count"])
        lrs = [
            base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
        ]
        for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        scheduler._last_lr = lrs


@dataclass
class TrainState:
    """Counters of the run that the model and optimizer do not hold (identical on every rank)."""

    step: int = 0
    samples_seen: int = 0
    skipped_steps: int = 0

    def advance(self, samples: int, skipped: bool) -> None:
        """Count an optimizer step of `samples` samples (`skipped`: one the finite check or the scaler skipped)."""
        self.step, self.samples_seen, self.skipped_steps = (
            self.step + 1,
            self.samples_seen + samples,
            self.skipped_steps + skipped,
        )

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for f in fields(self):
            setattr(self, f.name, int(state_dict[f.name]))


class RNGState:
    """This rank's global RNG streams: the CPU generator and, on a CUDA device, that device's.

    Restoring them makes anything random after a resume (dropout, augmentation drawn from the
    global generator) continue exactly as the uninterrupted run would have. The states differ
    per rank, so the manager stores them under a per-rank key.
    """

    def __init__(self, device: torch.device | str) -> None:
        device = torch.device(device)
        self.cuda_index = cuda_index(device) if device.type == "cuda" and torch.cuda.is_available() else None

    def state_dict(self) -> dict[str, torch.Tensor]:
        snapshot = capture_rng([] if self.cuda_index is None else [self.cuda_index])
        return {"cpu": snapshot.cpu, **({} if self.cuda_index is None else {"cuda": snapshot.cuda[self.cuda_index]})}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        cuda = {self.cuda_index: state_dict["cuda"]} if self.cuda_index is not None and "cuda" in state_dict else {}
        restore_rng(RNGSnapshot(state_dict["cpu"], cuda))

    def load_resharded(self, states: list[dict[str, torch.Tensor]], dp_rank: int) -> None:
        """Saved by another number of ranks (`checkpoint/reshard.py`): continue the streams of saved rank
        `dp_rank` mod their number."""
        self.load_state_dict(states[dp_rank % len(states)])


def build_checkpointer(
    cfg: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    train_state: TrainState,
    loader: Stateful,
    early_stopping: Stateful | None,
    dp_degree: int,
    ga_steps: int,
    *,
    dist: Any,
    model_args: Any,
) -> CheckpointManager:
    """The run's CheckpointManager (`cfg` is the JobConfig): model, optimizer, schedule and counters
    saved once; each data-parallel rank's loader position and RNG streams per rank (the DP rank is
    the global rank); the manifest records the model (family, args) and the run's config. `dist`:
    this process's parallelisms.DistInfo; `ga_steps`: the run's loader steps per optimizer step
    (`checkpoint.every_epoch` counts in them); `early_stopping`: its count, where `[eval] patience` keeps one."""
    device, rank = dist.device, dist.rank
    if cfg.checkpoint.enable and cfg.checkpoint.async_mode == "async_with_pinned_mem":
        check_forward_keeps_state(model)
    return CheckpointManager(
        cfg.checkpoint,
        dump_folder=cfg.job.dump_folder,
        states={
            "model": ModelState(model, trainable_only=cfg.lora.enable),
            "optimizer": OptimizerState(model, optimizer),
            "lr_scheduler": LRSchedulerState(scheduler),
            "train_state": train_state,
            **({"early_stopping": early_stopping} if early_stopping is not None else {}),
        },
        per_rank_states={"dataloader": loader, "rng": RNGState(device)},
        rank=rank,
        dp_rank=rank,
        dp_degree=dp_degree,
        model_info={"family": cfg.model.name, "args": asdict(model_args)},
        run_config=asdict(cfg),
        due=every(cfg.checkpoint, loader.steps_per_epoch, ga_steps),
    )


def check_forward_keeps_state(model: nn.Module) -> None:
    """`async_with_pinned_mem` copies the state while the next step's forward and backward run: a module
    whose forward writes to its saved state (BatchNorm's running statistics) is refused before step 1."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats:
            raise ConfigError(
                f'checkpoint.async_mode = "async_with_pinned_mem": {name} ({type(module).__name__}) updates its '
                "running statistics in forward, beside the copy of the state that this mode makes; set "
                'checkpoint.async_mode = "async"'
            )
