"""Memory planner: the fastest chunks that fit `[memory] budget_gib`, chosen by measuring real steps.

Knobs, planned in this order: the samples forwarded at once — the GradCache chunk for contrastive
families (`gradcache.chunk_sizes`; a chunk equal to the local batch means no GradCache) or the
decoder chunk for vae (`pixel_loss.chunk_size`, adaptive off) — then, under global negatives, the
loss's stream chunk (`loss.stream_chunk_size`, from its configured value up to the global batch)
with what is left. The result is the same at any chunk; the speed is not. Larger chunks usually run
faster (fewer, larger kernels, fewer loss blocks) but not always (caches, allocator pressure), so
each chunk that fits is timed and each knob gets the fastest, the larger one when two are within
3 %.

Order of operations (after the checkpoint restore, before the first step):
1. snapshot model, optimizer, LR scheduler, train state, loss scaler and RNG;
2. one warm-up train step at the smallest candidates (creates the optimizer state, compiles);
   per knob: measure a train step at its smallest candidate (over budget: error), then
3. walk up the candidates (doubling up to the local / global batch, then that): predict the
   next one's peak by extrapolating linearly from the two largest measured chunks, stop if the
   prediction exceeds budget · (1 - margin), else measure it and stop if the measurement does.
   A chunk that fit runs one more step, timed (the first paid for compiling and allocating at
   that size). The plan is the fastest chunk that fit. No probe is launched that is predicted not
   to fit (on a GPU it could run out of memory; if it does anyway, it counts as over budget);
4. restore the snapshot and apply the chunks. The trainer measures its first real step against it.
Peaks and times are the maximum over ranks, so every rank picks the same chunk. A budget that even
chunk 1 does not meet is an error naming the smallest memory that would work. Probe steps read
their own batches from the dataset; the data loader does not move.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_contrastive.components.memory_probe import PeakMemory
from titan_contrastive.components.streaming_loss import preferred_kernel

__all__ = ["Knob", "MemoryBudgetError", "MemoryPlan", "doubling", "fastest", "measure_step", "measured_first_step", "plan_chunks",
           "plan_trainer", "static_bytes", "timed_step"]

logger = logging.getLogger("titan_contrastive")
GIB = 2**30
TIME_TOLERANCE = 0.03  # chunks this close to the fastest count as equally fast; the larger wins


class MemoryBudgetError(ValueError):
    """`[memory] budget_gib` cannot be met; the message names the smallest memory that works."""


@dataclass
class Knob:
    """One chunk size to plan: its config name, candidates (the first must fit), how to set it."""

    name: str
    candidates: list[int]
    apply: Callable[[int], None]


@dataclass
class MemoryPlan:
    chunks: dict[str, int]  # knob name -> chosen chunk
    predicted_gib: float  # the last probe step's measured peak at the chosen chunks: what a step will use
    budget_gib: float
    probes: dict[str, dict[int, float]]  # knob -> chunk -> measured peak (GiB)
    step_seconds: dict[str, dict[int, float]]  # knob -> chunk that fit -> timed step (s)
    checked: bool = False  # the trainer has measured a real step against the plan

    @property
    def chunk(self) -> int:
        """The primary knob's chunk (GradCache or decoder chunk)."""
        return next(iter(self.chunks.values()))


def doubling(start: int, stop: int) -> list[int]:
    """start, 2·start, 4·start, … below stop, then stop."""
    out = [start]
    while out[-1] * 2 < stop:
        out.append(out[-1] * 2)
    return out + ([stop] if stop > start else [])


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


def _max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor(value, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed_step(step: Callable[[], object], device: torch.device) -> float:
    """Seconds of one train step (device work included), max over ranks."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    step()
    sync()
    return _max_over_ranks(time.perf_counter() - start, device)


def fastest(seconds: dict[int, float]) -> int:
    """The chunk with the shortest step; among those within TIME_TOLERANCE of it, the largest."""
    best = min(seconds.values())
    return max(c for c, s in seconds.items() if s <= best * (1 + TIME_TOLERANCE))


def plan_chunks(knobs: list[Knob], *, budget_gib: float, margin: float, step: Callable[[], object], device: torch.device,
                model: torch.nn.Module, optimizer: torch.optim.Optimizer, stateful: list) -> MemoryPlan:
    """Steps 1-4 of the module docstring for each knob in turn (each walk starts from the chunks
    chosen so far); `step()` runs one train step, `stateful` are the objects whose `state_dict`
    the probes may change."""
    snapshot = [copy.deepcopy(s.state_dict()) for s in stateful]
    rng = torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
    budget = budget_gib * GIB * (1 - margin)
    probes: dict[str, dict[int, int]] = {k.name: {} for k in knobs}
    seconds: dict[str, dict[int, float]] = {k.name: {} for k in knobs}
    chosen: dict[str, int] = {}

    def probe(knob: Knob, c: int) -> int:
        knob.apply(c)
        try:
            probes[knob.name][c] = measure_step(step, device, model, optimizer)
        except torch.OutOfMemoryError:  # over any budget; free what the failed step held
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            probes[knob.name][c] = 2**62
        fits = probes[knob.name][c] <= budget
        if fits:
            seconds[knob.name][c] = timed_step(step, device)
        logger.info(f"memory plan: {knob.name}={c} peaks at {probes[knob.name][c] / GIB:.3f} GiB"
                    + (f", step {seconds[knob.name][c]:.3f} s" if fits else " (over budget)"))
        return probes[knob.name][c]

    try:
        for knob in knobs:
            knob.apply(knob.candidates[0])
        step()  # warm-up: optimizer state, compilation, allocator
        for knob in knobs:
            first, seen = knob.candidates[0], probes[knob.name]
            if probe(knob, first) > budget:
                raise MemoryBudgetError(
                    f"memory.budget_gib={budget_gib:g} cannot be met: even {knob.name}={first} peaks at {seen[first] / GIB:.3f} GiB; "
                    f"the smallest budget that works is about {seen[first] / GIB / (1 - margin):.3f} GiB (or lower "
                    f"loss.stream_chunk_size, shard the model over more ranks, or use a lower precision)")
            for c in knob.candidates[1:]:
                if len(seen) > 1:  # extrapolate from the two largest measured chunks
                    (c0, m0), (c1, m1) = sorted(seen.items())[-2:]
                    if m1 + (m1 - m0) / (c1 - c0) * (c - c1) > budget:
                        break  # predicted over budget: never probe it (on a GPU it might not even fit)
                if probe(knob, c) > budget:
                    break
            chosen[knob.name] = fastest(seconds[knob.name])
            knob.apply(chosen[knob.name])
    finally:
        for s, state in zip(stateful, snapshot):
            s.load_state_dict(state)
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state(rng[1], device)
        optimizer.zero_grad(set_to_none=True)
    last = knobs[-1]
    return MemoryPlan(chosen, probes[last.name][chosen[last.name]] / GIB, budget_gib,
                      {k: {c: v / GIB for c, v in sorted(p.items())} for k, p in probes.items()},
                      {k: dict(sorted(t.items())) for k, t in seconds.items()})


def _streams_in_blocks(trainer: Any) -> bool:
    """Whether the global-negatives loss runs the PyTorch path, whose memory the stream chunk sets;
    the fused kernels' panels are fixed (the trainer's embeddings reach the loss in float32)."""
    return preferred_kernel(trainer.global_step.kernel, trainer.device, torch.float32) == "pytorch"


def plan_trainer(trainer: Any) -> MemoryPlan:
    """`plan_chunks` for a built Trainer: its knobs (decoder chunk for vae; GradCache chunk, then
    the stream chunk under global negatives), probe batches read from its train set (rank r's
    microbatch j is samples (j·dp + r)·b … + b, wrapping around), its train step."""
    cfg, local = trainer.cfg, trainer.cfg.training.local_batch_size
    if trainer.pixel:
        knobs = [Knob("pixel_loss.chunk_size", doubling(1, local),
                      lambda c: trainer.model.pixel_loss_options.update(chunk_size=c, adaptive=False))]
    else:
        def set_chunk(c: int) -> None:
            trainer.chunk_size = c if c < local else None  # the whole microbatch at once: no GradCache

        knobs = [Knob("gradcache.chunk_sizes", doubling(1, local), set_chunk)]
        if trainer.global_step is not None and _streams_in_blocks(trainer):  # streamed loss blocks: ~2 x chunk x N floats
            start = min(cfg.loss.stream_chunk_size, trainer.global_batch_size)
            knobs.append(Knob("loss.stream_chunk_size", doubling(start, trainer.global_batch_size),
                              lambda c: setattr(trainer.global_step, "chunk", c)))
    n = len(trainer.train_set)
    batches = [trainer.train_set.__getitems__([(((j * trainer.dp_degree + trainer.dist.rank) * local) + i) % n for i in range(local)])
               for j in range(trainer.ga_steps)]
    stateful = [trainer.model, trainer.optimizer, trainer.lr_scheduler, trainer.train_state]
    if trainer.precision.scaler is not None:
        stateful.append(trainer.precision.scaler)
    plan = plan_chunks(knobs, budget_gib=cfg.memory.budget_gib, margin=cfg.memory.margin, step=lambda: trainer.train_step(batches),
                       device=trainer.device, model=trainer.model, optimizer=trainer.optimizer, stateful=stateful)
    logger.info(f"memory plan: {', '.join(f'{k}={c}' for k, c in plan.chunks.items())} (local batch {local}) predicted peak "
                f"{plan.predicted_gib:.3f} GiB, budget {plan.budget_gib:g} GiB (margin {cfg.memory.margin:.0%})")
    return plan


def measured_first_step(trainer: Any, batches: list) -> dict[str, float]:
    """The trainer's first step under a plan, through the probe: measured peak against the plan,
    logged and recorded in metrics.jsonl (kind "memory")."""
    out: dict[str, float] = {}
    plan = trainer.memory_plan
    peak = measure_step(lambda: out.update(trainer.train_step(batches)), trainer.device, trainer.model, trainer.optimizer) / GIB
    plan.checked = True
    logger.info(f"memory: first step peaked at {peak:.3f} GiB; planned {plan.predicted_gib:.3f} GiB, budget {plan.budget_gib:g} GiB "
                f"({'within' if peak <= plan.budget_gib else 'OVER'} budget)")
    trainer.metrics.record("memory", trainer.step, {"peak_gib": peak, "planned_gib": plan.predicted_gib, "budget_gib": plan.budget_gib,
                                                    "chunk": plan.chunk, "chunks": plan.chunks})
    return out
