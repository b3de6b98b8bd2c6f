"""`[checkpoint] async_mode = "async"`: a save returns once the state is copied, its files are written
while training goes on, and what it writes is the state of its step; its failures reach the loop."""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from tests.dist_utils import run_distributed
from tests.test_checkpoint import Cfg, _fsdp_load, assert_equal_states, make_run, optim_state, params, train
from tests.test_faults import full_disk_when_writing
from titan_contrastive.checkpoint import CheckpointError

ASYNC = Cfg(async_mode="async", interval=2)


def test_a_background_save_holds_the_state_of_its_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The files of step 2 are written only after three more steps changed the parameters, the AdamW
    moments, the loader position and the RNG: the checkpoint still resumes into exactly step 2."""
    release, writing = threading.Event(), []
    real = FileSystemWriter.write_data

    def held_write(self, plan, planner):  # the background write waits until the loop has moved on
        writing.append(threading.current_thread() is not threading.main_thread())
        assert release.wait(timeout=120)
        return real(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", held_write)
    run = make_run(tmp_path, ASYNC)
    train(run, 2)
    assert run.manager.maybe_save(2) is True
    assert run.manager.available_steps() == [] and (tmp_path / "ckpt" / "step-2.tmp").is_dir()
    rand_after_save = torch.rand(5)
    expected = train(run, 3)
    release.set()
    run.manager.wait()
    assert writing == [True] and run.manager.available_steps() == [2]
    assert not (tmp_path / "ckpt" / "step-2.tmp").exists()

    fresh = make_run(tmp_path, seed=1)
    assert fresh.manager.load() == 2 and fresh.train_state.step == 2
    assert torch.equal(torch.rand(5), rand_after_save)
    assert train(fresh, 3) == expected
    assert_equal_states(params(fresh), params(run))
    assert_equal_states(optim_state(fresh), optim_state(run))


def test_the_last_save_waits_and_an_interval_save_waits_for_the_one_before(tmp_path: Path) -> None:
    """Each interval save finishes before the next starts; the last step's is complete on return."""
    run = make_run(tmp_path, Cfg(async_mode="async", interval=2, keep_latest_k=2))
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


def _fsdp_background_save(tmp: str) -> None:
    """Rank body: FSDP2 over 2 gloo processes, step 2 saved in the background while 2 more steps train
    (the write held until they are done); what `_fsdp_load` expects of the checkpoint written beside."""
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    release = threading.Event()
    real = FileSystemWriter.write_data

    def held_write(self, plan, planner):
        assert release.wait(timeout=120)
        return real(self, plan, planner)

    FileSystemWriter.write_data = held_write  # this process only
    run = make_run(Path(tmp), ASYNC, rank=rank, dp_degree=2, fsdp=True)
    train(run, 2)
    run.manager.save(2, background=True)
    at_save = copy.deepcopy({"params_at_save": params(run), "optim_at_save": optim_state(run)})
    rand_after_save = torch.rand(3)
    losses = train(run, 2)
    release.set()
    run.manager.wait()
    expected = {"losses": losses, "rand": rand_after_save, "params": params(run), "optim": optim_state(run), **at_save}
    torch.save(expected, Path(tmp) / f"expected_{rank}.pt")


def test_fsdp2_background_save_resumes_exactly_on_two_processes(tmp_path: Path) -> None:
    run_distributed(_fsdp_background_save, 2, str(tmp_path))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-2"]
    run_distributed(_fsdp_load, 2, str(tmp_path))  # resumes step 2 and trains on exactly as the saving run did
