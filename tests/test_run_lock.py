"""One run per run folder (components/run_lock.py): a second run on a folder in use stops at start
with one line (exit code 2); a lock left by a dead run is taken over on its host and named elsewhere.

The holders are real processes: a live one (`holder`, waiting on its stdin) and a finished one.
The runs are the trainer in this process (`train.main`), one or two tiny steps.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from titan_contrastive.components.run_lock import LOCK_FILE, RunLock, RunLockError, _process_start
from titan_contrastive.train import Trainer, main

TINY = [
    "--training.steps=1",
    "--training.local_batch_size=8",
    "--eval.enable=false",
    "--metrics.enable_tensorboard=false",
    "--lr_scheduler.warmup_steps=0",
]


def run(dump: Path, *args: str) -> int:
    given = {arg.split("=", 1)[0] for arg in args}  # a key in both: args' value, given once
    return main([f"--job.dump_folder={dump}", *(arg for arg in TINY if arg.split("=", 1)[0] not in given), *args])


def write_lock(folder: Path, pid: int, host: str | None = None, **extra: object) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    content = json.dumps(
        {
            "pid": pid,
            "host": host or socket.gethostname(),
            "started": time.time(),
            "pid_start": _process_start(pid),
            **extra,
        }
    )
    (folder / LOCK_FILE).write_text(content)
    return content


def one_error_line(capsys: pytest.CaptureFixture) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture
def holder() -> Iterator[subprocess.Popen]:
    """Another live process on this host."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    yield proc
    proc.stdin.close()
    proc.wait(timeout=30)


def test_second_run_on_a_folder_in_use_stops_before_any_compute(
    tmp_path: Path, holder: subprocess.Popen, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    """It used to run beside the first, both writing checkpoints and metrics.jsonl."""
    content = write_lock(tmp_path, holder.pid)
    with caplog.at_level(logging.INFO, logger="titan_contrastive"):
        assert run(tmp_path) == 2
    line = one_error_line(capsys)
    assert f"job.dump_folder={tmp_path} is in use by pid {holder.pid} on host {socket.gethostname()} (started " in line
    assert "still running; wait for it to finish or choose another job.dump_folder" in line
    # stopped before the data, nothing written
    assert "data:" not in caplog.text and not (tmp_path / "metrics.jsonl").exists()
    assert (tmp_path / LOCK_FILE).read_text() == content  # the holder's lock is untouched


def test_lock_of_a_dead_process_on_this_host_is_taken_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    write_lock(tmp_path, dead.pid)
    with caplog.at_level(logging.INFO, logger="titan_contrastive"):
        assert run(tmp_path) == 0
    assert f"run lock {tmp_path / LOCK_FILE}: its holder, pid {dead.pid} on host {socket.gethostname()}" in caplog.text
    assert "is gone; taking the folder over" in caplog.text
    assert not (tmp_path / LOCK_FILE).exists()  # released at exit


def test_lock_from_another_host_says_how_to_remove_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_lock(tmp_path, 12345, host="node-17")
    assert run(tmp_path) == 2
    line = one_error_line(capsys)
    assert "is in use by pid 12345 on host node-17 (started " in line
    assert (
        f"which this host cannot check; if that job is dead, remove its lock (rm {tmp_path / LOCK_FILE}) and rerun"
        in line
    )


@pytest.mark.parametrize("restart_count", ["0", "1"])
def test_lock_of_the_same_slurm_job_before_its_requeue_is_taken_over(
    tmp_path: Path, restart_count: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A requeued job (higher SLURM_RESTART_COUNT, any node) takes over its earlier incarnation's lock;
    the same incarnation on another node (a second run inside the job) is still refused."""
    write_lock(tmp_path, 12345, host="node-17", slurm_job_id="777", slurm_restart_count=0)
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("SLURM_RESTART_COUNT", restart_count)
    if restart_count == "0":
        assert run(tmp_path) == 2
        assert "is in use by pid 12345 on host node-17" in one_error_line(capsys)
    else:
        assert run(tmp_path) == 0
        assert not (tmp_path / LOCK_FILE).exists()  # taken over, then released at exit


def test_lock_is_held_while_training_and_released_after_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    train_step = Trainer.train_step

    def step_and_look(self, microbatches):
        seen.append(json.loads((tmp_path / "run" / LOCK_FILE).read_text()))
        return train_step(self, microbatches)

    monkeypatch.setattr(Trainer, "train_step", step_and_look)
    assert run(tmp_path / "run") == 0
    assert [(s["pid"], s["host"]) for s in seen] == [(os.getpid(), socket.gethostname())]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["metrics.jsonl"]  # released
    # an error after the lock was taken (the batch is checked after it): released, and the folder it made is gone
    assert run(tmp_path / "new" / "run", "--training.local_batch_size=1") == 2
    assert not (tmp_path / "new").exists()


def test_lock_file_content_and_release_keeps_a_foreign_lock(tmp_path: Path) -> None:
    lock = RunLock()
    lock.acquire(tmp_path / "a" / "b", rank=0, distributed=False)
    held = json.loads((tmp_path / "a" / "b" / LOCK_FILE).read_text())
    assert (
        held["pid"] == os.getpid()
        and held["host"] == socket.gethostname()
        and held["pid_start"] == _process_start(os.getpid())
    )
    with pytest.raises(RunLockError, match="is in use by pid"):  # held, also against this very process
        RunLock().acquire(tmp_path / "a" / "b", rank=0, distributed=False)
    (tmp_path / "a" / "b" / LOCK_FILE).write_text('{"pid": 1, "host": "elsewhere"}')  # replaced behind its back
    lock.release()
    assert (tmp_path / "a" / "b" / LOCK_FILE).exists()  # not ours any more: left alone
