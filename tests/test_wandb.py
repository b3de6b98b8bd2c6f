"""`[metrics] enable_wandb`: the run's records reach Weights & Biases (offline: the real client
writing its run file, no network), and a machine without the package is told so before anything runs."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.needs import needs
from titan_contrastive.train import main

ARGS = [
    "--training.steps=3",
    "--training.local_batch_size=8",
    "--eval.enable=false",
    "--metrics.log_freq=1",
    "--metrics.enable_tensorboard=false",
    "--lr_scheduler.warmup_steps=1",
    "--metrics.enable_wandb=true",
]


def _flushed() -> None:
    """Stop W&B's service process, which writes the offline run files and outlives a run in this one test
    process: after `run.finish()` a session's file may still be open (once, on CI, the resumed session's file
    held its header only when read); a training process's exit does the same through W&B's atexit hook."""
    import wandb

    wandb.teardown()


def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)


@needs("wandb")
def test_every_train_record_reaches_the_offline_wandb_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run file of the offline run holds the config and each logged loss, as metrics.jsonl has them
    (W&B stores each value as its JSON text)."""
    _offline(monkeypatch)
    assert main([f"--job.dump_folder={tmp_path}", *ARGS]) == 0
    _flushed()
    [run_file] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    data = run_file.read_bytes()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in ("train/loss", "train/lr", "train/grad_norm", "train/samples_per_s", "enable_wandb", "local_batch_size"):
        assert key.encode() in data, key
    for record in records:
        assert json.dumps(record["loss"]).encode() in data, record["loss"]


@needs("wandb")
def test_a_resumed_run_continues_the_wandb_run_and_a_fresh_one_starts_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The id is kept in {dump_folder}/wandb/run_id: the run resumed from step 2's checkpoint logs steps
    3-4 under the same W&B id (the offline client names each session's folder by it); a run in the same
    folder that resumes nothing (its checkpoints removed) is a new W&B run."""
    _offline(monkeypatch)
    args = [a for a in ARGS if not a.startswith("--training.steps=")]
    common = [f"--job.dump_folder={tmp_path}", *args, "--checkpoint.enable=true"]
    id_file = tmp_path / "wandb" / "run_id"
    assert main([*common, "--training.steps=2"]) == 0
    _flushed()  # the first session's file final before the second session starts
    first = id_file.read_text().strip()
    assert [p.name.endswith(f"-{first}") for p in (tmp_path / "wandb").glob("offline-run-*")] == [True]
    assert main([*common, "--training.steps=4"]) == 0  # resumes at step 2
    _flushed()
    assert id_file.read_text().strip() == first
    sessions = sorted((tmp_path / "wandb").glob("offline-run-*"))  # offline-run-<start time>-<id>: in start order
    assert len(sessions) == 2 and all(f"-{first}" in p.name for p in sessions)
    [run_file] = sessions[1].glob("run-*.wandb")
    data = run_file.read_bytes()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records[2:]:
        assert json.dumps(record["loss"]).encode() in data, record["loss"]

    for folder in (tmp_path / "checkpoint").iterdir():
        shutil.rmtree(folder)
    assert main([*common, "--training.steps=2"]) == 0  # starts again at step 1: not a continuation
    second = id_file.read_text().strip()
    assert second != first and len(list((tmp_path / "wandb").glob(f"offline-run-*-{second}"))) == 1


def test_without_the_package_it_is_one_line_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as on a machine without the extra
    assert main([f"--job.dump_folder={tmp_path / 'dump'}", *ARGS]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: metrics.enable_wandb=true needs the wandb package, which is not installed: pip install -e "
        "'.[wandb]' (or set metrics.enable_wandb=false)"
    ]
    assert not (tmp_path / "dump").exists()
