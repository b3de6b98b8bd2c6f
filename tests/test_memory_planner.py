"""The memory planner on CPU: measured (tensor-byte) peaks, a plan within budget that does not
change training, the vae knob, an impossible budget, the dry run, and the probe itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from titan_contrastive.components.memory_planner import MemoryBudgetError
from titan_contrastive.components.memory_probe import PeakMemory
from titan_contrastive.train import main
from tests.test_trainer import assert_close, make_trainer

PLAN = ["--training.local_batch_size=64", "--training.global_batch_size=128"]


def test_peak_memory_counts_live_tensor_bytes_on_cpu() -> None:
    with PeakMemory(torch.device("cpu")) as probe:
        kept = torch.empty(1000, dtype=torch.float64)  # 8,000 bytes, alive at the end
        for _ in range(3):
            temp = torch.ones(2000, dtype=torch.float32)  # 8,000 bytes; the previous one is freed on rebinding
        view = temp.view(40, 50)  # a view: no new storage
        del temp
    assert probe.peak == 8000 + 2 * 8000  # kept + the new temp while the old one is still bound
    assert view.numel() == 2000 and kept.numel() == 1000


def test_plan_fits_the_budget_and_does_not_change_training(tmp_path: Path) -> None:
    planned = make_trainer(str(tmp_path / "planned"), *PLAN, "--memory.budget_gib=0.04")
    plan = planned.memory_plan
    assert 1 < plan.chunk < 64 and planned.chunk_size == plan.chunk  # chunked, and applied after the restore
    probes = plan.probes["gradcache.chunk_sizes"]
    assert set(probes) >= {1, 2, plan.chunk} and max(probes) <= 2 * plan.chunk  # never probed far past the budget
    usable = 0.04 * (1 - planned.cfg.memory.margin)
    assert probes[plan.chunk] <= usable  # the chosen chunk was measured to fit ...
    assert 2 * plan.chunk not in probes or probes[2 * plan.chunk] > usable  # ... and it is the largest: the next one did not
    planned.train()
    record = [json.loads(line) for line in (tmp_path / "planned" / "metrics.jsonl").read_text().splitlines() if '"memory"' in line][0]
    assert record["peak_gib"] <= 0.04 and record["chunk"] == plan.chunk
    # the probes left no trace: the same run configured with that chunk by hand ends identical
    manual = make_trainer(str(tmp_path / "manual"), *PLAN, "--gradcache.enabled=true", f"--gradcache.chunk_sizes={plan.chunk}")
    manual.train()
    assert_close(dict(planned.model.named_parameters()), dict(manual.model.named_parameters()), rel=0.0)


def test_generous_budget_means_no_chunking(tmp_path: Path) -> None:
    trainer = make_trainer(str(tmp_path), *PLAN, "--memory.budget_gib=10")
    assert trainer.memory_plan.chunk == 64 and trainer.chunk_size is None


def test_vae_plans_the_decoder_chunk(tmp_path: Path) -> None:
    trainer = make_trainer(str(tmp_path), "--model.name=vae", "--data.dataset=emoji", "--training.local_batch_size=16",
                           "--parallelism.data_parallel_replicate_degree=-1", "--parallelism.data_parallel_shard_degree=1",
                           "--memory.budget_gib=0.1")
    plan = trainer.memory_plan
    assert list(plan.chunks) == ["pixel_loss.chunk_size"] and plan.predicted_gib <= 0.1 and 1 < plan.chunk < 16
    assert trainer.model.pixel_loss_options["chunk_size"] == plan.chunk and not trainer.model.pixel_loss_options["adaptive"]
    assert plan.probes["pixel_loss.chunk_size"][plan.chunk] > plan.probes["pixel_loss.chunk_size"][1]  # grows with the chunk


def test_global_negatives_also_plan_the_stream_chunk(tmp_path: Path) -> None:
    trainer = make_trainer(str(tmp_path), *PLAN, "--loss.negatives=global", "--loss.stream_chunk_size=16", "--memory.budget_gib=0.06")
    plan = trainer.memory_plan
    assert list(plan.chunks) == ["gradcache.chunk_sizes", "loss.stream_chunk_size"] and plan.predicted_gib <= 0.06
    assert trainer.global_step.chunk == plan.chunks["loss.stream_chunk_size"] >= 16 and trainer.chunk_size in (plan.chunk, None)
    stream = plan.probes["loss.stream_chunk_size"]
    assert min(stream) == 16 and stream[min(stream)] <= stream[max(stream)]


def test_fused_kernels_have_no_stream_chunk_to_plan(tmp_path: Path) -> None:
    """With the Triton kernels (fixed panels) the stream chunk sets no memory: it is not probed."""
    pytest.importorskip("triton")
    trainer = make_trainer(str(tmp_path), *PLAN, "--loss.negatives=global", "--loss.kernel=triton_exact", "--training.dtype=float32",
                           "--memory.budget_gib=0.06")
    assert list(trainer.memory_plan.chunks) == ["gradcache.chunk_sizes"]


def test_impossible_budget_names_the_smallest_that_works(tmp_path: Path) -> None:
    with pytest.raises(MemoryBudgetError, match=r"^memory.budget_gib=0.0001 cannot be met: even gradcache.chunk_sizes=1 peaks at [0-9.]+ GiB; "
                                                 r"the smallest budget that works is about [0-9.]+ GiB"):
        make_trainer(str(tmp_path), *PLAN, "--memory.budget_gib=0.0001")


def test_dry_run_plans_and_exits(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = [*PLAN, "--memory.budget_gib=0.04", "--memory.plan=true", "--training.dtype=float64", f"--job.dump_folder={tmp_path}",
            "--metrics.enable_tensorboard=false"]
    assert main(args) == 0
    assert not (tmp_path / "metrics.jsonl").exists() or '"train"' not in (tmp_path / "metrics.jsonl").read_text()
    assert main([*args[:2], "--memory.plan=true", *args[4:]]) == 2
    assert "memory.plan=true needs memory.budget_gib > 0" in capsys.readouterr().err
