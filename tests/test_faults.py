"""Faults and recovery (README, "Faults and recovery"): what a careless or unlucky run meets.

Each test drives the real trainer (`train.main`, in this process where one process suffices;
`run_train.sh` with torchrun for the stalled rank) and checks the exit code, the one-line message
and what is left on disk. Corruption of a checkpoint (flipped bytes, truncation, a lost
manifest) and its fallback are covered in `tests/test_checkpoint.py`; a kill during a save in
`tests/test_resume.py`; exit codes through `run_train.sh` in `tests/test_launcher.py`.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from titan_contrastive.components.lr_scheduler import lr_factor
from titan_contrastive.train import main

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "--training.local_batch_size=16",
    "--eval.enable=false",
    "--metrics.log_freq=1",
    "--metrics.enable_tensorboard=false",
    "--checkpoint.enable=true",
    "--checkpoint.interval=2",
    "--checkpoint.keep_latest_k=0",
    "--lr_scheduler.warmup_steps=2",
]


def run(dump: Path, *args: str) -> int:
    """The trainer's exit code for TINY with `args` (a key given in both: args' value, once)."""
    given = {arg.split("=", 1)[0] for arg in args}
    return main([f"--job.dump_folder={dump}", *(arg for arg in TINY if arg.split("=", 1)[0] not in given), *args])


def train_records(dump: Path) -> dict[int, dict]:
    return {
        r["step"]: r for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"
    }


def full_disk_when_writing(monkeypatch: pytest.MonkeyPatch, folder_suffix: str) -> None:
    """DCP's file writes into a folder ending in `folder_suffix` leave a partial file and fail with
    ENOSPC, as on a full disk (in the loop or in a background save's thread)."""
    from torch.distributed.checkpoint import FileSystemWriter

    real = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if str(self.path).endswith(folder_suffix):
            (Path(self.path) / "__0_0.distcp").write_bytes(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)


def steps_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def one_error_line(capsys: pytest.CaptureFixture) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


# ------------------------------------------------------------------ resume semantics


def test_changed_lr_and_steps_on_resume_are_applied_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The restored scheduler used to keep the old peak lr; now the config's schedule is recomputed
    at the restored step, and every changed key is logged."""
    assert run(tmp_path, "--training.steps=4", "--optimizer.lr=1e-3") == 0
    with caplog.at_level(logging.INFO, logger="titan_contrastive"):
        assert run(tmp_path, "--training.steps=6", "--optimizer.lr=5e-4", "--training.max_norm=0.5") == 0
    assert "resumed from checkpoint step-4" in caplog.text
    for change in ("optimizer.lr: 0.001 -> 0.0005", "training.steps: 4 -> 6", "training.max_norm: 1.0 -> 0.5"):
        assert f"config changed since step-4, applied: {change}" in caplog.text
    logged = train_records(tmp_path)
    for step in (5, 6):  # the new peak and the new total steps
        want = 5e-4 * lr_factor(step - 1, warmup_steps=2, total_steps=6, decay_type="cosine", min_lr_factor=0.0)
        assert logged[step]["lr"] == pytest.approx(want, rel=1e-12)
    assert logged[4]["lr"] == pytest.approx(
        1e-3 * lr_factor(3, warmup_steps=2, total_steps=4, decay_type="cosine", min_lr_factor=0.0)
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (
            "--optimizer.layer_decay=0.9",
            "optimizer.layer_decay: 1.0 -> 0.9 since checkpoint step-2, but the optimizer's parameter groups are built "
            "from it",
        ),
        ("--data.context_length=16", "checkpoint step-2 holds a different architecture (context_length: 32 -> 16"),
        (
            "--model.freeze=text",
            "model.freeze: [] -> ['text'] since checkpoint step-2, but the frozen parameters have no optimizer state",
        ),
    ],
)
def test_incompatible_resume_is_one_line_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture, change: str, message: str
) -> None:
    assert run(tmp_path, "--training.steps=2") == 0
    capsys.readouterr()
    assert run(tmp_path, "--training.steps=4", change) == 2
    line = one_error_line(capsys)
    assert message in line and "checkpoint.folder=<new folder>" in line, line
    assert max(train_records(tmp_path)) == 2  # nothing trained


def test_a_model_field_added_since_the_checkpoint_is_not_an_architecture_change() -> None:
    """A checkpoint written before a family gained an arg (bi_encoder's `bidirectional`) resumes; a change of an
    arg it holds is still refused."""
    from titan_contrastive.checkpoint.resume import IncompatibleResume, config_changes

    saved = {"model": {"family": "bi_encoder", "args": {"path": "m", "pooling": "mean"}}}
    now = {"family": "bi_encoder", "args": {"path": "m", "pooling": "mean", "bidirectional": False}}
    assert config_changes(2, saved, None, now) == []
    with pytest.raises(IncompatibleResume, match=r"different architecture \(pooling: 'mean' -> 'cls'\)"):
        config_changes(2, saved, None, {**now, "args": {**now["args"], "pooling": "cls"}})


def test_load_step_rewind_moves_newer_checkpoints_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """After a rewind the abandoned run's newer checkpoints used to win the next auto-resume."""
    folder = tmp_path / "checkpoint"
    assert run(tmp_path, "--training.steps=6") == 0
    assert steps_in(folder) == ["step-2", "step-4", "step-6"]
    abandoned = {name: (folder / name / "manifest.json").read_bytes() for name in ("step-4", "step-6")}
    with caplog.at_level(logging.INFO, logger="titan_contrastive"):
        assert run(tmp_path, "--training.steps=4", "--checkpoint.load_step=2", "--optimizer.lr=2e-4") == 0
    aside = [p for p in folder.iterdir() if p.name.startswith("abandoned-")]
    assert len(aside) == 1 and steps_in(aside[0]) == ["step-4", "step-6"]  # moved, not deleted
    assert all((aside[0] / name / "manifest.json").read_bytes() == data for name, data in abandoned.items())
    assert "checkpoint.load_step=2 rewinds the run" in caplog.text
    assert steps_in(folder) == [aside[0].name, "step-2", "step-4"]  # step-4 of the new history
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="titan_contrastive"):
        assert run(tmp_path, "--training.steps=5", "--optimizer.lr=2e-4") == 0  # auto-resume: the new history
    assert "resumed from checkpoint step-4" in caplog.text and "config changed" in caplog.text  # training.steps 4 -> 5


# ------------------------------------------------------------------ non-finite steps


def test_endless_skipping_stops_and_spares_the_last_good_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """An lr of 1e30 makes every step after the first non-finite: with on_nonfinite=skip the run used
    to finish (exit 0) and keep_latest_k pruned the good checkpoints in favour of the stuck model."""
    code = run(
        tmp_path,
        "--training.steps=20",
        "--optimizer.lr=1e30",
        "--lr_scheduler.warmup_steps=0",
        "--training.max_norm=0",
        "--training.on_nonfinite=skip",
        "--training.max_consecutive_skips=3",
        "--checkpoint.interval=1",
        "--checkpoint.keep_latest_k=1",
    )
    assert code == 3
    line = one_error_line(capsys)
    assert "step 5: non-finite loss=nan, grad_norm=nan, 4 steps in a row, past training.max_consecutive_skips=3" in line
    assert "that is checkpoint step-1 (--checkpoint.load_step=1)" in line
    assert steps_in(tmp_path / "checkpoint") == ["step-1", "step-4"]  # step-1: the last before the skipping, kept
    assert [r["skipped_steps"] for r in train_records(tmp_path).values()] == [0, 1, 2, 3]


# ------------------------------------------------------------------ output folders and disk space


def test_dump_folder_that_is_a_file_fails_before_any_data(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert run(blocker / "run", "--training.steps=2") == 2
    line = one_error_line(capsys)
    assert f"job.dump_folder={blocker / 'run'}: cannot write there ({blocker} is a file, not a folder)" in line
    assert blocker.read_text() == "not a folder"


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[callable]:
    """Mount tmpfs file systems of a given size (root and mount(8) needed; the CI machine has both)."""
    mounted: list[Path] = []

    def mount(size: str, *options: str) -> Path:
        point = tmp_path / f"fs{len(mounted)}"
        point.mkdir()
        if (
            os.geteuid() != 0
            or not shutil.which("mount")
            or subprocess.run(
                ["mount", "-t", "tmpfs", "-o", ",".join((f"size={size}", *options)), "tmpfs", str(point)],
                capture_output=True,
            ).returncode
        ):
            pytest.skip("cannot mount a tmpfs here (needs root); test_enospc_during_save_is_named covers the message")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


def test_read_only_and_full_folders_fail_before_step_1(small_fs, capsys: pytest.CaptureFixture) -> None:
    read_only = small_fs("1m", "ro")
    assert run(read_only / "run", "--training.steps=2") == 2
    assert (
        f"job.dump_folder={read_only / 'run'}: cannot write there (Read-only file system in {read_only})"
        in one_error_line(capsys)
    )
    full = small_fs("64k")
    with pytest.raises(OSError, match="No space left"), open(full / "filler", "wb") as filler:
        while True:  # fill it up
            filler.write(b"\0" * 4096)
            filler.flush()
    assert run(full / "run", "--training.steps=2") == 2
    assert "cannot write there (No space left on device" in one_error_line(capsys)
    small = small_fs("2m")  # the debug clip's checkpoint (weights + AdamW moments) is ~3.3 MB
    assert run(small / "run", "--training.steps=2") == 2
    line = one_error_line(capsys)
    assert (
        f"checkpoint.folder={small / 'run' / 'checkpoint'}: 2.0 MiB free, a checkpoint of this run needs about" in line
    )
    assert not (small / "run").exists()  # failed before step 1: nothing written


def test_full_disk_during_a_save_is_named_and_leaves_no_partial_files(small_fs, capsys: pytest.CaptureFixture) -> None:
    room_for_one = small_fs("5m")  # the first checkpoint fits, the second does not (keep_latest_k=0 keeps both)
    assert run(room_for_one, "--training.steps=4") == 2
    line = one_error_line(capsys)
    assert f"saving checkpoint step-4 failed: no space left on device in {room_for_one / 'checkpoint'}" in line
    assert steps_in(room_for_one / "checkpoint") == ["step-2"]  # no step-4.tmp left behind
    assert sorted(train_records(room_for_one)) == [1, 2, 3, 4]


@pytest.mark.parametrize("async_mode, steps", [("disabled", 4), ("async", 6)])
def test_enospc_during_save_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, async_mode: str, steps: int
) -> None:
    """The same path without a tmpfs: the write fails with ENOSPC, as a full disk makes it fail. A
    background save of step 4 fails while steps 5-6 train; the save at step 6 raises its error."""
    full_disk_when_writing(monkeypatch, "step-4.tmp")
    assert run(tmp_path, f"--training.steps={steps}", f"--checkpoint.async_mode={async_mode}") == 2
    assert f"saving checkpoint step-4 failed: no space left on device in {tmp_path / 'checkpoint'}" in one_error_line(
        capsys
    )
    assert steps_in(tmp_path / "checkpoint") == ["step-2"]
    assert sorted(train_records(tmp_path)) == list(range(1, steps + 1))


# ------------------------------------------------------------------ one-line errors


@pytest.mark.parametrize(
    "args, message",
    [
        (["--training.device=cuda"], "training.device='cuda' but no CUDA device is visible; use --training.device=cpu"),
        (
            ["--data.dataset=emoji", "--training.global_batch_size=4096"],
            "training.global_batch_size=4096 exceeds the 1706 samples of emoji/train: one step would use samples "
            "twice; use at most 1696",
        ),
    ],
)
def test_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture, args: list[str], message: str) -> None:
    if "cuda" in args[0]:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is visible")
    assert run(tmp_path, "--training.steps=2", *args) == 2
    assert message in one_error_line(capsys)
    assert not (tmp_path / "metrics.jsonl").exists()


# ------------------------------------------------------------------ a stalled rank


@pytest.mark.slow  # slow: ~16 s of torchrun launches, the default suite's time (CI runs the slow marker too)
def test_stalled_rank_ends_the_job_with_the_timeout_named(tmp_path: Path) -> None:
    """Two gloo processes through run_train.sh; rank 1 is stopped (SIGSTOP) after step 1. Rank 0
    used to wait forever; it now fails after comm.train_timeout_seconds and the job exits 4."""
    timeout, grace = 5, 1  # grace: run_train.sh's wait before it SIGKILLs the stopped rank (5 s by default)
    env = {**os.environ, "NGPU": "2", "PYTHON": sys.executable, "LOG_RANK": "0", "CUDA_VISIBLE_DEVICES": ""}
    env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(grace)
    job = subprocess.Popen(
        [
            "./run_train.sh",
            f"--job.dump_folder={tmp_path}",
            "--training.steps=100000",
            "--training.local_batch_size=8",
            "--eval.enable=false",
            "--metrics.log_freq=1",
            "--metrics.enable_tensorboard=false",
            f"--comm.train_timeout_seconds={timeout}",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    output = []
    try:
        for line in job.stdout:  # until rank 0 has logged step 1 (the train timeout is set by then)
            output.append(line)
            if "step     1 " in line:
                break
        rank1 = _worker_pid(job.pid, rank=1)
        os.kill(rank1, signal.SIGSTOP)
        stopped = time.monotonic()
        output.append(job.communicate(timeout=120)[0])
        code, elapsed = job.returncode, time.monotonic() - stopped
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    text = "".join(output)
    assert code == 4, text[-3000:]
    assert f"comm.train_timeout_seconds={timeout} is the wait allowed" in text and "Traceback" not in text, text[-3000:]
    assert elapsed < 2 * timeout + grace + 1, elapsed  # the timeout, then the grace before the stopped rank is killed


def _worker_pid(launcher: int, rank: int) -> int:
    """The pid of the trainer process with RANK=rank among the launcher's descendants."""
    for _ in range(2):  # run_train.sh execs the launcher, which starts the workers
        for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                if f"RANK={rank}".encode() in environ and _descends(pid, launcher):
                    return pid
            except OSError:
                continue
    raise AssertionError(f"no worker with RANK={rank} under pid {launcher}")


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False
