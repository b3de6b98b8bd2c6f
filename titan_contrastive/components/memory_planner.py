"""Memory planner: the largest chunk that fits `[memory] budget_gib`, chosen by measuring real steps.

Which knob: the samples forwarded at once. For contrastive families that is the GradCache chunk
(`gradcache.chunk_sizes`; a chunk equal to the local batch means no GradCache); for the vae family
the decoder chunk (`pixel_loss.chunk_size`, adaptive off). Larger chunks run faster (fewer, larger
kernels; for GradCache nothing changes but the chunking), so the plan is the largest that fits.

Order of operations (after the checkpoint restore, before the first step):
1. snapshot model, optimizer, LR scheduler, train state, loss scaler and RNG;
2. one warm-up train step at chunk 1 (creates the optimizer state, compiles), then measure the
   peak of a train step at chunk 1 (over budget: error);
3. walk up the candidates (powers of two up to the local batch, and the local batch): predict the
   next one's peak by extrapolating linearly from the two largest measured chunks, stop if the
   prediction exceeds budget · (1 - margin), else measure it and stop if the measurement does;
   the plan is the largest measured chunk that fit. So no probe is launched that is predicted not
   to fit (on a GPU it could run out of memory; if it does anyway, it counts as over budget);
4. restore the snapshot and apply the chunk. The trainer measures its first real step against it.
Peaks are the maximum over ranks, so every rank picks the same chunk. A budget that even chunk 1
does not meet is an error naming the smallest memory that would work. Probe steps read their own
batches from the dataset; the data loader does not move.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_contrastive.components.memory_probe import PeakMemory

__all__ = ["MemoryBudgetError", "MemoryPlan", "measure_step", "plan_chunk", "plan_trainer", "static_bytes"]

logger = logging.getLogger("titan_contrastive")
GIB = 2**30


class MemoryBudgetError(ValueError):
    """`[memory] budget_gib` cannot be met; the message names the smallest memory that works."""


@dataclass
class MemoryPlan:
    knob: str
    chunk: int
    predicted_gib: float  # the probe step's measured peak at `chunk`: what a training step will use
    budget_gib: float
    probes: dict[int, float]  # chunk -> measured peak (GiB)
    checked: bool = False  # the trainer has measured a real step against the plan


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def static_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters, buffers and optimizer state held between steps (this rank's shards)."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(_local_bytes(t) for t in tensors)


def measure_step(step: Callable[[], object], device: torch.device, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Peak bytes of one train step on this device, max over ranks: what is held between steps
    (CUDA: everything allocated at entry) plus the step's extra peak."""
    optimizer.zero_grad(set_to_none=True)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else static_bytes(model, optimizer)
    with PeakMemory(device) as probe:
        step()
    peak = torch.tensor(float(base + probe.peak), device=device)
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


def plan_chunk(*, knob: str, local_batch: int, budget_gib: float, margin: float, apply: Callable[[int], None],
               step: Callable[[], object], device: torch.device, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               stateful: list) -> MemoryPlan:
    """Steps 1-5 of the module docstring; `apply(c)` sets the chunk, `step()` runs one train step,
    `stateful` are the objects whose `state_dict` the probes may change."""
    snapshot = [copy.deepcopy(s.state_dict()) for s in stateful]
    rng = torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
    budget = budget_gib * GIB * (1 - margin)
    probes: dict[int, int] = {}

    def probe(c: int) -> int:
        apply(c)
        try:
            probes[c] = measure_step(step, device, model, optimizer)
        except torch.OutOfMemoryError:  # over any budget; free what the failed step held
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            probes[c] = 2**62
        logger.info(f"memory plan: {knob}={c} peaks at {probes[c] / GIB:.3f} GiB")
        return probes[c]

    try:
        apply(1)
        step()  # warm-up: optimizer state, compilation, allocator
        if probe(1) > budget:
            raise MemoryBudgetError(
                f"memory.budget_gib={budget_gib:g} cannot be met: even {knob}=1 peaks at {probes[1] / GIB:.3f} GiB; "
                f"the smallest budget that works is about {probes[1] / GIB / (1 - margin):.3f} GiB (or shard the model, "
                f"e.g. FSDP2 over more ranks, or use a lower precision)")
        chunk = 1
        for c in sorted({*(2**k for k in range(1, local_batch.bit_length()) if 2**k <= local_batch), local_batch} - {1}):
            (c0, m0), (c1, m1) = sorted(probes.items())[-2:] if len(probes) > 1 else ((0, 0), (1, probes[1]))
            if len(probes) > 1 and m1 + (m1 - m0) / (c1 - c0) * (c - c1) > budget:
                break  # predicted over budget: never probe it (on a GPU it might not even fit)
            if probe(c) > budget:
                break
            chunk = c
    finally:
        for s, state in zip(stateful, snapshot):
            s.load_state_dict(state)
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state(rng[1], device)
        optimizer.zero_grad(set_to_none=True)
    apply(chunk)
    return MemoryPlan(knob, chunk, probes[chunk] / GIB, budget_gib, {c: v / GIB for c, v in sorted(probes.items())})


def plan_trainer(trainer: Any) -> MemoryPlan:
    """`plan_chunk` for a built Trainer: its knob, probe batches read from its train set (rank r's
    microbatch j is samples (j·dp + r)·b ... + b, wrapping around), its train step."""
    cfg, local = trainer.cfg, trainer.cfg.training.local_batch_size
    if trainer.pixel:
        knob = "pixel_loss.chunk_size"

        def apply(c: int) -> None:
            trainer.model.pixel_loss_options.update(chunk_size=c, adaptive=False)
    else:
        knob = "gradcache.chunk_sizes"

        def apply(c: int) -> None:
            trainer.chunk_size = c if c < local else None  # the whole microbatch at once: no GradCache
    n = len(trainer.train_set)
    batches = [trainer.train_set.__getitems__([(((j * trainer.dp_degree + trainer.dist.rank) * local) + i) % n for i in range(local)])
               for j in range(trainer.ga_steps)]
    stateful = [trainer.model, trainer.optimizer, trainer.lr_scheduler, trainer.train_state]
    if trainer.precision.scaler is not None:
        stateful.append(trainer.precision.scaler)
    plan = plan_chunk(knob=knob, local_batch=local, budget_gib=cfg.memory.budget_gib, margin=cfg.memory.margin, apply=apply,
                      step=lambda: trainer.train_step(batches), device=trainer.device, model=trainer.model,
                      optimizer=trainer.optimizer, stateful=stateful)
    logger.info(f"memory plan: {knob}={plan.chunk} (local batch {local}) predicted peak {plan.predicted_gib:.3f} GiB, "
                f"budget {plan.budget_gib:g} GiB (margin {cfg.memory.margin:.0%}); probes: "
                + ", ".join(f"{c}: {g:.3f}" for c, g in plan.probes.items()))
    return plan
