"""The one harness every benchmark in benchmarks/ uses: interleaved timing, memory probes, run metadata, result files.

Benchmarks run from the repository root as modules (`python -m benchmarks.NAME`), so `benchmarks` and
`titan_contrastive` import without path edits. This module imports only torch and the standard library
(matplotlib lazily, for figures), so it also runs in the peers venv (benchmarks/peers_venv.sh, another torch).

Timing (`round_robin`): the compared variants run interleaved in one process, `warmup` untimed rounds and
then `repeats` timed ones, each round starting one variant later, so neither the order within a round
nor slow drift in a shared machine's load favours one variant; per variant the wall times, the process
CPU times (they do not count time spent waiting for a core) and what each call returned; `summary` gives
median / min / max. A variant that runs out of memory is recorded as "OOM" and leaves the rotation.

Memory, per timed call:
- CUDA: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`, absolute and above what was
  allocated when the call started.
- CPU RSS: the kernel's per-process high-water mark (VmHWM in /proc/self/status). Linux >= 4.0 lets a
  process reset it to the current RSS (writing 5 to /proc/self/clear_refs), so `PeakRSS` gives the peak of
  one block of code in-process (this also lowers what getrusage's ru_maxrss reports afterwards). Variants
  measured in one process share one heap: memory the allocator kept from an earlier call is reused, so
  the growth is a lower bound there; a fresh process per variant is exact. Where the reset is refused the
  peak is the process's since it started (`reset` False). getrusage's ru_maxrss cannot be reset, and a
  child inherits its parent's high-water mark when it is spawned, so it is no per-child measure either:
  `run_child` runs a command under a small wrapper interpreter and reports the largest ru_maxrss among
  the wrapper's descendants, whose floor is the wrapper's own few MiB instead of this process's RSS.

Metadata (`metadata`): date, device, CPU model and core counts, torch / CUDA / Python versions, torch
threads, the repository's commit (`git rev-parse HEAD` where git and the .git folder are there, else
$BENCH_COMMIT), the command line, the load average. `package_at` extracts an earlier revision's package,
for a benchmark that runs its code beside this tree's.

Files (`write_results`): NAME.json ({"meta": ..., payload..., "rows": ...}), NAME.csv (the rows plus
meta_* columns) and NAME.png (stamped with the metadata), under benchmarks/results unless the
benchmark's --out says otherwise.

Metadata and result files are benchmarks/_harness_results.py's, subprocesses (`run_child`) and the
launched variant runs (`launch_variants`, `train_flags`, `recall_row`...) benchmarks/_harness_runs.py's,
and the GPU benchmarks' largest-batch search (`SearchLog`, `search_each_mode`, `doubling_search`)
benchmarks/_batch_search.py's, re-exported here: a benchmark imports only `harness`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch

# re-exported: see the docstring
from benchmarks._batch_search import SearchLog, doubling_search, finish_modes, plot_batch_search, search_each_mode
from benchmarks._harness_results import (
    META_COLUMNS,
    REPO,
    RESULTS,
    cpu_model,
    default_device,
    device_name,
    git_commit,
    metadata,
    package_at,
    pyplot,
    save_figure,
    stamp,
    write_csv,
    write_json,
    write_results,
)
from benchmarks._harness_runs import (
    Child,
    launch_variants,
    pairs_data_flags,
    recall_bars,
    recall_benchmark,
    recall_row,
    recall_stderr,
    run_child,
    run_records,
    step_flags,
    train_env,
    train_flags,
    variants_parser,
    wordnet_rows,
)

__all__ = [
    "META_COLUMNS",
    "REPO",
    "RESULTS",
    "Child",
    "Measurement",
    "PeakRSS",
    "SearchLog",
    "cpu_model",
    "default_device",
    "device_name",
    "doubling_search",
    "finish_modes",
    "git_commit",
    "is_oom",
    "launch_variants",
    "metadata",
    "package_at",
    "pairs_data_flags",
    "peak_rss_mib",
    "plot_batch_search",
    "pyplot",
    "reason",
    "recall_bars",
    "recall_benchmark",
    "recall_row",
    "recall_stderr",
    "reset_peak_rss",
    "rotation",
    "round_robin",
    "rss_mib",
    "run_child",
    "run_records",
    "save_figure",
    "search_each_mode",
    "stamp",
    "step_flags",
    "summary",
    "train_env",
    "train_flags",
    "variants_parser",
    "wordnet_rows",
    "write_csv",
    "write_json",
    "write_results",
]


# ---------------------------------------------------------------- statistics and order


def summary(values: Sequence[float]) -> dict[str, float]:
    """{"median", "min", "max", "n"} of `values` ({"n": 0} when there are none)."""
    if not values:
        return {"n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def rotation(names: Sequence[str], round_index: int) -> list[str]:
    """The order of one round: `names` starting at the (round_index mod count)-th."""
    k = round_index % len(names) if names else 0
    return [*names[k:], *names[:k]]


def reason(exc: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


# ---------------------------------------------------------------- memory probes


def status_kib(field: str) -> int | None:
    """A KiB field of /proc/self/status (VmRSS, VmHWM, RssAnon ...); None where /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_mib() -> float | None:
    """This process's resident memory now, MiB (None where /proc is not there)."""
    kib = status_kib("VmRSS")
    return None if kib is None else kib / 1024


def peak_rss_mib() -> float:
    """This process's peak resident memory since it started or since the last `reset_peak_rss`, MiB."""
    kib = status_kib("VmHWM")
    if kib is not None:
        return kib / 1024
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return maxrss / (2**20 if sys.platform == "darwin" else 1024)


def reset_peak_rss() -> bool:
    """Set the peak RSS to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class AnonPeak:
    """The largest RssAnon of this process while it runs, sampled every millisecond by a thread."""

    def __init__(self) -> None:
        self.peak, self.done = status_kib("RssAnon"), threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self) -> None:
        while not self.done.wait(0.001):
            self.peak = max(self.peak, status_kib("RssAnon"))

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return max(self.peak, status_kib("RssAnon"))


class PeakRSS:
    """Peak resident memory of a block of code, this process: `peak_mib` (the high-water mark during
    the block), `start_mib` and `growth_mib` (peak above the RSS when the block started); `reset` tells
    whether the mark could be reset at the start (if not, the peak is the process's since it started)."""

    def __enter__(self) -> PeakRSS:
        self.reset = reset_peak_rss()
        self.start_mib = rss_mib()
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak_mib = peak_rss_mib()
        if self.start_mib is not None:
            self.peak_mib = max(self.peak_mib, self.start_mib)
        self.growth_mib = None if self.start_mib is None else self.peak_mib - self.start_mib


# ---------------------------------------------------------------- interleaved timing


@dataclasses.dataclass
class Measurement:
    """One variant of a `round_robin`: its timed calls and memory peaks (the max over the timed calls)."""

    name: str
    status: str = "ok"  # ok | OOM | skipped
    reason: str = ""
    times_s: list[float] = dataclasses.field(default_factory=list)
    cpu_times_s: list[float] = dataclasses.field(default_factory=list)
    values: list[Any] = dataclasses.field(default_factory=list)  # what each timed call returned (keep_values)
    cuda_peak_bytes: int | None = None
    cuda_peak_extra_bytes: int | None = None  # above the allocation at the call's start
    peak_rss_mib: float | None = None
    rss_growth_mib: float | None = None  # above the RSS at the call's start
    rss_reset: bool | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok" and bool(self.times_s)

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    def row(self) -> dict[str, Any]:
        """The JSON-ready summary: status, median/min/max seconds, times, CPU times, the memory measured."""
        if self.status != "ok":
            return {"status": self.status, **({"reason": self.reason} if self.reason else {})}
        stats, cpu = summary(self.times_s), summary(self.cpu_times_s)
        row: dict[str, Any] = {
            "status": "ok",
            "median_s": stats.get("median"),
            "min_s": stats.get("min"),
            "max_s": stats.get("max"),
            "times_s": self.times_s,
            "median_cpu_s": cpu.get("median"),
            "cpu_times_s": self.cpu_times_s,
        }
        for key in ("cuda_peak_bytes", "cuda_peak_extra_bytes", "peak_rss_mib", "rss_growth_mib", "rss_reset"):
            if getattr(self, key) is not None:
                row[key] = getattr(self, key)
        return row


def is_oom(measurement: Measurement) -> bool:
    """Whether a variant ran out of memory: torch's OutOfMemoryError, or an allocation failure that
    reaches Python as another error (cuBLAS's)."""
    why = measurement.reason.lower()
    return measurement.status == "OOM" or (
        measurement.status == "skipped" and ("out of memory" in why or "alloc_failed" in why)
    )


def _max(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def round_robin(
    variants: Mapping[str, Callable[[], Any]],
    repeats: int,
    *,
    warmup: int = 1,
    before: Callable[[str], None] | None = None,
    device: torch.device | str | None = None,
    rss: bool = True,
    tolerate: Collection[str] | bool = (),
    keep_values: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Measurement]:
    """Time every variant (a no-argument callable) `repeats` times, interleaved.

    `warmup` untimed rounds, then `repeats` timed rounds; round r runs the variants still in the rotation
    starting at the (r mod count)-th (`rotation`). `before(name)` runs untimed before every call (zeroing
    gradients, say). On a CUDA `device` each call is synchronized before and after and its allocator
    peak recorded; `rss` records each timed call's peak RSS (`PeakRSS`; leave it off where the work runs
    in other processes). A call that raises torch.OutOfMemoryError ends its variant as "OOM"; another
    exception ends it as "skipped" with its reason when `tolerate` is True or names the variant, and
    propagates otherwise. The other variants go on. `keep_values`: keep what each timed call returns
    (off by default: returned tensors would stay alive). `log(line)` gets one line per timed round.
    Returns {name: Measurement} in the order of `variants`."""
    dev = torch.device(device) if device is not None else None
    cuda = dev is not None and dev.type == "cuda"
    results = {name: Measurement(name) for name in variants}
    live = list(variants)

    def call(name: str, timed: bool) -> None:
        if before is not None:
            before(name)
        m = results[name]
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        with PeakRSS() if rss and timed else contextlib.nullcontext() as probe:
            start, cpu = time.perf_counter(), time.process_time()
            value = variants[name]()
            if cuda:
                torch.cuda.synchronize(dev)
            elapsed, cpu_elapsed = time.perf_counter() - start, time.process_time() - cpu
        if not timed:
            return
        m.times_s.append(elapsed)
        m.cpu_times_s.append(cpu_elapsed)
        if keep_values:
            m.values.append(value)
        if cuda:
            peak = torch.cuda.max_memory_allocated(dev)
            m.cuda_peak_bytes = int(_max(m.cuda_peak_bytes, peak))
            m.cuda_peak_extra_bytes = int(_max(m.cuda_peak_extra_bytes, peak - base))
        if probe is not None:
            m.peak_rss_mib = _max(m.peak_rss_mib, probe.peak_mib)
            m.rss_growth_mib = _max(m.rss_growth_mib, probe.growth_mib)
            m.rss_reset = probe.reset

    def drop(name: str, status: str, why: str) -> None:
        results[name].status, results[name].reason = status, why
        live.remove(name)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    for r in range(warmup + repeats):
        for name in rotation(live, r):
            failure = None
            try:
                call(name, timed=r >= warmup)
            except torch.OutOfMemoryError as exc:
                failure = ("OOM", reason(exc))
            except Exception as exc:
                if tolerate is not True and name not in (tolerate or ()):
                    raise
                failure = ("skipped", reason(exc))
            if failure is not None:  # outside the except clause: its traceback no longer holds the call's tensors
                drop(name, *failure)
        if log is not None and r >= warmup:
            log(
                f"round {r - warmup + 1}/{repeats}: "
                + "  ".join(f"{name} {results[name].times_s[-1]:.4g}s" for name in variants if name in live)
            )
    return results
