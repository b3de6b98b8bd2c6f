"""`[checkpoint] async_mode = "async"` and `"async_with_pinned_mem"`: a save returns once the state is
copied, its files are written while training goes on, and what it writes is the state of its step (also
when the host copy is the previous save's, refilled); its failures reach the loop."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager

from tests.dist_utils import run_distributed
from tests.test_checkpoint import (
    Cfg,
    Run,
    _fsdp_load,
    assert_equal_states,
    make_run,
    optim_state,
    params,
    train,
)
from tests.test_faults import full_disk_when_writing
from titan_contrastive.checkpoint import CheckpointError
from titan_contrastive.checkpoint.writer import BackgroundSave, stager_survives_reuse

ASYNC = Cfg(async_mode="async", interval=2)
MODES = ["async", "async_with_pinned_mem"]


def hold_writes_of(step_folder: str, release: threading.Event, writing: list[bool] | None = None) -> Callable:
    """A FileSystemWriter.write_data that writes `step_folder` only once `release` is set."""
    real = FileSystemWriter.write_data

    def held_write(self, plan, planner):  # the background write waits until the loop has moved on
        if Path(self.path).name == step_folder:
            if writing is not None:
                writing.append(threading.current_thread() is not threading.main_thread())
            assert release.wait(timeout=120)
        return real(self, plan, planner)

    return held_write


def assert_resumes_exactly(tmp_path: Path, run: Run, step: int, rand: torch.Tensor, losses: list[float]) -> None:
    """A fresh run (other initial parameters) loads checkpoint `step`, draws `rand` next as the saving run
    did after its save, and trains on to `losses` and to the saving run's parameters and moments."""
    fresh = make_run(tmp_path, seed=1)
    assert fresh.manager.load() == step and fresh.train_state.step == step
    assert torch.equal(torch.rand(5), rand)
    assert train(fresh, run.train_state.step - step) == losses
    assert_equal_states(params(fresh), params(run))
    assert_equal_states(optim_state(fresh), optim_state(run))


@pytest.mark.parametrize("mode", MODES)
def test_a_background_save_holds_the_state_of_its_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Step 1 is saved, then the files of step 2 are written only after three more steps changed the
    parameters, the AdamW moments, the loader position and the RNG: the checkpoint still resumes into
    exactly step 2 (with the pinned mode, step 2's host copy is step 1's, refilled)."""
    release, writing = threading.Event(), []
    monkeypatch.setattr(FileSystemWriter, "write_data", hold_writes_of("step-2.tmp", release, writing))
    run = make_run(tmp_path, Cfg(async_mode=mode, interval=2))
    train(run, 1)
    run.manager.save(1, background=True)
    train(run, 1)
    assert run.manager.maybe_save(2) is True
    assert run.manager.available_steps() == [1] and (tmp_path / "ckpt" / "step-2.tmp").is_dir()
    rand_after_save = torch.rand(5)
    expected = train(run, 3)
    release.set()
    run.manager.wait()
    assert writing == [True] and run.manager.available_steps() == [1, 2]
    assert not (tmp_path / "ckpt" / "step-2.tmp").exists()

    assert_resumes_exactly(tmp_path, run, 2, rand_after_save, expected)


@pytest.mark.parametrize("mode", MODES)
def test_a_save_copies_the_state_only_once_the_save_before_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """The pinned mode refills the host copy that the save before writes from, so a save copies the
    state only after that write is done (step 1's write held until the loop waits for it)."""
    events: list[str] = []
    release = threading.Event()
    monkeypatch.setattr(FileSystemWriter, "write_data", hold_writes_of("step-1.tmp", release))
    real_write, real_stage, real_wait = FileSystemWriter.write_data, DefaultStager.stage, BackgroundSave.wait

    def write(self, plan, planner):
        result = real_write(self, plan, planner)
        events.append(f"wrote {Path(self.path).name}")
        return result

    def stage(self, state_dict, **kwargs):
        events.append("copy")
        return real_stage(self, state_dict, **kwargs)

    def wait(self):  # the loop waits for the save in flight (if any): let its write go on
        if events:
            release.set()
        real_wait(self)

    run = make_run(tmp_path, Cfg(async_mode=mode, interval=1))  # before the patches: its stager probe copies too
    monkeypatch.setattr(FileSystemWriter, "write_data", write)
    monkeypatch.setattr(DefaultStager, "stage", stage)
    monkeypatch.setattr(BackgroundSave, "wait", wait)
    for step in (1, 2):
        train(run, 1)
        run.manager.save(step, background=True)
    run.manager.wait()
    assert events == ["copy", "wrote step-1.tmp", "copy", "wrote step-2.tmp"]


@pytest.mark.parametrize("mode", MODES)
def test_the_last_save_waits_and_an_interval_save_waits_for_the_one_before(tmp_path: Path, mode: str) -> None:
    """Each interval save finishes before the next starts; the last step's is complete on return."""
    run = make_run(tmp_path, Cfg(async_mode=mode, interval=2, keep_latest_k=2))
    for step in range(1, 8):
        train(run, 1)
        run.manager.maybe_save(step, last_step=step == 7)
    assert run.manager.available_steps() == [6, 7]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-6", "step-7"]


def test_a_failed_background_save_is_raised_by_the_next_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk while step 4 is written in the background: the next save raises the synchronous
    save's one-line error, and no partial files of step 4 stay."""
    full_disk_when_writing(monkeypatch, "step-4.tmp")
    run = make_run(tmp_path, ASYNC)
    train(run, 2)
    run.manager.maybe_save(2)
    train(run, 2)
    assert run.manager.maybe_save(4) is True  # returns: the failure happens in the background
    train(run, 2)
    with pytest.raises(CheckpointError) as info:
        run.manager.maybe_save(6, last_step=True)
    message = str(info.value)
    assert f"saving checkpoint step-4 failed: no space left on device in {tmp_path / 'ckpt'}" in message
    assert "\n" not in message
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-2"]
    run.manager.wait()  # raised once: nothing pending any more


def _fsdp_background_save(tmp: str, mode: str) -> None:
    """Rank body: FSDP2 over 2 gloo processes, step 1 saved, then step 2 saved in the background while 2
    more steps train (the write held until they are done); step 1 pruned (keep_latest_k = 1); what
    `_fsdp_load` expects of the checkpoint written beside."""
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    release = threading.Event()
    FileSystemWriter.write_data = hold_writes_of("step-2.tmp", release)  # this process only
    run = make_run(Path(tmp), Cfg(async_mode=mode, interval=2, keep_latest_k=1), rank=rank, dp_degree=2, fsdp=True)
    train(run, 1)
    run.manager.save(1, background=True)
    train(run, 1)
    run.manager.save(2, background=True)
    at_save = copy.deepcopy({"params_at_save": params(run), "optim_at_save": optim_state(run)})
    rand_after_save = torch.rand(3)
    losses = train(run, 2)
    release.set()
    run.manager.wait()
    expected = {"losses": losses, "rand": rand_after_save, "params": params(run), "optim": optim_state(run), **at_save}
    torch.save(expected, Path(tmp) / f"expected_{rank}.pt")


@pytest.mark.parametrize("mode", MODES)
def test_fsdp2_background_save_resumes_exactly_on_two_processes(tmp_path: Path, mode: str) -> None:
    run_distributed(_fsdp_background_save, 2, str(tmp_path), mode)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-2"]
    run_distributed(_fsdp_load, 2, str(tmp_path))  # resumes step 2 and trains on exactly as the saving run did


@pytest.mark.parametrize("mode", MODES)
def test_where_the_host_copy_lives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Every background save writes from a copy, never from the live tensors; with the pinned mode the
    three saves write from one copy, refilled (the order test above: never while it is written)."""
    written: list[dict[str, int]] = []
    real = FileSystemWriter.write_data

    def recording_write(self, plan, planner):
        written.append({k: v.data_ptr() for k, v in planner.state_dict.items() if isinstance(v, torch.Tensor)})
        return real(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", recording_write)
    run = make_run(tmp_path, Cfg(async_mode=mode, interval=1))
    for step in (1, 2, 3):
        train(run, 1)
        run.manager.save(step, background=True)
    run.manager.wait()
    named = list(run.model.named_parameters())
    live = {f"model.{n}": p.data_ptr() for n, p in named} | {
        f"optimizer.state.{n}.{moment}": run.optimizer.state[p][moment].data_ptr()
        for n, p in named
        for moment in ("exp_avg", "exp_avg_sq")
    }
    assert len(written) == 3 and all(name in save for save in written for name in live)
    assert all(save[name] != ptr for save in written for name, ptr in live.items())
    if mode == "async_with_pinned_mem" and stager_survives_reuse():  # torch 2.11: a fresh copy each save
        assert written[0] == written[1] == written[2]


def hold_copies(release: threading.Event, copied: list[int]) -> Callable:
    """A DefaultStager._stage (the pinned mode's copy, in the stager's thread) that copies only once
    `release` is set, then counts the copy in `copied`."""
    real = DefaultStager._stage

    def held_stage(self, state_dict, **kwargs):
        assert release.wait(timeout=60)
        staged = real(self, state_dict, **kwargs)
        copied.append(1)
        return staged

    return held_stage


def test_the_pinned_mode_copies_the_state_beside_the_next_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`async_with_pinned_mem`: the save returns before the state is copied, the next step's forward and
    backward run beside the copy (held until the loop waits for it), and `wait_for_staging` returns only
    once it is complete: the optimizer step after it cannot change what is saved, which resumes exactly."""
    release, copied, at_step, armed = threading.Event(), [], [], []
    run = make_run(tmp_path, Cfg(async_mode="async_with_pinned_mem", interval=2))
    monkeypatch.setattr(DefaultStager, "_stage", hold_copies(release, copied))  # after the manager's probe
    wait_for_staging = run.manager.wait_for_staging

    def release_then_wait() -> None:  # the loop's call, after the forward and backward: the copy goes on only now
        if armed:
            release.set()
        wait_for_staging()

    monkeypatch.setattr(run.manager, "wait_for_staging", release_then_wait)
    run.optimizer.register_step_pre_hook(lambda *_: at_step.append(len(copied)))
    train(run, 2)
    run.manager.save(2, background=True)
    assert copied == []  # the save returned with the copy still to do
    armed.append(True)
    rand_after_save = torch.rand(5)
    expected = train(run, 3)
    run.manager.wait()
    assert at_step == [0, 0, 1, 1, 1]

    assert_resumes_exactly(tmp_path, run, 2, rand_after_save, expected)


def test_the_trainer_waits_for_the_copy_before_each_optimizer_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through `Trainer.train`: every background save's copy (held until the trainer asks for it) is
    complete before the next optimizer step; the last step's save is synchronous."""
    from tests.test_trainer import make_trainer

    trainer = make_trainer(
        str(tmp_path),
        "--checkpoint.enable=true",
        "--checkpoint.interval=1",
        "--checkpoint.async_mode=async_with_pinned_mem",
        "--eval.enable=false",
    )
    release, copied, saves, at_step, armed = threading.Event(), [], [], [], []
    monkeypatch.setattr(DefaultStager, "_stage", hold_copies(release, copied))
    manager = trainer.checkpointer
    save, wait_for_staging = manager.save, manager.wait_for_staging

    def recording_save(step: int, **kwargs) -> None:
        release.clear()
        armed.clear()  # the save's own wait for the save before releases nothing
        saves.append(step)
        save(step, **kwargs)
        armed.append(True)

    def release_then_wait() -> None:  # the trainer's call: the held copy goes on only now
        if armed:
            release.set()
        wait_for_staging()

    monkeypatch.setattr(manager, "save", recording_save)
    monkeypatch.setattr(manager, "wait_for_staging", release_then_wait)
    trainer.optimizer.register_step_pre_hook(lambda *_: at_step.append((len(saves), len(copied))))
    trainer.train()
    assert at_step == [(0, 0), (1, 1), (2, 2)] and saves == [1, 2, 3] and copied == [1, 1]
    assert manager.available_steps() == [2, 3]  # keep_latest_k = 2


def test_the_pinned_mode_refuses_a_forward_that_writes_to_the_state(tmp_path: Path) -> None:
    """BatchNorm's running statistics change in forward, beside the pinned mode's copy: a one-line
    config error naming the module and the fix, before anything is built on the state."""
    from titan_contrastive.checkpoint import build_checkpointer
    from titan_contrastive.checkpoint.stateful import check_forward_keeps_state
    from titan_contrastive.config import ConfigError, parse_args

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    pinned = ["--checkpoint.enable=true", "--checkpoint.async_mode=async_with_pinned_mem"]
    cfg = parse_args([f"--job.dump_folder={tmp_path}", *pinned])
    dist = type("Dist", (), {"device": torch.device("cpu"), "rank": 0})
    with pytest.raises(ConfigError) as info:
        build_checkpointer(cfg, model, None, None, None, None, None, 1, 1, dist=dist, model_args=None)
    assert str(info.value) == (
        'checkpoint.async_mode = "async_with_pinned_mem": 1 (BatchNorm1d) updates its running statistics in '
        'forward, beside the copy of the state that this mode makes; set checkpoint.async_mode = "async"'
    )
    model[1].track_running_stats = False  # batch statistics only: nothing written
    check_forward_keeps_state(model)


def test_a_failed_pinned_copy_is_raised_before_the_optimizer_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pinned mode's copy fails in the stager's thread (host memory exhausted): `wait_for_staging`,
    before the next optimizer step, raises it as a one-line checkpoint error naming the save, and the
    save leaves no partial files."""

    def failing_stage(self, state_dict, **kwargs):
        raise RuntimeError("out of host memory while staging")

    run = make_run(tmp_path, Cfg(async_mode="async_with_pinned_mem", interval=2))
    monkeypatch.setattr(DefaultStager, "_stage", failing_stage)  # after the manager's probe
    train(run, 2)
    run.manager.save(2, background=True)  # returns: the copy fails in the stager's thread
    with pytest.raises(CheckpointError) as info:
        train(run, 1)
    message = str(info.value)
    assert message.startswith(f"saving checkpoint step-2 ({tmp_path / 'ckpt' / 'step-2.tmp'}) failed: ")
    assert "out of host memory while staging" in message and "\n" not in message
    assert run.train_state.step == 2  # the optimizer step did not run
    with pytest.raises(CheckpointError):  # the background write, which had nothing to write
        run.manager.wait()
    assert list((tmp_path / "ckpt").iterdir()) == []


def test_a_stager_that_cannot_copy_twice_gets_a_fresh_one_each_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.11's DCP stager closes its cache at the end of each copy, so a second copy fails with a
    KeyError (pytorch/pytorch#183413; on another torch reproduced by that symptom): the manager finds out
    when it is built and gives each save a fresh stager; three saves resume exactly."""
    real = DefaultStager.stage

    def stage_once(self, state_dict, **kwargs):
        if getattr(self, "_copied_once", False):
            raise KeyError("this stager's cache was closed after its first copy")
        self._copied_once = True
        return real(self, state_dict, **kwargs)

    if stager_survives_reuse():  # a torch with the fix: the patch is what makes a second copy fail
        monkeypatch.setattr(DefaultStager, "stage", stage_once)
    assert not stager_survives_reuse()
    run = make_run(tmp_path, Cfg(async_mode="async_with_pinned_mem", interval=1, keep_latest_k=1))
    for step in (1, 2, 3):
        train(run, 1)
        run.manager.save(step, background=True)
    rand_after_save = torch.rand(5)
    expected = train(run, 2)
    run.manager.wait()
    assert run.manager.available_steps() == [3]

    assert_resumes_exactly(tmp_path, run, 3, rand_after_save, expected)
