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

Metadata and result files are benchmarks/_harness_results.py's, and the GPU benchmarks' largest-batch
search (`SearchLog`, `search_each_mode`, `doubling_search`) benchmarks/_batch_search.py's, re-exported
here: a benchmark imports only `harness`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
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
    "metadata",
    "package_at",
    "peak_rss_mib",
    "plot_batch_search",
    "pyplot",
    "reason",
    "reset_peak_rss",
    "rotation",
    "round_robin",
    "rss_mib",
    "run_child",
    "save_figure",
    "search_each_mode",
    "stamp",
    "summary",
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


def _status_kib(field: str) -> int | None:
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
    kib = _status_kib("VmRSS")
    return None if kib is None else kib / 1024


def peak_rss_mib() -> float:
    """This process's peak resident memory since it started or since the last `reset_peak_rss`, MiB."""
    kib = _status_kib("VmHWM")
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


# ---------------------------------------------------------------- subprocesses

_WRAPPER = """\
import json, resource, subprocess, sys
rc = subprocess.call(sys.argv[2:])
with open(sys.argv[1], "w") as f:
    json.dump({"rc": rc, "maxrss_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}, f)
sys.exit(rc if rc >= 0 else 128 - rc)
"""


def train_env(nproc: int = 1, config_file: str | None = None) -> dict[str, str]:
    """The environment of a `./run_train.sh` launch from a benchmark: this interpreter, `nproc`
    ranks, rank 0's log only, and `config_file` as CONFIG_FILE when given."""
    env = {**os.environ, "NGPU": str(nproc), "PYTHON": sys.executable, "LOG_RANK": "0"}
    return env | ({"CONFIG_FILE": config_file} if config_file else {})


@dataclasses.dataclass
class Child:
    """A finished `run_child`: exit code, captured output, wall time, peak RSS of its largest process."""

    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    peak_rss_mib: float | None


def run_child(
    cmd: Sequence[str | os.PathLike],
    *,
    cwd: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    check: bool = False,
) -> Child:
    """Run `cmd` with its output captured (text), like subprocess.run, and measure the peak RSS of the
    largest process in its tree (ru_maxrss of the reaped descendants of a small wrapper interpreter).
    The tree gets its own session: on a timeout (subprocess.TimeoutExpired) or an interrupt the whole
    tree is killed. `check`: a non-zero exit raises subprocess.CalledProcessError."""
    with tempfile.TemporaryDirectory(prefix="bench_child_") as tmp:
        report = Path(tmp) / "rusage.json"
        wrapped = [sys.executable, "-I", "-S", "-c", _WRAPPER, str(report), *map(str, cmd)]
        start = time.perf_counter()
        proc = subprocess.Popen(
            wrapped,
            cwd=cwd,
            env=None if env is None else dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException as exc:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            if isinstance(exc, subprocess.TimeoutExpired):
                raise subprocess.TimeoutExpired(list(map(str, cmd)), timeout or 0.0, out, err) from None
            raise
        wall = time.perf_counter() - start
        usage = json.loads(report.read_text()) if report.is_file() else {}
    rc = usage.get("rc", proc.returncode)
    maxrss = usage.get("maxrss_kib")  # ru_maxrss: KiB on Linux, bytes on macOS
    peak = None if maxrss is None else maxrss / (2**20 if sys.platform == "darwin" else 1024)
    child = Child(rc, out, err, wall, peak)
    if check and rc != 0:
        raise subprocess.CalledProcessError(rc, list(map(str, cmd)), out, err)
    return child


def variants_parser(description: str, variants: Sequence[str]) -> argparse.ArgumentParser:
    """The options of a benchmark made of `launch_variants` runs: --out, --collect, --variants, --device."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--collect", type=Path, default=None, help="read PREFIX_{variant} dumps instead of running")
    parser.add_argument("--variants", nargs="+", default=list(variants), choices=list(variants))
    parser.add_argument("--device", default="2-core CPU", help="named in the JSON")
    return parser


def train_flags(
    dump: Path, *, steps: int, batch: int, lr: float, warmup: int, log_freq: int, chunk: int = 0
) -> list[str]:
    """`./run_train.sh` and the flags every variant run sets: its dump folder (no TensorBoard), steps,
    local batch, lr, warm-up steps, log frequency, and GradCache chunks of `chunk` when > 0."""
    return [
        "./run_train.sh",
        f"--job.dump_folder={dump}",
        "--metrics.enable_tensorboard=false",
        f"--training.steps={steps}",
        f"--training.local_batch_size={batch}",
        f"--optimizer.lr={lr}",
        f"--lr_scheduler.warmup_steps={warmup}",
        f"--metrics.log_freq={log_freq}",
        *(["--gradcache.enabled=true", f"--gradcache.chunk_sizes={chunk}"] if chunk else []),
    ]


def run_records(name: str, dump: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the last eval record, the train records) of variant `name`'s finished run in `dump`; a run
    without an eval record stops the benchmark."""
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    if not evals:
        raise SystemExit(f"{dump}/metrics.jsonl has no eval record: did the {name} run finish?")
    return evals[-1], [r for r in records if r["kind"] == "train"]


def recall_stderr(r: float, n: int) -> float:
    """The standard error of a recall r over n queries (the sampling of the queries, not of training runs)."""
    return (r * (1 - r) / n) ** 0.5


def pairs_data_flags(train: str | Path, test: str | Path, context: int) -> list[str]:
    """The flags of a run on text-pair files: `train` (a path, or paths joined with `::`), `test`
    held out, both sides cut at `context` tokens."""
    return [
        "--data.dataset=pairs",
        f"--data.path={train}",
        f"--data.val_path={test}",
        f"--data.context_length={context}",
        f"--data.doc_context_length={context}",
    ]


def recall_row(name: str, dump: Path, *, n_test: int, batch: int) -> dict[str, Any]:
    """Variant `name`'s finished run in `dump` as a row: steps, eval loss, query-to-document
    recall@1/@10 with their standard errors over `n_test` queries, BEIR nDCG@10 when evaluated,
    the logged samples/s and the training loss by samples seen (`batch` per step)."""
    last, train = run_records(name, dump)
    row: dict[str, Any] = {"variant": name, "steps": last["step"], "eval_loss": last["loss"]}
    for k in (1, 10):
        r = last[f"query_to_doc_r@{k}"]
        row[f"r@{k}"], row[f"se_r@{k}"] = r, recall_stderr(r, n_test)
    row["beir_ndcg@10"] = last.get("beir/ndcg@10")
    row["samples_per_s"] = [r["samples_per_s"] for r in train]
    row["train_loss"] = [(r["step"] * batch, r["loss"]) for r in train]
    return row


def wordnet_rows(split: str) -> list[list[str]]:
    """The bundled WordNet pairs of `split` ("train": definition, lemma, sibling negative; "test":
    definition, lemma), as the bundle stores them."""
    import csv
    import gzip

    with gzip.open(REPO / "titan_contrastive/assets/wordnet" / f"pairs_{split}.tsv.gz", "rt", encoding="utf-8") as f:
        return list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))


def launch_variants(
    names: Sequence[str],
    command: Callable[[str, Path], list[str]],
    read: Callable[[str, Path], dict[str, Any]],
    *,
    prefix: Path,
    collect: bool,
    config_file: str,
) -> Iterator[dict[str, Any]]:
    """One real `run_train.sh` launch of `config_file` per variant (`command(name, dump)`, the dump
    folder `{prefix}_{name}`), each row `read(name, dump)` plus the launch's wall time and peak RSS;
    with `collect`, the finished dumps are re-read instead (wall time and RSS are then unknown: they
    are not in metrics.jsonl). A failed launch stops the benchmark with its output's tail."""
    for name in names:
        dump = Path(f"{prefix}_{name}")
        wall = peak_rss = None
        if not collect:
            result = run_child(command(name, dump), cwd=REPO, env=train_env(config_file=config_file))
            if result.returncode != 0:
                raise SystemExit(f"variant {name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
            wall, peak_rss = result.wall_s, result.peak_rss_mib
        yield {**read(name, dump), "wall_s": wall, "peak_rss_mib": peak_rss}
