"""Checkpointing: bit-exact resume, atomic saves, validation, pruning, FSDP2 resharding, crash mid-save."""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from tests.dist_utils import run_distributed
from titan_contrastive.checkpoint import (
    FAULT_ENV,
    MANIFEST,
    CheckpointError,
    CheckpointManager,
    LRSchedulerState,
    ModelState,
    OptimizerState,
    RNGState,
    TrainState,
)
from titan_contrastive.datasets import EpochLoader, ImageTextDataset, build_dataloader

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Cfg:
    enable: bool = True
    folder: str = "ckpt"
    interval: int = 2
    keep_latest_k: int = 0
    keep_best: str = ""
    load_step: int = -1
    async_mode: str = "disabled"


class Net(nn.Module):
    """Two float64 layers with dropout, so resuming also depends on the restored global RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 8, dtype=torch.float64)
        self.fc2 = nn.Linear(8, 1, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.dropout(torch.tanh(self.fc1(x)), p=0.25, training=True))


def tiny_dataset(n: int = 24) -> ImageTextDataset:
    images = torch.randint(0, 256, (n, 1, 4, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(n) % 3
    return ImageTextDataset(
        name="tiny",
        split="train",
        images=images,
        labels=labels,
        text_ids=labels,
        subjects=["a", "b", "c"],
        templates=["{}", "x {}"],
        mean=(0.5,),
        std=(0.25,),
        class_names=["a", "b", "c"],
        seed=7,
        hflip=True,
        context_length=8,
        source="memory",
        full=True,
    )


@dataclass
class Run:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    train_state: TrainState
    loader: EpochLoader
    manager: CheckpointManager


def make_run(
    dump: Path,
    cfg: Cfg | None = None,
    *,
    seed: int = 0,
    rank: int = 0,
    dp_degree: int = 1,
    fsdp: bool = False,
) -> Run:
    """A fresh model/optimizer/scheduler/loader; `seed` changes the initial parameters."""
    torch.manual_seed(seed)
    model = Net()
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    loader = build_dataloader(
        tiny_dataset(), local_batch_size=4 // dp_degree, dp_rank=rank, dp_world_size=dp_degree, seed=3
    )
    train_state = TrainState()
    manager = CheckpointManager(
        cfg or Cfg(),
        dump_folder=str(dump),
        states={
            "model": ModelState(model),
            "optimizer": OptimizerState(model, optimizer),
            "lr_scheduler": LRSchedulerState(scheduler),
            "train_state": train_state,
        },
        per_rank_states={"dataloader": loader, "rng": RNGState("cpu")},
        rank=rank,
        dp_rank=rank,
        dp_degree=dp_degree,
    )
    torch.manual_seed(100 + rank)  # the dropout stream, different per rank
    return Run(model, optimizer, scheduler, train_state, loader, manager)


def train(run: Run, steps: int) -> list[float]:
    """`steps` optimizer steps; returns the local losses followed by each step's sample indices."""
    losses: list[float] = []
    for _ in range(steps):
        batch = next(run.loader)
        loss = (run.model(batch["image"].flatten(1).double()).squeeze(-1) - batch["label"].double()).pow(2).mean()
        loss.backward()
        run.manager.wait_for_staging()  # as the trainer does: the pinned mode's copy is done before the step
        run.optimizer.step()
        run.scheduler.step()
        run.optimizer.zero_grad()
        run.train_state.step += 1
        run.train_state.samples_seen += len(batch["index"])
        losses.append(loss.item())
        losses.extend(batch["index"].double().tolist())
    return losses


def params(run: Run) -> dict[str, torch.Tensor]:
    return get_model_state_dict(run.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def optim_state(run: Run) -> dict[str, Any]:
    return get_optimizer_state_dict(
        run.model, run.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def assert_equal_states(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert_equal_states(a[key], b[key])
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def saved_run(tmp_path: Path, steps: tuple[int, ...] = (2, 4), **cfg: Any) -> Run:
    """A run that trained to max(steps), saving at each of `steps`."""
    run = make_run(tmp_path, Cfg(**cfg))
    done = 0
    for step in steps:
        train(run, step - done)
        run.manager.save(step)
        done = step
    return run


# ---------------------------------------------------------------- single process


def test_round_trip_is_bit_exact(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = make_run(tmp_path)
    train(run, 3)  # mid-epoch of the loader (6 steps per epoch)
    with caplog.at_level(logging.INFO, logger="titan_contrastive"):
        assert run.manager.maybe_save(3) is False and run.manager.maybe_save(3, last_step=True) is True
    assert "saved checkpoint step-3" in caplog.text
    rand_after_save = torch.rand(5)
    expected_losses = train(run, 5)  # crosses into the next epoch
    manifest = json.loads((tmp_path / "ckpt/step-3" / MANIFEST).read_text())
    assert manifest["step"] == 3 and manifest["dp_degree"] == 1 and manifest["world_size"] == 1
    assert ".metadata" in manifest["files"] and all(
        f["bytes"] > 0 and len(f["sha256"]) == 64 for f in manifest["files"].values()
    )

    fresh = make_run(tmp_path, seed=1)
    assert not torch.equal(params(fresh)["fc1.weight"], params(run)["fc1.weight"])
    with caplog.at_level(logging.INFO, logger="titan_contrastive"):
        assert fresh.manager.load() == 3
    assert f"resumed from checkpoint step-3 ({tmp_path / 'ckpt/step-3'})" in caplog.text
    assert fresh.train_state == TrainState(step=3, samples_seen=12, skipped_steps=0)
    assert torch.equal(torch.rand(5), rand_after_save)
    assert fresh.scheduler.last_epoch == 3 and fresh.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 / 4)
    assert train(fresh, 5) == expected_losses
    assert_equal_states(params(fresh), params(run))
    assert_equal_states(optim_state(fresh), optim_state(run))


def test_disabled_and_empty(tmp_path: Path) -> None:
    off = make_run(tmp_path, Cfg(enable=False))
    assert off.manager.maybe_save(2, last_step=True) is False and off.manager.load() is None
    assert not (tmp_path / "ckpt").exists()
    assert make_run(tmp_path).manager.load() is None and make_run(tmp_path).manager.available_steps() == []


def test_keep_latest_k(tmp_path: Path) -> None:
    run = make_run(tmp_path, Cfg(interval=2, keep_latest_k=2))
    saved = [run.manager.maybe_save(step, last_step=step == 7) for step in range(1, 8)]
    assert saved == [False, True, False, True, False, True, True]
    assert run.manager.available_steps() == [6, 7]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-6", "step-7"]


def test_interrupted_save_is_ignored_and_removed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    saved_run(tmp_path)
    partial = tmp_path / "ckpt/step-6.tmp"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    fresh = make_run(tmp_path, seed=1)
    assert fresh.manager.available_steps() == [2, 4]
    with caplog.at_level(logging.WARNING, logger="titan_contrastive"):
        assert fresh.manager.load() == 4
    assert f"incomplete checkpoint {partial} (interrupted save) ignored" in caplog.text
    assert not partial.exists() and fresh.train_state.step == 4


def _truncate(folder: Path) -> str:
    data = folder / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    return "__0_0.distcp has 100 bytes"


def _delete(folder: Path) -> str:
    (folder / ".metadata").unlink()
    return ".metadata is missing"


def _flip_bytes(folder: Path) -> str:
    """A few flipped bytes in the middle of the data file: same size, different content."""
    data = folder / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    for i in range(len(raw) // 2, len(raw) // 2 + 4):
        raw[i] ^= 0xFF
    data.write_bytes(bytes(raw))
    return "__0_0.distcp: its content does not match the sha256"


def _flip_metadata(folder: Path) -> str:
    meta = folder / ".metadata"
    raw = bytearray(meta.read_bytes())
    raw[-1] ^= 0x01
    meta.write_bytes(bytes(raw))
    return ".metadata: its content does not match the sha256"


def _no_manifest(folder: Path) -> str:
    (folder / MANIFEST).unlink()
    return f"{MANIFEST} is missing"


def _garbage_manifest(folder: Path) -> str:
    (folder / MANIFEST).write_text("{not json")
    return f"{MANIFEST} is unreadable"


@pytest.mark.parametrize("corrupt", [_truncate, _delete, _flip_bytes, _flip_metadata, _no_manifest, _garbage_manifest])
def test_corrupt_checkpoint_is_skipped_or_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, corrupt: Any
) -> None:
    saved_run(tmp_path)
    problem = corrupt(tmp_path / "ckpt/step-4")
    fresh = make_run(tmp_path, seed=1)
    with caplog.at_level(logging.WARNING, logger="titan_contrastive"):
        assert fresh.manager.load() == 2
    assert "checkpoint step-4" in caplog.text and problem in caplog.text and fresh.train_state.step == 2
    with pytest.raises(CheckpointError, match=f"checkpoint step-4 .* is corrupt: .*{problem}"):
        make_run(tmp_path, Cfg(load_step=4)).manager.load()


def test_explicit_load_step(tmp_path: Path) -> None:
    saved_run(tmp_path)
    older = make_run(tmp_path, Cfg(load_step=2), seed=1)
    assert older.manager.load() == 2 and older.train_state.step == 2
    with pytest.raises(CheckpointError) as info:
        make_run(tmp_path, Cfg(load_step=3)).manager.load()
    # loading step 2 rewound the run: step-4 was moved aside (tests/test_faults.py)
    assert "checkpoint.load_step=3 not found" in str(info.value) and "available steps: [2]" in str(info.value)
    assert "\n" not in str(info.value)


def test_all_corrupt_is_an_error(tmp_path: Path) -> None:
    saved_run(tmp_path)
    for step in (2, 4):
        _no_manifest(tmp_path / f"ckpt/step-{step}")
    with pytest.raises(CheckpointError, match="no valid checkpoint .*step-4: manifest.json is missing; step-2"):
        make_run(tmp_path).manager.load()


def test_dcp_failure_names_the_checkpoint(tmp_path: Path) -> None:
    saved_run(tmp_path, steps=(2,))
    run = make_run(tmp_path)
    run.model.fc3 = nn.Linear(1, 1, dtype=torch.float64)  # a key the checkpoint does not have
    with pytest.raises(CheckpointError) as info:
        run.manager.load()
    message = str(info.value)
    assert f"loading checkpoint step-2 ({tmp_path / 'ckpt/step-2'}) failed: rank 0: RuntimeError: " in message
    assert "model.fc3.weight" in message and "\n" not in message


def save_until_killed(dump: str, async_mode: str) -> None:
    """Subprocess body of the fault-injection test: saves step 2, then dies while saving step 4
    (with async_mode "async", in the save's background thread)."""
    run = make_run(Path(dump), Cfg(async_mode=async_mode))
    train(run, 2)
    run.manager.save(2, background=True)
    train(run, 2)
    run.manager.save(4, background=True)
    run.manager.wait()


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_kill_during_save_leaves_previous_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, async_mode: str
) -> None:
    env = {**os.environ, FAULT_ENV: "kill_during_save@4"}
    code = "import sys; from tests.test_checkpoint import save_until_killed; save_until_killed(*sys.argv[1:])"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), async_mode], cwd=REPO, env=env, capture_output=True, timeout=120
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    partial = tmp_path / "ckpt/step-4.tmp"
    # killed after DCP, before the manifest
    assert (partial / ".metadata").is_file() and not (partial / MANIFEST).exists()
    fresh = make_run(tmp_path, seed=1)
    with caplog.at_level(logging.WARNING, logger="titan_contrastive"):
        assert fresh.manager.load() == 2
    assert f"incomplete checkpoint {partial} (interrupted save) ignored" in caplog.text
    assert fresh.manager.available_steps() == [2] and not partial.exists()


# ---------------------------------------------------------------- FSDP2 on 2 gloo processes


def _fsdp_save(tmp: str) -> None:
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    run = make_run(Path(tmp), rank=rank, dp_degree=2, fsdp=True)
    train(run, 2)
    run.manager.save(2)
    # "step" aliases the live state
    at_save = copy.deepcopy({"params_at_save": params(run), "optim_at_save": optim_state(run)})
    rand_after_save = torch.rand(3)
    losses = train(run, 2)
    expected = {"losses": losses, "rand": rand_after_save, "params": params(run), "optim": optim_state(run), **at_save}
    torch.save(expected, Path(tmp) / f"expected_{rank}.pt")


def _fsdp_load(tmp: str) -> None:
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    expected = torch.load(Path(tmp) / f"expected_{rank}.pt", weights_only=False)
    # rank 0 decides and shares its error: every rank raises it instead of hanging in a collective
    with pytest.raises(CheckpointError, match=r"available steps: \[2\]"):
        make_run(Path(tmp), Cfg(load_step=3), rank=rank, dp_degree=2, fsdp=True).manager.load()
    run = make_run(Path(tmp), seed=1, rank=rank, dp_degree=2, fsdp=True)
    assert run.manager.load() == 2 and run.train_state.step == 2
    assert torch.equal(torch.rand(3), expected["rand"])
    assert train(run, 2) == expected["losses"]
    assert_equal_states(params(run), expected["params"])
    assert_equal_states(optim_state(run), expected["optim"])


def test_fsdp2_two_processes_round_trip_and_reshard(tmp_path: Path) -> None:
    run_distributed(_fsdp_save, 2, str(tmp_path))
    manifest = json.loads((tmp_path / "ckpt/step-2" / MANIFEST).read_text())
    assert manifest["dp_degree"] == 2 and manifest["world_size"] == 2
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= manifest["files"].keys()
    run_distributed(_fsdp_load, 2, str(tmp_path))

    # one process: model and optimizer reshard onto it unsharded, the 2 ranks' data positions map onto its one
    # (`reshard.py`): its next batch is the 2 ranks' next batches
    single = make_run(tmp_path, seed=1)
    assert single.manager.load() == 2
    expected = [torch.load(tmp_path / f"expected_{r}.pt", weights_only=False) for r in range(2)]
    assert_equal_states(params(single), expected[0]["params_at_save"])
    assert_equal_states(optim_state(single), expected[0]["optim_at_save"])
    assert next(single.loader)["index"].tolist() == expected[0]["losses"][1:3] + expected[1]["losses"][1:3]


def test_manifest_without_checksums_still_loads(tmp_path: Path) -> None:
    """Checkpoints saved before the checksums (sizes only) validate by size and load."""
    saved_run(tmp_path)
    path = tmp_path / "ckpt/step-4" / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["files"] = {name: entry["bytes"] for name, entry in manifest["files"].items()}
    path.write_text(json.dumps(manifest))
    assert make_run(tmp_path, seed=1).manager.load() == 4
