"""Memory planner: the fastest chunks that fit `[memory] budget_gib`, chosen by measuring real steps.

Knobs are what the run's gradient step offers (`GradientStep.knobs()`), planned in that order:
the samples forwarded at once — the GradCache chunk for contrastive families
(`gradcache.chunk_sizes`; a chunk equal to the local batch means no GradCache) or the decoder
chunk for vae (`pixel_loss.chunk_size`, adaptive off) — then, under global negatives, the loss's
stream chunk (`loss.stream_chunk_size`, from its configured value up to the global batch) with
what is left. The planner gets the knobs and a callable that runs one probe train step at given
knob values, and returns the chosen values; it reads and writes nothing else of the run.

The result is the same at any chunk; the speed is not. Larger chunks usually run faster (fewer,
larger kernels, fewer loss blocks) but not always (caches, allocator pressure), so each chunk that
fits is timed and each knob gets the fastest, the larger one when two are within 3 %.

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
4. restore the snapshot and apply the chunks. The first real step is measured against the plan
   (`measured_first_step`).
Peaks and times are the maximum over ranks, so every rank picks the same chunk. A budget that even
chunk 1 does not meet is an error naming the smallest memory that would work. Probe steps read
their own batches from the dataset; the data loader does not move.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from titan_contrastive.components.memory_probe import PeakMemory
from titan_contrastive.datasets.bad_samples import BAD_SAMPLES
from titan_contrastive.grad_cache.rng import capture_rng, restore_rng
from titan_contrastive.parallelisms.collectives import max_over_ranks

__all__ = [
    "Knob",
    "MemoryBudgetError",
    "MemoryPlan",
    "doubling",
    "fastest",
    "measure_step",
    "measured_first_step",
    "plan_chunks",
    "plan_step",
    "probe_batches",
    "static_bytes",
    "timed_step",
]

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
    checked: bool = False  # a real step has been measured against the plan

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


def measure_step(
    step: Callable[[], object], device: torch.device, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> int:
    """Peak bytes of one train step on this device, max over ranks: what is held between steps
    (CUDA: everything allocated at entry) plus the step's extra peak."""
    optimizer.zero_grad(set_to_none=True)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else static_bytes(model, optimizer)
    with PeakMemory(device) as probe:
        step()
    return int(max_over_ranks(float(base + probe.peak)))


def timed_step(step: Callable[[], object], device: torch.device) -> float:
    """Seconds of one train step (device work included), max over ranks."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    step()
    sync()
    return max_over_ranks(time.perf_counter() - start)


def fastest(seconds: dict[int, float]) -> int:
    """The chunk with the shortest step; among those within TIME_TOLERANCE of it, the largest."""
    best = min(seconds.values())
    return max(c for c, s in seconds.items() if s <= best * (1 + TIME_TOLERANCE))


def plan_chunks(
    knobs: list[Knob],
    *,
    budget_gib: float,
    margin: float,
    step: Callable[[], object],
    device: torch.device,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    stateful: list,
) -> MemoryPlan:
    """Steps 1-4 of the module docstring for each knob in turn (each walk starts from the chunks
    chosen so far); `step()` runs one train step, `stateful` are the objects whose `state_dict`
    the probes may change."""
    snapshot = [copy.deepcopy(s.state_dict()) for s in stateful]
    rng = capture_rng([device] if device.type == "cuda" else [])
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
        logger.info(
            f"memory plan: {knob.name}={c} peaks at {probes[knob.name][c] / GIB:.3f} GiB"
            + (f", step {seconds[knob.name][c]:.3f} s" if fits else " (over budget)")
        )
        return probes[knob.name][c]

    try:
        for knob in knobs:
            knob.apply(knob.candidates[0])
        step()  # warm-up: optimizer state, compilation, allocator
        for knob in knobs:
            first, seen = knob.candidates[0], probes[knob.name]
            if probe(knob, first) > budget:
                raise MemoryBudgetError(
                    f"memory.budget_gib={budget_gib:g} cannot be met: "
                    f"even {knob.name}={first} peaks at {seen[first] / GIB:.3f} GiB; "
                    f"the smallest budget that works is about {seen[first] / GIB / (1 - margin):.3f} GiB (or lower "
                    f"loss.stream_chunk_size, shard the model over more ranks, or use a lower precision)"
                )
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
        restore_rng(rng)
        optimizer.zero_grad(set_to_none=True)
    last = knobs[-1]
    return MemoryPlan(
        chosen,
        probes[last.name][chosen[last.name]] / GIB,
        budget_gib,
        {k: {c: v / GIB for c, v in sorted(p.items())} for k, p in probes.items()},
        {k: dict(sorted(t.items())) for k, t in seconds.items()},
    )


def probe_batches(
    dataset: Any, local_batch_size: int, ga_steps: int, dp_degree: int, rank: int
) -> list[dict[str, torch.Tensor]]:
    """This rank's microbatches for the probe steps, read from the dataset (the loader does not
    move): rank r's microbatch j is samples (j·dp + r)·b … + b, wrapping around."""
    n, b = len(dataset), local_batch_size
    batches = [dataset.__getitems__([((j * dp_degree + rank) * b + i) % n for i in range(b)]) for j in range(ga_steps)]
    return [
        {k: v for k, v in batch.items() if k != BAD_SAMPLES} for batch in batches
    ]  # skips are the loader's to report


def plan_step(
    knobs: dict[str, Sequence[int]],
    probe: Callable[[dict[str, int]], object],
    memory: Any,
    device: torch.device,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    stateful: list,
) -> MemoryPlan:
    """`plan_chunks` over a step's knobs (name -> candidates) within `[memory]`'s budget and margin
    (`memory`: a config.job_config.Memory); `probe(values)` runs one train step with those knob
    values; `stateful` is restored after each probe (None entries are skipped). The chosen values
    are `MemoryPlan.chunks`."""
    budget_gib, margin = memory.budget_gib, memory.margin
    values: dict[str, int] = {}
    plan = plan_chunks(
        [
            Knob(name, list(candidates), functools.partial(values.__setitem__, name))
            for name, candidates in knobs.items()
        ],
        budget_gib=budget_gib,
        margin=margin,
        step=lambda: probe(dict(values)),
        device=device,
        model=model,
        optimizer=optimizer,
        stateful=[s for s in stateful if s is not None],
    )
    logger.info(
        f"memory plan: {', '.join(f'{k}={c}' for k, c in plan.chunks.items())} predicted peak "
        f"{plan.predicted_gib:.3f} GiB, budget {plan.budget_gib:g} GiB (margin {margin:.0%})"
    )
    return plan


def measured_first_step(
    plan: MemoryPlan,
    step: Callable[[], dict[str, float]],
    *,
    device: torch.device,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    record: Callable[[str, int, dict[str, Any]], None],
    step_number: int,
) -> dict[str, float]:
    """The first real step under a plan, through the probe: its measured peak against the plan,
    logged and recorded as step `step_number` through `record(kind, step, values)` (the metrics
    API; kind "memory")."""
    out: dict[str, float] = {}
    peak = measure_step(lambda: out.update(step()), device, model, optimizer) / GIB
    plan.checked = True
    logger.info(
        f"memory: first step peaked at {peak:.3f} GiB; "
        f"planned {plan.predicted_gib:.3f} GiB, budget {plan.budget_gib:g} GiB "
        f"({'within' if peak <= plan.budget_gib else 'OVER'} budget)"
    )
    record(
        "memory",
        step_number,
        {
            "peak_gib": peak,
            "planned_gib": plan.predicted_gib,
            "budget_gib": plan.budget_gib,
            "chunk": plan.chunk,
            "chunks": plan.chunks,
        },
    )
    return out
