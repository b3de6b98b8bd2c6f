"""SIGTERM / SIGUSR1 stop a run after the current step with a checkpoint and exit code 5
(components/preemption.py; launch.py for the launcher's side), the way Slurm and Kubernetes stop jobs.

The runs are tiny (clip/debug, 8 samples per step). The interrupted run is endless and the lr
constant (no warmup, no decay), so the schedule does not depend on `training.steps`: the runs it
is compared with end two steps after wherever the signal stopped it, without any timing. Each
signal is sent once the run's metrics.jsonl shows step 2 (polled with a deadline).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_faults import _worker_pid
from tests.test_resume import DEBUG_CONFIG, assert_identical, checkpoint, losses
from titan_contrastive.components.run_lock import LOCK_FILE
from titan_contrastive.exit_codes import EXIT_CODES, STOPPED
from titan_contrastive.launch import stopped, with_stop_signals
from titan_contrastive.train import main

REPO = Path(__file__).resolve().parents[1]
RUN = [
    "--training.local_batch_size=8",
    "--eval.enable=false",
    "--metrics.log_freq=1",
    "--metrics.enable_tensorboard=false",
    "--checkpoint.enable=true",
    "--checkpoint.interval=100000",
    "--checkpoint.keep_latest_k=0",
    "--lr_scheduler.warmup_steps=0",
    "--lr_scheduler.decay_type=none",
]
ENDLESS = "--training.steps=100000"


def env(nproc: int) -> dict[str, str]:
    # TORCH_ELASTIC_SHUTDOWN_TIMEOUT=0: had the launcher used its after-a-failure grace for a stop
    # signal, the ranks would be SIGKILLed at once, before any save
    return {
        **os.environ,
        "NGPU": str(nproc),
        "PYTHON": sys.executable,
        "LOG_RANK": "0",
        "CUDA_VISIBLE_DEVICES": "",
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "0",
    }


def start(command: list[str], nproc: int) -> subprocess.Popen:
    return subprocess.Popen(
        command,
        cwd=REPO,
        env=env(nproc),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_for_step(job: subprocess.Popen, dump: Path, step: int = 2, seconds: float = 120) -> None:
    """Until metrics.jsonl records train step `step` (the run is past start-up and training)."""
    metrics, deadline = dump / "metrics.jsonl", time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert job.poll() is None, job.communicate()[0][-3000:]
        for line in metrics.read_text().splitlines() if metrics.exists() else []:
            try:
                record = json.loads(line)
            except ValueError:  # a line being written
                continue
            if record["kind"] == "train" and record["step"] >= step:
                return
        time.sleep(0.02)  # polling interval, not a wait for timing
    raise AssertionError(f"no step {step} in {metrics} within {seconds}s")


def finish(job: subprocess.Popen) -> tuple[int, str]:
    try:
        out = job.communicate(timeout=180)[0]
    finally:  # the whole group: a rank the launcher left behind (e.g. on an unhandled signal) too
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return job.returncode, out


def saved_steps(dump: Path) -> list[str]:
    return sorted(p.name for p in (dump / "checkpoint").iterdir())


def test_sigterm_to_the_launcher_saves_and_the_rerun_is_bit_identical(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM to run_train.sh: it used to exit 143 and save nothing. Now the rank finishes its step
    and saves it, the launcher waits for it (TITAN_PREEMPT_GRACE_SECONDS, not the 0 s failure grace
    set here) and exits 5; the rerun resumes and ends exactly like an unbroken run. One process:
    two stop together below. The rerun and the unbroken run go in this process (the trainer's code,
    without the launcher's start-up); test_resume.py resumes two processes through the launcher."""
    stopped_run, whole = tmp_path / "stopped", tmp_path / "whole"
    job = start(["./run_train.sh", f"--job.dump_folder={stopped_run}", *RUN, ENDLESS], 1)
    wait_for_step(job, stopped_run)
    os.kill(job.pid, signal.SIGTERM)  # run_train.sh execs the launcher: this is the launcher
    code, out = finish(job)
    assert code == 5, out[-3000:]
    assert f"run_train.sh: stopped by SIGTERM: every rank finished its step, exit code 5 ({EXIT_CODES[5]})" in out, out[
        -3000:
    ]
    reached = max(losses(stopped_run))
    assert reached >= 2 and saved_steps(stopped_run) == [f"step-{reached}"]
    assert (
        f"SIGTERM: stopped after step {reached}, checkpoint step-{reached} saved; rerun the same command to resume"
        in out
    )
    assert not (stopped_run / LOCK_FILE).exists()

    end = f"--training.steps={reached + 2}"
    with caplog.at_level(logging.INFO, logger="titan_contrastive"):
        assert main([DEBUG_CONFIG, f"--job.dump_folder={stopped_run}", *RUN, end]) == 0
    assert f"resumed from checkpoint step-{reached}" in caplog.text
    assert main([DEBUG_CONFIG, f"--job.dump_folder={whole}", *RUN, end]) == 0
    want, got = losses(whole), losses(stopped_run)
    assert sorted(got) == list(range(1, reached + 3)) and got == want
    assert_identical(checkpoint(stopped_run, reached + 2), checkpoint(whole, reached + 2))


@pytest.mark.slow  # slow: ~9 s of torchrun launches, the default suite's time (CI runs the slow marker too)
def test_sigusr1_to_the_launcher_stops_the_run_after_a_step(tmp_path: Path) -> None:
    """Slurm's `--signal=USR1@<seconds>` signals the launcher: it forwards SIGUSR1 to the ranks, which save,
    and exits 5 (by default SIGUSR1 would end it and leave the ranks running unsupervised). Through
    --signals-to-handle, or the launcher's own handler on a torchrun without it."""
    job = start(["./run_train.sh", f"--job.dump_folder={tmp_path}", *RUN, ENDLESS], 1)
    wait_for_step(job, tmp_path)
    os.kill(job.pid, signal.SIGUSR1)
    code, out = finish(job)
    assert code == 5, out[-3000:]
    assert "run_train.sh: stopped by SIGUSR1: every rank finished its step, exit code 5" in out, out[-3000:]
    reached = max(losses(tmp_path))
    assert f"SIGUSR1: stopped after step {reached}, checkpoint step-{reached} saved" in out
    assert saved_steps(tmp_path) == [f"step-{reached}"]


@pytest.mark.slow  # slow: ~11 s of torchrun launches, the default suite's time (CI runs the slow marker too)
def test_sigterm_to_the_whole_process_group_with_data_workers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Slurm's scancel and preemption, and `timeout`, signal every process of the job, the data workers
    too: a worker ended by SIGTERM made the rank fail ("DataLoader worker ... killed by signal:
    Terminated", exit 143, nothing saved; seen on the H100 under `timeout`). The workers leave the
    signal to the trainer, which finishes its step, saves it and exits 5; the rerun resumes."""
    job = start(["./run_train.sh", f"--job.dump_folder={tmp_path}", *RUN, ENDLESS, "--data.num_workers=2"], 1)
    wait_for_step(job, tmp_path)
    os.killpg(job.pid, signal.SIGTERM)  # the launcher, the rank and both workers
    code, out = finish(job)
    assert code == 5 and "Traceback" not in out and "killed by signal" not in out, out[-3000:]
    reached = max(losses(tmp_path))
    assert saved_steps(tmp_path) == [f"step-{reached}"]
    # the rerun, in this process: the checkpoint the stopped workers' run saved is whole
    with caplog.at_level(logging.INFO, logger="titan_contrastive"):
        args = [f"--job.dump_folder={tmp_path}", *RUN, f"--training.steps={reached + 1}", "--data.num_workers=2"]
        assert main([DEBUG_CONFIG, *args]) == 0
    assert f"resumed from checkpoint step-{reached}" in caplog.text
    assert sorted(losses(tmp_path)) == list(range(1, reached + 2))


def test_sigusr1_to_one_rank_stops_every_rank_after_the_same_step(tmp_path: Path) -> None:
    """Slurm may signal the ranks themselves, at different steps: here only rank 1 gets SIGUSR1.
    Both stop after the same step (one all-reduce of the flag per step) and save it together;
    had rank 0 gone on, the save's collectives would not have matched."""
    job = start(["./run_train.sh", f"--job.dump_folder={tmp_path}", *RUN, ENDLESS], 2)
    wait_for_step(job, tmp_path)
    os.kill(_worker_pid(job.pid, rank=1), signal.SIGUSR1)
    code, out = finish(job)
    assert code == 5, out[-3000:]
    assert f"exited with code 5 ({EXIT_CODES[5]})" in out and "Traceback" not in out, out[-3000:]
    reached = max(losses(tmp_path))
    assert saved_steps(tmp_path) == [f"step-{reached}"]
    manifest = json.loads((tmp_path / "checkpoint" / f"step-{reached}" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert {"dataloader/dp_rank_0", "dataloader/dp_rank_1"} <= checkpoint(tmp_path, reached).keys()


@pytest.mark.slow  # slow: ~6 s of torchrun launches, the default suite's time (CI runs the slow marker too)
def test_sigusr1_to_the_trainer_itself(tmp_path: Path) -> None:
    """`python -m titan_contrastive.train`, no launcher: SIGUSR1 used to kill it (exit 138)."""
    job = start(
        [
            sys.executable,
            "-m",
            "titan_contrastive.train",
            DEBUG_CONFIG,
            f"--job.dump_folder={tmp_path}",
            *RUN,
            ENDLESS,
        ],
        1,
    )
    wait_for_step(job, tmp_path)
    job.send_signal(signal.SIGUSR1)
    code, out = finish(job)
    assert code == 5, out[-3000:]
    reached = max(losses(tmp_path))
    assert saved_steps(tmp_path) == [f"step-{reached}"]
    assert f"SIGUSR1: stopped after step {reached}, checkpoint step-{reached} saved" in out


# ------------------------------------------------------------------ in this process: the signal sent from inside a step


@pytest.fixture
def harmless_sigterm():
    """A SIGTERM handler for the test itself, so a trainer that does not handle it fails the test
    instead of killing pytest; it must be back in place after the run."""
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    handler = signal.getsignal(signal.SIGTERM)
    yield handler
    signal.signal(signal.SIGTERM, previous)


def signal_during(monkeypatch: pytest.MonkeyPatch, step: int, where: str = "step") -> None:
    """SIGTERM to this process while step `step` runs (where="step"), or while its checkpoint is
    being written (where="save", a second SIGTERM: one at the step as well)."""
    import torch.distributed.checkpoint as dcp

    from titan_contrastive.train import Trainer

    train_step, dcp_save = Trainer.train_step, dcp.save

    def step_and_signal(self, microbatches):
        out = train_step(self, microbatches)
        if self.step == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    def save_and_signal(state, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return dcp_save(state, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", step_and_signal)
    if where == "save":
        monkeypatch.setattr(dcp, "save", save_and_signal)


def test_stop_without_checkpointing_still_ends_the_step_with_the_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, harmless_sigterm
) -> None:
    signal_during(monkeypatch, step=2)
    with caplog.at_level(logging.INFO, logger="titan_contrastive"):
        code = main([f"--job.dump_folder={tmp_path}", *RUN, "--checkpoint.enable=false", "--training.steps=6"])
    assert code == 5
    assert "SIGTERM: stopped after step 2; checkpoint.enable=false, so nothing was saved" in caplog.text
    assert sorted(losses(tmp_path)) == [1, 2] and not (tmp_path / "checkpoint").exists()
    assert signal.getsignal(signal.SIGTERM) is harmless_sigterm  # the caller's handler is back


def test_a_second_sigterm_while_saving_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, harmless_sigterm
) -> None:
    signal_during(monkeypatch, step=2, where="save")
    assert main([f"--job.dump_folder={tmp_path}", *RUN, "--training.steps=6"]) == 5
    assert saved_steps(tmp_path) == ["step-2"] and (tmp_path / "checkpoint" / "step-2" / "manifest.json").is_file()
    assert sorted(losses(tmp_path)) == [1, 2]


# ------------------------------------------------------------------ the launcher's decisions


def test_launcher_handles_sigusr1_and_reports_a_stop_cut_short() -> None:
    """SIGUSR1 (Slurm's --signal) is added to torchrun's handled signals: by default it would end the
    launcher and orphan the ranks. A rank killed before it finished (the grace ran out) is named."""
    assert with_stop_signals("SIGTERM,SIGINT,SIGHUP,SIGQUIT") == "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
    assert with_stop_signals("SIGUSR1") == "SIGUSR1,SIGTERM"
    assert stopped(signal.SIGUSR1, {0: 5, 1: 5}, grace=120)[0] == 5
    code, line = stopped(signal.SIGTERM, {0: 5, 1: -9}, grace=120)
    assert code == 143
    assert line == (
        "run_train.sh: stopped by SIGTERM, exit code 143; not stopped after a step: local rank 1 killed by SIGKILL; "
        "if a step and a save take longer than TITAN_PREEMPT_GRACE_SECONDS=120 seconds, raise it"
    )


def test_an_older_torchruns_stop_gets_the_stop_grace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.9-2.12's agent (the GPU image's 2.11) has no --shutdown-timeout: on a stop signal it closes
    the ranks from its `except SignalException` with no timeout. That close, on a real rank that takes
    a moment to save after SIGTERM, waits the stop grace, not the grace after a failure (here 0 s, which
    would SIGKILL the rank before its save); outside a signal's handling it stays the failure grace."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
    from torch.distributed.elastic.multiprocessing.api import PContext, SignalException

    from titan_contrastive.launch import honour_shutdown_timeout

    monkeypatch.setattr(PContext, "close", PContext.close)  # the launcher's patch of it is undone after the test
    honour_shutdown_timeout(0, 60)
    rank = (  # a rank that saves for 0.5 s after SIGTERM, then exits 5 (STOPPED)
        "import pathlib, signal, sys, time; "
        "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.5), sys.exit(5))); "
        "pathlib.Path(sys.argv[1]).touch(); time.sleep(120)"
    )

    def run_rank(name: str) -> PContext:
        ready = tmp_path / name
        ranks = start_processes(
            name, sys.executable, {0: ("-c", rank, str(ready))}, {0: {}}, DefaultLogsSpecs(log_dir=str(tmp_path))
        )
        deadline = time.monotonic() + 60
        while not ready.exists():  # its handler is set
            assert time.monotonic() < deadline and ranks.pids()[0] > 0
            time.sleep(0.02)  # polling interval, not a wait for timing
        return ranks

    ranks = run_rank("stopped")
    try:
        raise SignalException("the launcher got SIGTERM", sigval=signal.SIGTERM)
    except SignalException as e:
        ranks.close(e.sigval)  # as torch 2.11's agent does
    assert ranks.subprocess_handlers[0].proc.wait(timeout=60) == STOPPED
    ranks = run_rank("failed")
    ranks.close(signal.SIGTERM)  # its restart or clean-up close: the failure grace, 0 s
    assert ranks.subprocess_handlers[0].proc.wait(timeout=60) == -signal.SIGKILL
