"""Traces of chosen training steps (torch.profiler) and, on CUDA, the caching allocator's history.

`[profiling]` picks windows of steps: `steps` of them from `start_step`, again every `freq` steps.
The step before a window warms the profiler up. A traced step is a whole loop iteration (the wait
for its data, the gradient and optimizer step, its logging, evaluation and checkpoint): where a
trainer loses time against its bare step. Each rank writes its own files into
`{dump_folder}/{folder}/step-{N}/` (N: the window's first step): `rank{r}_trace.json`
(chrome://tracing or Perfetto; its `ProfilerStep#k` is the process's k-th step, from 0),
`rank{r}_ops.txt` (the costliest ops) and, with `memory_snapshot`, `rank{r}_memory_snapshot.pickle`
(pytorch.org/memory_viz) at the window's end; an out-of-memory error dumps the allocator's history
into `oom-step-{N}/` (N: the step that failed). Each file is written under a temporary name and
renamed: a folder never holds half a file.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from titan_contrastive.atomic_write import write_atomically, write_text_atomically
from titan_contrastive.config import ConfigError
from titan_contrastive.config.job_config import JobConfig, Profiling

__all__ = ["StepProfiler"]

logger = logging.getLogger("titan_contrastive")

_MEMORY_HISTORY_ENTRIES = 100_000  # allocation events kept (a rolling window; torchtitan keeps as many)


class StepProfiler:
    """`with profiler.loop(first_step):` around the training loop, `profiler.step()` after each step;
    with neither `enable` nor `memory_snapshot` set, both cost nothing (no profiler is made)."""

    def __init__(self, cfg: Profiling, dump_folder: str, *, rank: int, device: torch.device, last_step: int) -> None:
        if cfg.memory_snapshot and device.type != "cuda":
            raise ConfigError(
                f"profiling.memory_snapshot=true records the CUDA caching allocator, and this run is on {device.type}; "
                "set it false (a CPU trace of the same steps: profiling.enable=true)"
            )
        self.cfg, self.rank, self.device, self.last_step = cfg, rank, device, last_step
        self.folder = Path(dump_folder) / cfg.folder
        self.done = 0  # the last step finished
        self._torch: torch.profiler.profile | None = None

    @classmethod
    def for_run(cls, cfg: JobConfig, rank: int, device: torch.device) -> StepProfiler:
        """The run's profiler: `[profiling]`, in `job.dump_folder`, windows clamped to `training.steps`."""
        return cls(cfg.profiling, cfg.job.dump_folder, rank=rank, device=device, last_step=cfg.training.steps)

    def window(self, step: int) -> tuple[int, int] | None:
        """The first and last step of the window that holds `step`, or None; the last window of the run
        ends at its last step."""
        start, cfg = self.cfg.start_step, self.cfg
        if step >= start and cfg.freq:
            start += (step - start) // cfg.freq * cfg.freq
        last = min(start + cfg.steps - 1, self.last_step)
        return (start, last) if start <= step <= last else None

    def action(self, step: int) -> ProfilerAction:
        """What torch.profiler does during `step`: warm up the step before a window, record its steps and
        save after its last."""
        window = self.window(step)
        if window is not None:
            return ProfilerAction.RECORD_AND_SAVE if step == window[1] else ProfilerAction.RECORD
        return ProfilerAction.WARMUP if self.window(step + 1) is not None else ProfilerAction.NONE

    @contextmanager
    def loop(self, first_step: int) -> Iterator[StepProfiler]:
        """Profile the steps from `first_step` on (a resumed run's first); on an out-of-memory error, dump
        the allocator's history first."""
        self.done = first_step - 1
        with ExitStack() as stack:
            if self.cfg.memory_snapshot:
                torch.cuda.memory._record_memory_history(max_entries=_MEMORY_HISTORY_ENTRIES)
                stack.callback(torch.cuda.memory._record_memory_history, enabled=None)
            if self.cfg.enable:  # leaving it within a window saves what the window recorded
                cuda = [ProfilerActivity.CUDA] if self.device.type == "cuda" else []
                self._torch = stack.enter_context(
                    torch.profiler.profile(
                        activities=[ProfilerActivity.CPU, *cuda],
                        schedule=lambda i: self.action(first_step + i),
                        on_trace_ready=self._save_trace,
                        record_shapes=True,
                    )
                )
            try:
                yield self
            except torch.OutOfMemoryError:
                if self.cfg.memory_snapshot:
                    self._save_memory(f"oom-step-{self.done + 1}")
                raise
            finally:
                self._torch = None

    def step(self) -> None:
        """After each training step."""
        self.done += 1
        if self._torch is not None:
            with warnings.catch_warnings():  # each window is saved on its own (`_save_trace`), none is lost
                warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
                self._torch.step()
        window = self.window(self.done)
        if self.cfg.memory_snapshot and window is not None and window[1] == self.done:
            self._save_memory(f"step-{window[0]}")

    def _path(self, leaf: str, name: str) -> Path:
        folder = self.folder / leaf
        folder.mkdir(parents=True, exist_ok=True)
        return folder / f"rank{self.rank}_{name}"

    def _save_trace(self, prof: torch.profiler.profile) -> None:
        """At a window's end, or when the loop ends inside one (a stop, an error): named by its first step."""
        window = self.window(self.done) or self.window(self.done + 1)
        first = window[0] if window is not None else self.done + 1
        trace = self._path(f"step-{first}", "trace.json")
        write_atomically(trace, lambda tmp: prof.export_chrome_trace(str(tmp)))
        device_time = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=device_time, row_limit=30) + "\n"
        ops = trace.with_name(f"rank{self.rank}_ops.txt")
        write_text_atomically(ops, table)
        if self.rank == 0:
            logger.info(f"profile from step {first}: {trace.parent}")

    def _save_memory(self, leaf: str) -> None:
        path = self._path(leaf, "memory_snapshot.pickle")
        write_atomically(path, lambda tmp: torch.cuda.memory._dump_snapshot(str(tmp)))
        if self.rank == 0:
            logger.info(f"memory snapshot: {path}")
