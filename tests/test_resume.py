"""Resume and crash recovery end to end, through run_train.sh (torchrun, gloo on CPU).

Every comparison is bit-exact (`torch.equal`, `==` on the logged floats): the loss sequence and
the *whole* final checkpoint (model, optimizer, LR scheduler, train state, every rank's data
loader position and RNG state) of an interrupted-and-resumed run against an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from titan_contrastive.checkpoint import FAULT_ENV

REPO = Path(__file__).resolve().parents[1]
STEPS = 6
# small and quick, with what could break exact resumption switched on: augmentation (per-sample
# flips and templates), AdamW with weight decay, warmup + cosine schedule, gradient clipping and
# accumulation (4 microbatches per step on 1 process, 2 on 2). Resuming across an epoch boundary
# is tested on the loader itself in test_data.py.
ARGS = [
    "--training.steps=6",
    "--training.local_batch_size=32",
    "--training.global_batch_size=128",
    "--lr_scheduler.warmup_steps=2",
    "--metrics.log_freq=1",
    "--eval.enable=false",
    "--metrics.enable_tensorboard=false",
    "--checkpoint.enable=true",
    "--checkpoint.keep_latest_k=0",
]
DEBUG_CONFIG = f"--job.config_file={REPO / 'train_configs' / 'debug.toml'}"  # run_train.sh's, for runs without it
FSDP2 = ("--parallelism.data_parallel_replicate_degree=1", "--parallelism.data_parallel_shard_degree=2")


def launch(dump: Path, nproc: int, *args: str, fault: str = "") -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "NGPU": str(nproc),
        "PYTHON": sys.executable,
        "LOG_RANK": "0",
        "CUDA_VISIBLE_DEVICES": "",
        FAULT_ENV: fault,
    }
    return subprocess.run(
        ["./run_train.sh", f"--job.dump_folder={dump}", *ARGS, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def ok(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


def losses(dump: Path) -> dict[int, float]:
    """step -> logged loss; a step logged twice (before a crash and after the resume) must agree."""
    seen: dict[int, float] = {}
    for line in (dump / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            assert seen.setdefault(record["step"], record["loss"]) == record["loss"], record
    return seen


def checkpoint(dump: Path, step: int) -> dict[str, Any]:
    """The checkpoint `step-{step}` as one plain dict (DCP -> torch.save -> torch.load)."""
    flat = dump / f"step-{step}.pt"
    dcp_to_torch_save(dump / "checkpoint" / f"step-{step}", flat)
    return torch.load(flat, weights_only=False)


def assert_identical(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            assert_identical(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_identical(g, w, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), where
    elif isinstance(want, bytes):  # a per-rank state, pickled (see checkpoint.py): compare what it holds
        assert_identical(pickle.loads(got), pickle.loads(want), where)
    else:
        assert got == want, where


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """nproc -> the dump folder of one uninterrupted run on that many processes (checkpoints at
    steps 3 and 6), launched once for the tests that read it."""
    runs: dict[int, Path] = {}

    def get(nproc: int) -> Path:
        if nproc not in runs:
            dump = tmp_path_factory.mktemp(f"whole_{nproc}")
            ok(launch(dump, nproc, "--checkpoint.interval=3"))
            runs[nproc] = dump
        return runs[nproc]

    return get


@pytest.mark.slow  # slow: ~20 s of torchrun launches (test_user_data resumes bit-identically in the default suite)
@pytest.mark.parametrize("nproc", [1, 2])
def test_stop_and_resume_is_bit_identical(tmp_path: Path, uninterrupted: Callable[[int], Path], nproc: int) -> None:
    """2k steps at once vs k steps, then a fresh launch that resumes from step k and runs k more."""
    whole, resumed = uninterrupted(nproc), tmp_path / "resumed"
    # the run that stopped at step 3: its dump folder holds what it saved, step-3
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(whole / "checkpoint" / "step-3", resumed / "checkpoint" / "step-3")
    log = ok(launch(resumed, nproc, "--checkpoint.interval=3"))
    assert "resumed from checkpoint step-3" in log

    want, got = losses(whole), losses(resumed)
    assert sorted(want) == list(range(1, STEPS + 1)) and sorted(got) == [4, 5, 6]
    assert all(got[s] == want[s] for s in got), (got, want)
    final_want, final_got = checkpoint(whole, STEPS), checkpoint(resumed, STEPS)
    per_rank = {f"{name}/dp_rank_{r}" for name in ("dataloader", "rng") for r in range(nproc)}
    assert {"model", "optimizer", "lr_scheduler", "train_state", *per_rank} == final_want.keys()
    assert_identical(final_got, final_want)


@pytest.mark.slow  # slow: ~12 s a mode (test_checkpoint_async's two-process FSDP2 save covers them by default)
@pytest.mark.parametrize("mode, copied", [("async", "copied"), ("async_with_pinned_mem", "copy started")])
def test_background_checkpoints_equal_synchronous_ones(
    tmp_path: Path, uninterrupted: Callable[[int], Path], mode: str, copied: str
) -> None:
    """Two processes, each background mode: step-3 is written while steps 4-6 train (on the saves' own
    gloo group; the pinned mode copies the state beside step 4's forward and backward) and holds what
    the synchronous save of step 3 holds, bit for bit, as does step-6 (the last save, synchronous); the
    losses are the same."""
    whole, background = uninterrupted(2), tmp_path / "background"
    log = ok(launch(background, 2, "--checkpoint.interval=3", f"--checkpoint.async_mode={mode}"))
    assert f"checkpoint step-3: state {copied} in" in log and "saved checkpoint step-6" in log
    assert losses(background) == losses(whole)
    for step in (3, STEPS):
        assert_identical(checkpoint(background, step), checkpoint(whole, step), f"step-{step}")


@pytest.mark.slow  # ~30 s: the default suite's time (CI runs the slow marker too)
def test_kill_during_save_then_rerun_resumes_from_last_complete(tmp_path: Path) -> None:
    """SIGKILL of rank 0 while it writes step-4 (files in step-4.tmp, no manifest, no rename);
    torchrun tears the job down; a plain rerun resumes from step-2, says so, and finishes
    exactly like an uninterrupted run. FSDP2 here (sharded model and optimizer state); the
    stop/resume test above runs the debug config's DDP layout."""
    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    ok(launch(whole, 2, "--checkpoint.interval=2", *FSDP2))

    out = launch(crashed, 2, "--checkpoint.interval=2", *FSDP2, fault="kill_during_save@4")
    assert out.returncode != 0
    folder = crashed / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-4.tmp"]
    assert any((folder / "step-4.tmp").iterdir())  # DCP had written files: a real partial save

    log = ok(launch(crashed, 2, "--checkpoint.interval=2", *FSDP2))
    assert "step-4.tmp (interrupted save) ignored and removed" in log
    assert "resumed from checkpoint step-2" in log and "parallelism: fsdp (replicate 1 x shard 2)" in log
    assert not (folder / "step-4.tmp").exists()

    want, got = losses(whole), losses(crashed)  # `losses` also checks steps 3-4, logged twice
    assert sorted(got) == list(range(1, STEPS + 1)) and got == want
    assert_identical(checkpoint(crashed, STEPS), checkpoint(whole, STEPS))


@pytest.mark.slow  # slow: ~8 s of torchrun launches, the default suite's time (CI runs the slow marker too)
def test_resume_on_another_dp_degree(tmp_path: Path, uninterrupted: Callable[[int], Path]) -> None:
    """A 2-process run's checkpoint, resumed on 1 process by torchrun, trains to the end and says how (its weights
    against the uninterrupted run's: test_reshard.py, in float64); the debug config's microbatch negatives are said
    to shrink with the ranks."""
    (tmp_path / "checkpoint").mkdir()
    shutil.copytree(uninterrupted(2) / "checkpoint" / "step-3", tmp_path / "checkpoint" / "step-3")
    log = ok(launch(tmp_path, 1, "--checkpoint.interval=3"))
    assert "step-3 was saved by 2 data-parallel ranks of local batch 32 and resumes on 1 data-parallel rank" in log
    assert "each contrastive problem now holds the 32 samples of a microbatch on every rank, 64 before" in log
    assert sorted(losses(tmp_path)) == [4, 5, 6] and (tmp_path / "checkpoint" / "step-6").is_dir()
