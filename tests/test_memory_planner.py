"""The memory planner on CPU: measured (tensor-byte) peaks, a plan within budget that does not
change training, the fastest fitting chunk (on a controlled clock), the vae knob, an impossible
budget, the dry run, and the probe itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.test_trainer import assert_close, make_trainer
from titan_contrastive.components import memory_planner
from titan_contrastive.components.memory_planner import Knob, MemoryBudgetError, plan_chunks
from titan_contrastive.components.memory_probe import PeakMemory
from titan_contrastive.steps import AccumulateStep
from titan_contrastive.train import main

PLAN = ["--training.local_batch_size=64", "--training.global_batch_size=128"]
HALF = ["--training.local_batch_size=32", "--training.global_batch_size=64"]  # for the default suite's time


def test_peak_memory_counts_live_tensor_bytes_on_cpu() -> None:
    with PeakMemory(torch.device("cpu")) as probe:
        kept = torch.empty(1000, dtype=torch.float64)  # 8,000 bytes, alive at the end
        for _ in range(3):
            temp = torch.ones(2000, dtype=torch.float32)  # 8,000 bytes; the previous one is freed on rebinding
        view = temp.view(40, 50)  # a view: no new storage
        del temp
    assert probe.peak == 8000 + 2 * 8000  # kept + the new temp while the old one is still bound
    assert view.numel() == 2000 and kept.numel() == 1000


def equal_step_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every probe step takes "1 s": which fitting chunk wins no longer depends on the machine's
    load (the timing rule is tested on a fake clock below), so the plan is the largest chunk that
    fits, which the tensor-byte peaks on CPU fix."""
    monkeypatch.setattr(memory_planner, "timed_step", lambda step, device: (step(), 1.0)[1])


def test_plan_fits_the_budget_and_does_not_change_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    equal_step_times(monkeypatch)
    planned = make_trainer(str(tmp_path / "planned"), *HALF, "--eval.enable=false", "--memory.budget_gib=0.04")
    plan = planned.memory_plan
    # chunked, and applied after the restore
    assert 1 < plan.chunk < 32 and planned.gradient_step.chunk_size == plan.chunk
    probes = plan.probes["gradcache.chunk_sizes"]
    seconds = plan.step_seconds["gradcache.chunk_sizes"]
    assert set(probes) >= {1, 2, plan.chunk} and max(probes) <= 2 * max(seconds)  # never probed far past the budget
    usable = 0.04 * (1 - planned.cfg.memory.margin)
    assert set(seconds) == {c for c, peak in probes.items() if peak <= usable}  # every chunk that fit was timed ...
    # ... the chosen fits and is fastest
    assert probes[plan.chunk] <= usable and seconds[plan.chunk] <= min(seconds.values()) * 1.03
    # the walk stopped at the first that did not fit
    assert 2 * max(seconds) not in probes or probes[2 * max(seconds)] > usable
    planned.train()
    record = [
        json.loads(line)
        for line in (tmp_path / "planned" / "metrics.jsonl").read_text().splitlines()
        if '"memory"' in line
    ][0]
    assert record["peak_gib"] <= 0.04 and record["chunk"] == plan.chunk
    # the probes left no trace: the same run configured with that chunk by hand ends identical
    manual = make_trainer(
        str(tmp_path / "manual"),
        *HALF,
        "--eval.enable=false",
        "--gradcache.enabled=true",
        f"--gradcache.chunk_sizes={plan.chunk}",
    )
    manual.train()
    assert_close(dict(planned.model.named_parameters()), dict(manual.model.named_parameters()), rel=0.0)


def test_the_fastest_fitting_chunk_wins_and_the_larger_within_tolerance(monkeypatch: pytest.MonkeyPatch) -> None:
    """plan_chunks on a synthetic step whose memory grows with the chunk and whose duration is set
    on a fake clock: chunk 4 is fastest, 8 is within 3 % of it (chosen), 16 fits but is slower, 32
    is predicted to fit but measured over budget (not timed), 64 is then predicted over (never run)."""
    clock, chunk, cost = [0.0], [1], {1: 8.0, 2: 4.0, 4: 2.0, 8: 2.05, 16: 3.0, 32: 1.0, 64: 0.5}
    mib = {1: 1, 2: 2, 4: 4, 8: 8, 16: 10, 32: 40, 64: 80}
    monkeypatch.setattr(memory_planner.time, "perf_counter", lambda: clock[0])
    model = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    runs: list[int] = []

    def step() -> None:
        runs.append(chunk[0])
        held = torch.empty(mib[chunk[0]] * 2**20, dtype=torch.uint8)
        clock[0] += cost[chunk[0]]
        del held

    knob = Knob("chunk", [1, 2, 4, 8, 16, 32, 64], lambda c: chunk.__setitem__(0, c))
    plan = plan_chunks(
        [knob],
        budget_gib=24 / 1024,
        margin=0.0,
        step=step,
        device=torch.device("cpu"),
        model=model,
        optimizer=sgd,
        stateful=[model, sgd],
    )
    assert plan.chunks == {"chunk": 8} and chunk[0] == 8
    assert plan.step_seconds["chunk"] == pytest.approx({1: 8.0, 2: 4.0, 4: 2.0, 8: 2.05, 16: 3.0})
    assert set(plan.probes["chunk"]) == {1, 2, 4, 8, 16, 32} and 64 not in runs
    assert plan.predicted_gib == plan.probes["chunk"][8] < 24 / 1024


@pytest.mark.slow  # ~20 s: keeps the default suite near 15 min; CI runs the slow marker too
def test_generous_budget_means_no_chunking(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    equal_step_times(monkeypatch)  # measured times pick the chunk otherwise: a loaded machine could favour a small one
    trainer = make_trainer(str(tmp_path), *PLAN, "--memory.budget_gib=10")
    assert trainer.memory_plan.chunk == 64 and isinstance(trainer.gradient_step, AccumulateStep)  # no GradCache chunk


def test_vae_plans_the_decoder_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    equal_step_times(monkeypatch)
    trainer = make_trainer(
        str(tmp_path),
        "--model.name=vae",
        "--data.dataset=emoji",
        "--training.local_batch_size=16",
        "--parallelism.data_parallel_replicate_degree=-1",
        "--parallelism.data_parallel_shard_degree=1",
        "--memory.budget_gib=0.1",
    )
    plan = trainer.memory_plan
    assert list(plan.chunks) == ["pixel_loss.chunk_size"] and plan.predicted_gib <= 0.1 and 1 < plan.chunk < 16
    assert trainer.gradient_step.decode_chunk == plan.chunk  # a fixed decoder chunk: adaptive off
    probes = plan.probes["pixel_loss.chunk_size"]
    assert probes[plan.chunk] > probes[1]  # grows with the chunk


@pytest.mark.slow  # ~20 s: the default suite's time (CI runs the slow marker too)
def test_global_negatives_also_plan_the_stream_chunk(tmp_path: Path) -> None:
    trainer = make_trainer(
        str(tmp_path), *PLAN, "--loss.negatives=global", "--loss.stream_chunk_size=16", "--memory.budget_gib=0.06"
    )
    plan = trainer.memory_plan
    assert list(plan.chunks) == ["gradcache.chunk_sizes", "loss.stream_chunk_size"] and plan.predicted_gib <= 0.06
    assert trainer.gradient_step.streaming.chunk == plan.chunks[
        "loss.stream_chunk_size"
    ] >= 16 and trainer.gradient_step.chunk_size in (plan.chunk, None)
    stream = plan.probes["loss.stream_chunk_size"]
    assert min(stream) == 16 and stream[min(stream)] <= stream[max(stream)]


@pytest.mark.slow  # ~20 s: keeps the default suite near 15 min; CI runs the slow marker too
def test_fused_kernels_have_no_stream_chunk_to_plan(tmp_path: Path) -> None:
    """With the Triton kernels (fixed panels) the stream chunk sets no memory: it is not probed."""
    pytest.importorskip("triton")
    trainer = make_trainer(
        str(tmp_path),
        *PLAN,
        "--loss.negatives=global",
        "--loss.kernel=triton_exact",
        "--training.dtype=float32",
        "--memory.budget_gib=0.06",
    )
    assert list(trainer.memory_plan.chunks) == ["gradcache.chunk_sizes"]


def test_impossible_budget_names_the_smallest_that_works(tmp_path: Path) -> None:
    with pytest.raises(
        MemoryBudgetError,
        match=r"^memory.budget_gib=0.0001 cannot be met: even gradcache.chunk_sizes=1 peaks at [0-9.]+ GiB; "
        r"the smallest budget that works is about [0-9.]+ GiB",
    ):
        make_trainer(str(tmp_path), *HALF, "--memory.budget_gib=0.0001")


@pytest.mark.slow  # ~20 s: the default suite's time (CI runs the slow marker too)
def test_dry_run_plans_and_exits(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = [
        *PLAN,
        "--memory.budget_gib=0.04",
        "--memory.plan=true",
        "--training.dtype=float64",
        f"--job.dump_folder={tmp_path}",
        "--metrics.enable_tensorboard=false",
    ]
    assert main(args) == 0
    assert not (tmp_path / "metrics.jsonl").exists() or '"train"' not in (tmp_path / "metrics.jsonl").read_text()
    assert main([*args[:2], "--memory.plan=true", *args[4:]]) == 2
    assert "memory.plan=true needs memory.budget_gib > 0" in capsys.readouterr().err


@pytest.mark.slow  # ~20 s: keeps the default suite near 15 min; CI runs the slow marker too
def test_two_ranks_plan_the_same_chunks(tmp_path: Path) -> None:
    """torchrun, 2 gloo processes, global negatives: every probe's peak and time is the maximum over
    ranks, so both ranks log the same measurements and the same plan, and the run completes."""
    import os
    import re
    import subprocess
    import sys

    from tests.test_run_train import REPO

    env = {**os.environ, "NGPU": "2", "PYTHON": sys.executable, "LOG_RANK": "0,1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [
            "./run_train.sh",
            f"--job.dump_folder={tmp_path}",
            *PLAN,
            "--training.steps=2",
            "--eval.enable=false",
            "--loss.negatives=global",
            "--memory.budget_gib=0.05",
            "--metrics.enable_tensorboard=false",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = {
        rank: re.findall(rf"\[rank{rank}\]:\[titan_contrastive\] \S+ (memory plan: .*)", out.stdout) for rank in (0, 1)
    }
    assert lines[0] and lines[0] == lines[1]
    assert "gradcache.chunk_sizes=" in lines[0][-1] and "within budget" in out.stdout
