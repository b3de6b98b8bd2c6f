"""Resuming on another number of data-parallel ranks or another local batch (`checkpoint/reshard.py`,
`EpochLoader.load_resharded`).

- the sampler: an epoch is cut into whole optimizer steps, so no step spans two epochs (and holds a sample twice),
  and the epoch's order does not depend on how a step is split into ranks and microbatches;
- the loader: states saved by 2 ranks, loaded on 1 and on 4 (with workers too), give the optimizer steps the
  2 ranks would have taken next, across epoch ends; a position that is no whole number of the new loader steps, a
  state that predates positions, ranks that disagree: ValueError; rank 0 takes the skipped-sample counts;
- through the trainer on gloo processes in float64: 2 ranks to a checkpoint, resumed on 1 (of the same local batch
  and of twice it) and on 4, train the weights the uninterrupted 2-rank run trains (<= 1e-10), across an epoch end;
  the log says so; a checkpoint whose position cannot be split is a one-line error before any step;
- which checkpoints are mapped; a per-rank state that cannot be is one line; microbatch negatives are said to change
  size; RNG streams continue saved rank r mod W's.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.test_data import take, tiny_dataset
from tests.test_trainer import full, make_trainer
from titan_contrastive.checkpoint import CheckpointError
from titan_contrastive.checkpoint.reshard import reshard_for
from titan_contrastive.checkpoint.stateful import RNGState
from titan_contrastive.datasets import EpochLoader, build_dataloader
from titan_contrastive.datasets.loader import BlockedDistributedSampler


def test_epochs_are_whole_optimizer_steps() -> None:
    """50 samples, steps of 24 over 3 ranks of 4 (2 loader steps a step): 2 steps an epoch, 2 samples dropped; no
    step mixes two epochs, and every step's 24 samples are distinct."""
    samplers = [
        BlockedDistributedSampler(50, local_batch_size=4, rank=r, world_size=3, seed=1, step_samples=24)
        for r in range(3)
    ]
    assert samplers[0].steps_per_epoch == 4 and len(samplers[0]) == 16
    for epoch in range(3):
        for s in samplers:
            s.set_epoch(epoch)
        blocks = [torch.tensor(list(s)).view(-1, 4) for s in samplers]
        order = torch.stack(blocks, 1).reshape(-1)  # loader step by loader step, ranks in order
        assert order.numel() == 48 and order.unique().numel() == 48
        assert torch.equal(order, samplers[0].global_order())
    assert (
        BlockedDistributedSampler(  # without drop_last the order wraps round to 3 whole steps
            50, local_batch_size=4, rank=0, world_size=3, seed=1, step_samples=24, drop_last=False
        ).steps_per_epoch
        == 6
    )
    with pytest.raises(ValueError, match="step_samples=20 must be a multiple of the 12 samples"):
        BlockedDistributedSampler(50, local_batch_size=4, rank=0, world_size=3, seed=1, step_samples=20)


def _loaders(world: int, *, workers: int = 0, n: int = 20, local: int = 2, step: int = 8) -> list[EpochLoader]:
    return [
        build_dataloader(
            tiny_dataset(n),
            local_batch_size=local,
            dp_rank=r,
            dp_world_size=world,
            seed=2,
            step_samples=step,
            num_workers=workers,
        )
        for r in range(world)
    ]


def _steps(loaders: list[EpochLoader], count: int, step: int = 8) -> list[dict[str, torch.Tensor]]:
    """The next `count` optimizer steps of `step` samples: each loader step's batches of all ranks, in rank order."""
    per_step = step // (len(loaders) * loaders[0].sampler.local_batch_size)
    out = []
    for _ in range(count):
        parts = [next(loader) for _ in range(per_step) for loader in loaders]
        out.append({key: torch.cat([p[key] for p in parts]) for key in ("index", "image", "text")})
    return out


@pytest.mark.parametrize("done", [0, 1, 2, 5])  # optimizer steps before the save; 20 samples make 2 steps an epoch
@pytest.mark.parametrize("world, workers", [(1, 0), (4, 0), (4, 2)])
def test_states_of_two_ranks_continue_on_another_number(done: int, world: int, workers: int) -> None:
    reference = _steps(_loaders(2), done + 4)
    saved = _loaders(2)
    _steps(saved, done)
    states = [loader.state_dict() for loader in saved]
    assert {s["position"] for s in states} == {8 if done % 2 else 16 if done else 0}  # 16: an epoch's end
    resumed = _loaders(world, workers=workers)
    for rank, loader in enumerate(resumed):
        loader.load_resharded(states, rank)
    for want, got in zip(reference[done:], _steps(resumed, 4), strict=True):
        for key in want:
            assert torch.equal(want[key], got[key]), key
    assert {loader.epoch for loader in resumed} == {(done + 3) // 2}
    for loader in resumed:
        loader.end_workers()


def test_positions_that_cannot_be_split() -> None:
    saved = _loaders(2)
    for loader in saved:  # one loader step of 4 samples: half an optimizer step
        take(loader, 1)
    states = [loader.state_dict() for loader in saved]
    with pytest.raises(ValueError, match="it stopped 4 samples into epoch 0, not a whole number of this run's loader"):
        _loaders(4)[0].load_resharded(states, 0)
    _loaders(1, step=4)[0].load_resharded(states, 0)  # 4 samples are a whole loader step of 1 rank
    old = [{k: v for k, v in s.items() if k != "position"} for s in states]
    with pytest.raises(ValueError, match="predate resuming on another number of ranks"):
        _loaders(1)[0].load_resharded(old, 0)
    apart = [states[0], {**states[1], "position": 0}]
    with pytest.raises(ValueError, match=r"stopped at different places: \[4, 0\]"):
        _loaders(1)[0].load_resharded(apart, 0)


def test_a_state_loaded_without_its_position_keeps_none() -> None:
    """A state saved before positions were counted resumes as before, and its saves say nothing of a position until
    the next epoch starts (a count from the resume would be wrong)."""
    saved = _loaders(1)[0]
    take(saved, 3)
    old = {k: v for k, v in saved.state_dict().items() if k != "position"}
    resumed = _loaders(1)[0]
    resumed.load_state_dict(old)
    take(resumed, 1)
    assert "position" not in resumed.state_dict()
    take(resumed, 4)  # to the epoch's eighth and last batch of 2 (16 samples)
    assert resumed.epoch == 0 and "position" not in resumed.state_dict()
    take(resumed, 1)
    assert resumed.epoch == 1 and resumed.state_dict()["position"] == 2


def test_rank_zero_takes_the_skipped_sample_counts() -> None:
    saved = _loaders(2)
    _steps(saved, 1)
    states = [loader.state_dict() for loader in saved]
    states[0]["bad_samples"] = {"counts": {"decode": 1}, "seen": 8}
    states[1]["bad_samples"] = {"counts": {"decode": 2, "size": 1}, "seen": 8}
    resumed = _loaders(4)
    for rank, loader in enumerate(resumed):
        loader.load_resharded(states, rank)
    assert resumed[0].bad_samples.state_dict() == {"counts": {"decode": 3, "size": 1}, "seen": 16}
    assert all(loader.bad_samples.state_dict() == {"counts": {}, "seen": 0} for loader in resumed[1:])


RUN = [
    "--data.dataset=synthetic",
    "--data.synthetic_samples=20",  # 2 steps of 8 an epoch
    "--data.image_size=32",
    "--eval.enable=false",
    "--lr_scheduler.warmup_steps=1",
    "--checkpoint.enable=true",
    "--checkpoint.folder=ckpt",
    "--checkpoint.interval=3",
    "--metrics.log_freq=1",
    "--loss.negatives=global",  # one contrastive problem a step, however it is split ("microbatch": local x ranks)
    "--loss.stream_chunk_size=3",
]


def _train(dump: str, steps: int, global_batch: int = 8, local: int = 2) -> None:
    """Train `steps` steps in `dump` (resuming what it holds); rank 0 keeps the weights and the log."""
    rank = int(os.environ["RANK"])
    handler = logging.FileHandler(Path(dump) / "log.txt") if rank == 0 else logging.NullHandler()
    logging.getLogger("titan_contrastive").addHandler(handler)
    logging.getLogger("titan_contrastive").setLevel(logging.INFO)  # this rank's process only
    trainer = make_trainer(
        dump,
        *RUN,
        f"--training.steps={steps}",
        f"--training.global_batch_size={global_batch}",
        f"--training.local_batch_size={local}",
    )
    trainer.train()
    trainer.metrics.close()
    weights = {name: full(p).detach().clone() for name, p in trainer.model.named_parameters()}
    if rank == 0:
        torch.save(weights, Path(dump) / "weights.pt")
    logging.getLogger("titan_contrastive").removeHandler(handler)


def _refused(dump: str) -> None:
    with pytest.raises(CheckpointError) as error:
        make_trainer(
            dump, *RUN, "--training.steps=6", "--training.global_batch_size=8", "--training.local_batch_size=2"
        )
    assert str(error.value) == (
        "checkpoint step-3 (2 data-parallel ranks of local batch 2) cannot resume on 4 data-parallel ranks of local "
        "batch 2: it stopped 12 samples into epoch 0, not a whole number of this run's loader steps of 8 samples "
        "(local batch x data-parallel ranks); resume with 2 data-parallel ranks of local batch 2 or start a new run "
        "(set checkpoint.folder to a new folder)"
    )


@pytest.mark.parametrize("world, local", [(1, 2), (1, 4), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_a_two_rank_run_resumed_on_another_number_trains_the_same_weights(
    tmp_path: Path, world: int, local: int
) -> None:
    """float64, no dropout (the resumed ranks' random streams are not the saving ranks'), augmentation on (each
    sample's draw is its own); the save at step 3 sits one step into the second epoch, the run ends in the fourth.
    The 2 ranks' local batch is 2: on 1 rank of 2 (4 microbatches a step), of 4 (2), on 4 ranks of 2 (1)."""
    whole, part = tmp_path / "whole", tmp_path / "part"
    whole.mkdir()
    run_distributed(_train, 2, str(whole), 6)  # saves step-3 and step-6
    shutil.copytree(whole / "ckpt" / "step-3", part / "ckpt" / "step-3")
    run_distributed(_train, world, str(part), 6, 8, local)
    want, got = torch.load(whole / "weights.pt"), torch.load(part / "weights.pt")
    assert want.keys() == got.keys()
    for name in want:
        err = (got[name] - want[name]).norm() / want[name].norm()
        assert err <= 1e-10, f"{name}: {err:.3e}"
    ranks = f"{world} data-parallel rank{'s' if world > 1 else ''}"
    assert (
        f"checkpoint step-3 was saved by 2 data-parallel ranks of local batch 2 and resumes on {ranks} of local batch "
        f"{local}: the data continues in the order it would have" in (part / "log.txt").read_text()
    )
    want, got = ({r["step"]: r["loss"] for r in _records(dump)} for dump in (whole, part))
    assert got.keys() == {4, 5, 6} and all(abs(got[s] - want[s]) <= 1e-10 * want[s] for s in got)


def _records(dump: Path) -> list[dict]:
    return [r for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


def test_a_position_that_cannot_be_split_is_one_line(tmp_path: Path) -> None:
    """2 ranks at a global batch of 4 save 12 samples into the epoch; 4 ranks of 2 take 8 a loader step."""
    run_distributed(_train, 2, str(tmp_path), 3, 4)
    run_distributed(_refused, 4, str(tmp_path))


def test_a_state_that_cannot_be_mapped_is_one_line() -> None:
    class Fixed:
        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state: dict) -> None:
            pass

    states = {"dataloader": _loaders(1)[0], "sampler_cache": Fixed()}
    with pytest.raises(CheckpointError) as error:
        reshard_for(states, {"dp_degree": 2}, 1, 3, None)
    assert str(error.value) == (
        "checkpoint step-3 was saved by 2 data-parallel ranks, this run has 1 data-parallel rank, and its "
        "sampler_cache state cannot be mapped onto them; resume with 2 data-parallel ranks or start a new run (set "
        "checkpoint.folder to a new folder)"
    )
    assert reshard_for(states, {"dp_degree": 1}, 1, 3, None) is None


@pytest.mark.parametrize("negatives", ["microbatch", "global"])
def test_microbatch_negatives_are_said_to_change(negatives: str, caplog: pytest.LogCaptureFixture) -> None:
    saved = _loaders(2)
    config = {"loss": {"negatives": negatives}, "training": {"local_batch_size": 2}}
    manifest = {"dp_degree": 2, "config": {"training": {"local_batch_size": 2}}}
    reshard = reshard_for({"dataloader": _loaders(4)[0]}, manifest, 4, 3, config)
    for box, loader in zip(reshard.collected["dataloader"], saved, strict=True):
        box.load_state_dict(loader.state_dict())
    with caplog.at_level(logging.INFO, logger="titan_contrastive"):
        reshard.apply(0)
    assert (
        "step-3 was saved by 2 data-parallel ranks of local batch 2 and resumes on 4 data-parallel ranks" in caplog.text
    )
    said = "each contrastive problem now holds the 8 samples of a microbatch on every rank, 4 before the resume"
    assert (said in caplog.text) == (negatives == "microbatch")


def test_rank_r_continues_the_random_streams_of_saved_rank_r_mod_w() -> None:
    saved = []
    for seed in (5, 6):  # the streams of 2 saving ranks
        torch.manual_seed(seed)
        saved.append(RNGState("cpu").state_dict())
    for rank in range(4):
        RNGState("cpu").load_resharded(saved, rank)
        got = torch.rand(3)
        torch.manual_seed(5 + rank % 2)
        assert torch.equal(got, torch.rand(3)), rank


def test_a_restored_position_holds_until_an_index_is_drawn() -> None:
    """A loader with workers asks for the sampler's iterator twice before drawing from it: both start at the
    restored position; once an index is drawn, a new iterator starts the epoch again, as a fresh one does."""
    sampler = BlockedDistributedSampler(20, local_batch_size=2, rank=0, world_size=1, seed=0, step_samples=8)
    whole = list(sampler)
    sampler.load_state_dict({"epoch": 0, "yielded": 6})
    iter(sampler)  # not drawn from
    assert list(sampler) == whole[6:] and sampler.yielded == 16
    assert list(sampler) == whole


def test_which_checkpoints_are_mapped() -> None:
    """Another number of ranks or another local batch; a manifest without a config (older) compares the ranks."""
    states, ours = {"dataloader": _loaders(1)[0]}, {"training": {"local_batch_size": 4}}

    def saved(ranks: int, local: int | None) -> dict:
        return {"dp_degree": ranks, **({} if local is None else {"config": {"training": {"local_batch_size": local}}})}

    assert reshard_for(states, saved(1, 4), 1, 3, ours) is None
    assert reshard_for(states, saved(1, None), 1, 3, ours) is None
    assert reshard_for(states, saved(1, 2), 1, 3, ours).saved == (1, 2)
    assert reshard_for(states, saved(2, None), 1, 3, ours).now == (1, None)
