"""`[profiling]` (components/profiling.py): which steps a window traces, what a run writes for each
window (a Chrome trace and an op table per rank, whole loop iterations, never half a file), across a
resume and on two gloo processes, what a stop inside a window keeps, and the CPU run's refusal of
a CUDA memory snapshot. The snapshot itself needs CUDA: `tests/test_gpu.py`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerAction

from tests.dist_utils import run_distributed
from titan_contrastive.components.profiling import StepProfiler
from titan_contrastive.config.job_config import Profiling
from titan_contrastive.train import main

TINY = [
    "--training.local_batch_size=8",
    "--eval.enable=false",
    "--metrics.enable_tensorboard=false",
    "--lr_scheduler.warmup_steps=1",
    "--profiling.enable=true",
]
CPU = torch.device("cpu")


def expected_actions(windows: list[tuple[int, int]], steps: range) -> dict[int, ProfilerAction]:
    """From the definition: the step before a window warms up, a window's steps record, its last saves."""
    out = dict.fromkeys(steps, ProfilerAction.NONE)
    for first, last in windows:
        out[first - 1] = ProfilerAction.WARMUP
        out.update(dict.fromkeys(range(first, last), ProfilerAction.RECORD))
        out[last] = ProfilerAction.RECORD_AND_SAVE
    return {s: a for s, a in out.items() if s in steps}


@pytest.mark.parametrize(
    "start, steps, freq, last_step, windows",
    [
        (3, 2, 5, 12, [(3, 4), (8, 9)]),  # again every 5 steps; a third window would start after the run
        (3, 2, 5, 8, [(3, 4), (8, 8)]),  # the run's last window ends at its last step
        (1, 3, 0, 20, [(1, 3)]),  # one window, from the first step (nothing to warm up before it)
        (4, 1, 2, 9, [(4, 4), (6, 6), (8, 8)]),
    ],
)
def test_windows_and_actions(start: int, steps: int, freq: int, last_step: int, windows: list) -> None:
    cfg = Profiling(enable=True, start_step=start, steps=steps, freq=freq)
    profiler = StepProfiler(cfg, "unused", rank=0, device=CPU, last_step=last_step)
    run = range(1, last_step + 1)
    assert {s: profiler.action(s) for s in run} == expected_actions(windows, run)
    assert [profiler.window(s) for s in run] == [next((w for w in windows if w[0] <= s <= w[1]), None) for s in run]


def trace_steps(folder: Path) -> set[str]:
    """The `ProfilerStep#k` spans of one rank's trace (it must be whole JSON)."""
    events = json.loads((folder / "rank0_trace.json").read_text())["traceEvents"]
    return {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}


def trace_names(path: Path) -> str:
    return " ".join(e.get("name", "") for e in json.loads(path.read_text())["traceEvents"])


def test_a_run_traces_its_windows_and_a_resumed_run_the_rest(tmp_path: Path) -> None:
    """Windows 2-3 and 5-6 (every 3 steps); the first run ends at step 3, the second resumes there
    and traces 5-6 (its step 4 warms up): each window's folder, named by its first step, holds a whole
    trace of exactly its steps (whole loop iterations: data, step, logging, checkpoint) and an op
    table, and no temporary file."""
    common = [
        f"--job.dump_folder={tmp_path}",
        *TINY,
        "--checkpoint.enable=true",
        "--profiling.start_step=2",
        "--profiling.steps=2",
        "--profiling.freq=3",
    ]
    assert main([*common, "--training.steps=3"]) == 0
    traces = tmp_path / "profile_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["step-2"]
    assert trace_steps(traces / "step-2") == {"ProfilerStep#1", "ProfilerStep#2"}  # steps 2 and 3 of steps 1-3
    assert main([*common, "--training.steps=6"]) == 0  # resumes from step 3
    assert sorted(p.name for p in traces.iterdir()) == ["step-2", "step-5"]
    assert trace_steps(traces / "step-5") == {"ProfilerStep#1", "ProfilerStep#2"}  # steps 5 and 6 of steps 4-6
    names = trace_names(traces / "step-5" / "rank0_trace.json")
    for span in ("enumerate(DataLoader)", "Optimizer.step#AdamW.step", "MetricsProcessor.log_train"):
        assert span in names, span  # the data, the step, the last step's log line
    assert names.count("CheckpointManager.maybe_save") == 2  # each step asks; the last one saves
    table = (traces / "step-5" / "rank0_ops.txt").read_text()
    assert "Self CPU" in table and "aten::mm" in table
    files = sorted(p.relative_to(traces).as_posix() for p in traces.rglob("*") if p.is_file())
    assert files == [f"step-{n}/rank0_{kind}" for n in (2, 5) for kind in ("ops.txt", "trace.json")]


def _two_ranks(dump: str) -> None:
    assert main([f"--job.dump_folder={dump}", *TINY, "--training.steps=2", "--profiling.start_step=2"]) == 0


def test_each_rank_writes_its_own_trace(tmp_path: Path) -> None:
    run_distributed(_two_ranks, 2, str(tmp_path))
    window = tmp_path / "profile_traces" / "step-2"  # the window of step 2, the last
    assert sorted(p.name for p in window.iterdir()) == [
        "rank0_ops.txt",
        "rank0_trace.json",
        "rank1_ops.txt",
        "rank1_trace.json",
    ]
    assert "gloo:all_reduce" in trace_names(window / "rank1_trace.json")  # DDP's gradient reduction, on rank 1


def test_a_stop_inside_a_window_saves_what_it_recorded(tmp_path: Path) -> None:
    """An error (or a preemption's early end) in the middle of window 2-6 leaves the trace of the
    steps done, 2 and 3, and lets the error through."""
    cfg = Profiling(enable=True, start_step=2, steps=5)
    profiler = StepProfiler(cfg, str(tmp_path), rank=0, device=CPU, last_step=10)
    x = torch.randn(64, 64)
    with pytest.raises(RuntimeError, match="stopped"), profiler.loop(first_step=1):
        for _ in range(3):
            x = torch.tanh(x @ x)
            profiler.step()
        raise RuntimeError("stopped")
    folder = tmp_path / "profile_traces" / "step-2"
    assert trace_steps(folder) == {"ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"}  # 3: the unfinished one
    assert "aten::tanh" in trace_names(folder / "rank0_trace.json")


def test_a_memory_snapshot_on_cpu_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    dump = tmp_path / "dump"
    assert main([f"--job.dump_folder={dump}", "--training.device=cpu", "--profiling.memory_snapshot=true"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "error: profiling.memory_snapshot=true records the CUDA caching allocator, and this run is on cpu; set it "
        "false (a CPU trace of the same steps: profiling.enable=true)"
    ]
    assert not dump.exists()
