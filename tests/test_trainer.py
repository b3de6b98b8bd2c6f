"""The trainer's gradient accumulation, loss rescaling and eval loss, against dense references.

All in float64 on the real `clip/debug` model and real bundled data, through `Trainer.train_step`
(the code path `run_train.sh` runs).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.dist_utils import run_distributed
from titan_contrastive.config import ConfigError, parse_args
from titan_contrastive.losses import InfoNCE, RescaleAccumulatedLoss
from titan_contrastive.steps import AccumulateStep, GlobalNegativesStep
from titan_contrastive.train import Trainer

REL = 1e-10


def make_trainer(tmp: str, *extra: str) -> Trainer:
    return Trainer(
        parse_args(
            [
                "--training.dtype=float64",
                "--training.max_norm=0",
                "--training.steps=3",
                "--data.context_length=32",
                "--metrics.enable_tensorboard=false",
                f"--job.dump_folder={tmp}",
                *extra,
            ]
        )
    )


def batch(trainer: Trainer, start: int, size: int) -> dict[str, torch.Tensor]:
    return trainer.train_set.__getitems__(list(range(start, start + size)))


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor, gathered if it is an FSDP2 shard (a DTensor)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p.grad).detach().clone() for n, p in model.named_parameters()}


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rel: float = REL) -> None:
    assert got.keys() == want.keys()
    for name in want:
        err = (got[name] - want[name]).norm() / want[name].norm().clamp_min(1e-300)
        assert err <= rel, f"{name}: relative error {err:.3e} > {rel}"


def use_plain_step(trainer: Trainer, loss_fn) -> None:
    """Run the trainer's plain accumulation step with this (already rescaled) loss."""
    trainer.gradient_step = AccumulateStep(trainer.step_context, loss_fn)


def separable_loss(image_emb: torch.Tensor, text_emb: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    """A per-sample loss (mean over samples of a function of pair i alone)."""
    return ((logit_scale * image_emb - text_emb) ** 2).sum(-1).mean()


def test_accumulation_is_exact_for_a_separable_loss(tmp_path: Path) -> None:
    trainer = make_trainer(str(tmp_path), "--training.local_batch_size=2", "--training.global_batch_size=8")
    assert trainer.ga_steps == 4
    full, init = batch(trainer, 0, 8), copy.deepcopy(trainer.model.state_dict())

    use_plain_step(trainer, RescaleAccumulatedLoss(separable_loss, 1))
    out_big = trainer.train_step([full])
    want = grads(trainer.model)

    micro = [{k: v[i : i + 2] for k, v in full.items()} for i in range(0, 8, 2)]
    trainer.model.load_state_dict(init)
    use_plain_step(trainer, RescaleAccumulatedLoss(separable_loss, 4))
    out_acc = trainer.train_step(micro)
    assert_close(grads(trainer.model), want)
    assert abs(out_acc["loss"] - out_big["loss"]) <= REL * abs(out_big["loss"])

    # without the 1/k rescale the accumulated gradient is k times too large: the wrapper matters
    trainer.model.load_state_dict(init)
    use_plain_step(trainer, RescaleAccumulatedLoss(separable_loss, 1))
    trainer.train_step(micro)
    assert_close({n: g / 4 for n, g in grads(trainer.model).items()}, want)


def test_accumulation_is_not_the_big_batch_for_infonce(tmp_path: Path) -> None:
    """Seed 004 says accumulation 'equals a larger batch'; for InfoNCE it does not (k small problems)."""
    trainer = make_trainer(str(tmp_path), "--training.local_batch_size=2", "--training.global_batch_size=8")
    full, init = batch(trainer, 0, 8), copy.deepcopy(trainer.model.state_dict())
    use_plain_step(trainer, RescaleAccumulatedLoss(InfoNCE().dense, 1))
    trainer.train_step([full])
    big = grads(trainer.model)
    trainer.model.load_state_dict(init)
    use_plain_step(trainer, RescaleAccumulatedLoss(InfoNCE().dense, 4))
    trainer.train_step([{k: v[i : i + 2] for k, v in full.items()} for i in range(0, 8, 2)])
    diff = (grads(trainer.model)["logit_scale"] - big["logit_scale"]).abs() / big["logit_scale"].abs()
    assert diff > 1e-3


def test_rescale_wrapper_and_no_rescale() -> None:
    wrapped = RescaleAccumulatedLoss(lambda x: x * 3.0, 4)
    x = torch.tensor(2.0)
    assert wrapped(x).item() == 1.5
    with wrapped.no_rescale():
        assert wrapped(x).item() == 6.0
        with wrapped.no_rescale():
            pass
        assert wrapped(x).item() == 6.0  # nested exit restores the outer setting
    assert wrapped(x).item() == 1.5
    with pytest.raises(ValueError):
        RescaleAccumulatedLoss(lambda x: x, 0)


def test_eval_loss_is_never_rescaled(tmp_path: Path) -> None:
    """Under accumulation, the eval loss is the mean of the held-out batches' dense losses (600 random
    Fashion-MNIST-format images in batches of 250, 250 and 100)."""
    from tests.test_data import write_fashion_folder

    (tmp_path / "fashion").mkdir()
    folder = write_fashion_folder(tmp_path / "fashion", 600)
    trainer = make_trainer(
        str(tmp_path / "run"),
        "--training.local_batch_size=4",
        "--training.global_batch_size=16",
        f"--data.path={folder}",
        "--eval.batch_size=250",
    )
    assert trainer.ga_steps == 4
    result = trainer.evaluate()
    model, data = trainer.model.eval(), trainer.eval_set
    assert len(data) == 600
    with torch.no_grad():
        losses = []
        for start in range(0, len(data), 250):
            b = data.__getitems__(list(range(start, min(start + 250, len(data)))))
            img, txt, scale = model(b["image"].double(), b["text"])
            losses.append(InfoNCE().dense(img, txt, scale))
    want = torch.stack(losses).mean().item()
    assert abs(result["loss"] - want) <= 1e-9 * want
    assert 0.0 <= result["zero_shot_top1"] <= 1.0 and result["num_samples"] == len(data)


def test_global_negatives_with_accumulation_equal_one_big_batch(tmp_path: Path) -> None:
    """negatives=global, GA 4 x 2 samples == the dense loss of the batch of 8 in one microbatch."""
    trainer = make_trainer(
        str(tmp_path),
        "--training.local_batch_size=2",
        "--training.global_batch_size=8",
        "--loss.negatives=global",
        "--loss.stream_chunk_size=3",
    )
    assert trainer.ga_steps == 4 and isinstance(trainer.gradient_step, GlobalNegativesStep)
    full, init = batch(trainer, 0, 8), copy.deepcopy(trainer.model.state_dict())
    out = trainer.train_step([{k: v[i : i + 2] for k, v in full.items()} for i in range(0, 8, 2)])
    got = grads(trainer.model)

    trainer.model.load_state_dict(init)
    use_plain_step(trainer, RescaleAccumulatedLoss(InfoNCE().dense, 1))
    want_out = trainer.train_step([full])
    assert_close(got, grads(trainer.model))
    assert abs(out["loss"] - want_out["loss"]) <= REL * want_out["loss"]


def _dp_global_negatives(tmp: str, local: int, ga: int, layout: list[str]) -> None:
    """negatives=global on P ranks: the whole global batch is one problem (dense reference)."""
    import torch.distributed as dist

    world = int(__import__("os").environ["WORLD_SIZE"])
    trainer = make_trainer(
        tmp,
        f"--training.local_batch_size={local}",
        f"--training.global_batch_size={local * ga * world}",
        "--loss.negatives=global",
        "--loss.stream_chunk_size=5",
        *layout,
    )
    rank = dist.get_rank()
    reference = trainer.spec.build_model(trainer.model_args).double()
    reference.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    steps = [batch(trainer, j * local * world, local * world) for j in range(ga)]
    mine = [{k: v[rank * local : (rank + 1) * local] for k, v in s.items()} for s in steps]
    out = trainer.train_step(mine)

    every = {k: torch.cat([s[k] for s in steps]) for k in steps[0]}  # one problem over all samples
    img, txt, scale = reference(every["image"].double(), every["text"])
    loss = InfoNCE().dense(img, txt, scale)
    loss.backward()
    assert_close(grads(trainer.model), grads(reference))
    assert abs(out["loss"] - loss.item()) <= REL * loss.item()


DDP = ["--parallelism.data_parallel_replicate_degree=-1", "--parallelism.data_parallel_shard_degree=1"]


@pytest.mark.parametrize(
    "world, local, ga, layout", [(2, 3, 2, []), (2, 3, 2, DDP), (4, 2, 3, [])], ids=["fsdp2", "ddp2", "fsdp4"]
)
def test_data_parallel_global_negatives_match_dense(
    tmp_path: Path, world: int, local: int, ga: int, layout: list[str]
) -> None:
    run_distributed(_dp_global_negatives, world, str(tmp_path), local, ga, layout)


def _dp_microbatch_negatives(tmp: str, local: int, ga: int) -> None:
    """Each accumulation step: the microbatches of all ranks form one contrastive problem."""
    import torch.distributed as dist

    world = int(__import__("os").environ["WORLD_SIZE"])
    trainer = make_trainer(
        tmp, f"--training.local_batch_size={local}", f"--training.global_batch_size={local * ga * world}"
    )
    rank = dist.get_rank()
    assert trainer.ga_steps == ga and trainer.dp_degree == world
    reference = trainer.spec.build_model(trainer.model_args).double()  # a plain, unwrapped twin
    reference.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    # microstep j: rank r holds samples [j*local*world + r*local, ... + local)
    steps = [batch(trainer, j * local * world, local * world) for j in range(ga)]
    mine = [{k: v[rank * local : (rank + 1) * local] for k, v in s.items()} for s in steps]
    trainer.train_step(mine)

    for s in steps:  # dense single-process reference of the same k problems
        img, txt, scale = reference(s["image"].double(), s["text"])
        (InfoNCE().dense(img, txt, scale) / ga).backward()
    assert_close(grads(trainer.model), grads(reference))


@pytest.mark.parametrize("world, local, ga", [(2, 3, 2), pytest.param(4, 2, 3, marks=pytest.mark.slow)])
def test_data_parallel_microbatch_negatives_match_dense(tmp_path: Path, world: int, local: int, ga: int) -> None:
    run_distributed(_dp_microbatch_negatives, world, str(tmp_path), local, ga)


def test_gradcache_chunks_give_the_unchunked_gradients(tmp_path: Path) -> None:
    """[gradcache]: microbatches of 6 forwarded in chunks of 4 (uneven) == plain microbatches of 6."""
    plain = make_trainer(str(tmp_path / "plain"), "--training.local_batch_size=6", "--training.global_batch_size=12")
    cached = make_trainer(
        str(tmp_path / "cached"),
        "--training.local_batch_size=6",
        "--training.global_batch_size=12",
        "--gradcache.enabled=true",
        "--gradcache.chunk_sizes=4",
    )
    cached.model.load_state_dict(plain.model.state_dict())
    micro = [batch(plain, 0, 6), batch(plain, 6, 6)]
    want, got = plain.train_step(micro), cached.train_step(micro)
    assert_close(grads(cached.model), grads(plain.model))
    assert abs(got["loss"] - want["loss"]) <= REL * want["loss"]


def test_gradcache_with_global_negatives_equals_one_big_batch(tmp_path: Path) -> None:
    cached = make_trainer(
        str(tmp_path),
        "--training.local_batch_size=4",
        "--training.global_batch_size=8",
        "--loss.negatives=global",
        "--gradcache.enabled=true",
        "--gradcache.chunk_sizes=3",
    )
    init = copy.deepcopy(cached.model.state_dict())
    full = batch(cached, 0, 8)
    out = cached.train_step([{k: v[:4] for k, v in full.items()}, {k: v[4:] for k, v in full.items()}])
    got = grads(cached.model)
    cached.model.load_state_dict(init)
    use_plain_step(cached, RescaleAccumulatedLoss(InfoNCE().dense, 1))
    want = cached.train_step([full])
    assert_close(got, grads(cached.model))
    assert abs(out["loss"] - want["loss"]) <= REL * want["loss"]


def test_gradcache_per_tower_sizes_must_match_for_clip(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"gradcache.chunk_sizes=\[4, 8\]: the clip family runs both towers in one forward"
    ):
        make_trainer(str(tmp_path), "--gradcache.enabled=true", "--gradcache.chunk_sizes=4,8")


def _dp_gradcache(tmp: str, layout: list[str]) -> None:
    """GradCache on 2 ranks (no_sync except the last chunk) == the dense gathered problem."""
    import torch.distributed as dist

    trainer = make_trainer(
        tmp,
        "--training.local_batch_size=5",
        "--training.global_batch_size=20",
        "--gradcache.enabled=true",
        "--gradcache.chunk_sizes=2",
        *layout,
    )
    rank = dist.get_rank()
    reference = trainer.spec.build_model(trainer.model_args).double()
    reference.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    steps = [batch(trainer, j * 10, 10) for j in range(2)]
    trainer.train_step([{k: v[rank * 5 : (rank + 1) * 5] for k, v in s.items()} for s in steps])
    for s in steps:  # each microbatch step of both ranks is one problem
        img, txt, scale = reference(s["image"].double(), s["text"])
        (InfoNCE().dense(img, txt, scale) / 2).backward()
    assert_close(grads(trainer.model), grads(reference))


@pytest.mark.parametrize("layout", [[], DDP], ids=["fsdp2", "ddp"])
def test_data_parallel_gradcache_matches_dense(tmp_path: Path, layout: list[str]) -> None:
    run_distributed(_dp_gradcache, 2, str(tmp_path), layout)


def test_eval_dims_report_the_recall_of_cut_embeddings(tmp_path: Path) -> None:
    from titan_contrastive.components.evaluate import embed_dataset

    """eval.dims: recall of the first m dims, re-normalized, from the definition (rank of the right
    item among all); the full embedding's keys unchanged; more dims than the model has is an error."""
    trainer = make_trainer(str(tmp_path), "--data.dataset=emoji", "--eval.dims=8,3", "--eval.batch_size=64")
    result = trainer.evaluate()
    with torch.no_grad():  # the embeddings the evaluation ranks (their own forward is tested elsewhere)
        trainer.model.eval()
        img, txt, _, _ = embed_dataset(
            trainer.forward, trainer.eval_set, batch_size=64, device=torch.device("cpu"), rank=0, world_size=1
        )
    assert img.shape[-1] > 8
    for m, prefix in ((img.shape[-1], ""), (8, "dim8/"), (3, "dim3/")):
        a, t = (torch.nn.functional.normalize(x[:, :m], dim=-1) for x in (img, txt))
        sims = a @ t.T  # one product for both ways: rows of equal texts tie exactly, as in the evaluation
        for k in (1, 5):
            want = sum(int((sims[i] > sims[i, i]).sum()) < k for i in range(len(a))) / len(a)
            assert abs(result[f"{prefix}image_to_text_r@{k}"] - want) < 1e-6, (m, k)  # float32 means of 0/1
            back = sum(int((sims[:, i] > sims[i, i]).sum()) < k for i in range(len(t))) / len(t)
            assert abs(result[f"{prefix}text_to_image_r@{k}"] - back) < 1e-6, (m, k)
    assert (
        result["dim3/image_to_text_r@1"] != result["image_to_text_r@1"]
        or result["dim3/image_to_text_r@5"] != (result["image_to_text_r@5"])
    )
    d = img.shape[-1]
    for key in ("eval.dims", "loss.matryoshka_dims"):  # found at start, before any step
        with pytest.raises(ConfigError, match=rf"{key}=\[{d + 1}, 4\]: the embeddings have {d} dimensions"):
            make_trainer(str(tmp_path / key), "--data.dataset=emoji", f"--{key}={d + 1},4")


def _epochs_run(tmp: Path, *extra: str) -> Trainer:
    return Trainer(
        parse_args(
            [
                "--data.dataset=emoji",
                "--data.context_length=32",
                "--training.local_batch_size=128",
                "--training.global_batch_size=256",
                "--lr_scheduler.warmup_steps=1",
                "--checkpoint.enable=false",
                "--eval.enable=false",
                "--metrics.enable_tensorboard=false",
                f"--job.dump_folder={tmp}",
                *extra,
            ]
        )
    )


def test_epochs_give_the_run_its_steps(tmp_path: Path) -> None:
    """`training.epochs`: the optimizer steps of that many passes over the train set (an epoch's whole optimizer
    steps, its tail short of a global batch dropped, times the epochs), in place of `training.steps`: the loop, the
    learning-rate schedule and the profiler's windows all end there."""
    trainer = _epochs_run(tmp_path / "a", "--training.epochs=2", "--training.steps=1000")
    per_epoch = len(trainer.train_set) // 256
    steps = 2 * per_epoch
    assert per_epoch == 6 and trainer.loader.steps_per_epoch == 12  # loader steps of 128
    assert trainer.cfg.training.steps == steps == trainer.profiler.last_step
    trainer.train()
    assert trainer.step == steps and trainer.train_state.samples_seen == steps * 256
    assert trainer.lr_scheduler.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12)  # cosine to 0 at the derived end
    assert _epochs_run(tmp_path / "b", "--training.epochs=3").cfg.training.steps == 3 * per_epoch
    assert _epochs_run(tmp_path / "c", "--training.steps=7").cfg.training.steps == 7  # epochs 0: the steps given


@pytest.mark.parametrize(
    "local, steps, ends",
    [(256, 12, [6, 12]), (128, 12, [6, 12])],  # 6 loader steps an epoch, one a step; 12 an epoch, two a step
    ids=["one-loader-step-a-step", "two-loader-steps-a-step"],
)
def test_every_epoch_evaluates_and_saves_at_each_epochs_end(tmp_path: Path, local: int, steps: int, ends) -> None:
    """`eval.every_epoch` and `checkpoint.every_epoch`: an evaluation and a checkpoint after the optimizer step in
    which each epoch's last batch is (2 epochs), in place of eval.freq and checkpoint.interval; an epoch is whole
    optimizer steps however many loader steps make one (the 1,706 samples' tail short of 256 dropped)."""
    every = ["--eval.every_epoch=true", "--checkpoint.every_epoch=true", "--eval.freq=5", "--checkpoint.interval=5"]
    trainer = _epochs_run(
        tmp_path, "--training.epochs=2", f"--training.local_batch_size={local}", "--eval.enable=true",
        "--checkpoint.enable=true", "--checkpoint.keep_latest_k=0", "--checkpoint.keep_best=loss", *every,
    )  # fmt: skip
    assert (trainer.cfg.training.steps, trainer.ga_steps) == (steps, 256 // local)
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "eval"] == ends
    assert sorted(p.name for p in (tmp_path / "checkpoint").glob("step-*")) == sorted(f"step-{s}" for s in ends)


@pytest.mark.parametrize("ga_steps", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("epoch_steps", [1, 2, 3, 7, 13, 16])
def test_an_epochs_interval_is_the_step_holding_its_last_batch(epoch_steps: int, ga_steps: int) -> None:
    """`Interval` in epochs against its definition over loader steps: an epoch ends at each multiple of its loader
    steps, inside the optimizer step that holds that loader step (steps of `ga_steps` loader steps, from 1)."""
    from titan_contrastive.config.epochs import Interval

    interval, last = Interval(epoch_steps=epoch_steps, ga_steps=ga_steps), 40
    holding = sorted({-(-loader // ga_steps) for loader in range(1, last * ga_steps + 1) if loader % epoch_steps == 0})
    assert [s for s in range(1, last + 1) if interval(s)] == holding == interval.until(last)
    assert Interval(steps=6).until(20) == [6, 12, 18] == [s for s in range(1, 21) if Interval(steps=6)(s)]
    assert Interval().until(20) == [] and not any(map(Interval(), range(1, 21)))


def test_epochs_are_checked_as_the_steps_they_give() -> None:
    from titan_contrastive.config.epochs import run_steps

    late = ["--training.epochs=1", "--profiling.enable=true", "--profiling.start_step=300"]
    cfg = parse_args(late)  # the steps are not known yet: no refusal against the default training.steps
    with pytest.raises(ConfigError) as info:
        run_steps(cfg, 13, 2)
    assert "profiling.start_step=300 is after the run's last step (training.steps=6)" in str(info.value)
    with pytest.raises(ConfigError, match=r"training.steps=200"):
        parse_args(late[1:])  # without epochs, the steps given are checked at once
    with pytest.raises(ConfigError) as info:
        run_steps(parse_args(["--training.epochs=1"]), 3, 4)
    message = str(info.value)
    assert "\n" not in message and "training.epochs=1: 1 x 3 loader steps an epoch make no optimizer step" in message
    with pytest.raises(ConfigError, match=r"training.epochs=-1 is out of range"):
        parse_args(["--training.epochs=-1"])
    best = ["--checkpoint.enable=true", "--checkpoint.keep_best=loss", "--checkpoint.interval=12"]
    steps, evaluates = run_steps(parse_args([*best, "--eval.every_epoch=true"]), 12, 2)  # every 6 steps
    assert evaluates.until(steps) == list(range(6, steps + 1, 6))
    with pytest.raises(ConfigError) as info:  # every 5 steps, saves every 12: checked then
        run_steps(parse_args([*best, "--eval.every_epoch=true"]), 10, 2)
    message = str(info.value)
    assert "\n" not in message and "needs an evaluation at every checkpoint, and the save after step 12 has" in message
    assert run_steps(parse_args([*best, "--eval.every_epoch=true", "--training.steps=12"]), 10, 2)[0] == 12  # the last
