"""DDP / FSDP2 / HSDP on gloo give a single process's parameters; AC, compile, precision, non-finite.

Every layout trains 3 optimizer steps of the real clip/debug model on real data in float64 with
gradient clipping active, and must end with the parameters (and the logged loss sequence) of one
process running the same global batch: rel. err <= 1e-10.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule

from tests.dist_utils import TWO_AND_FOUR, run_distributed
from titan_contrastive.components.nonfinite import NonFiniteError, NonFiniteGuard
from titan_contrastive.config import ConfigError, parse_args
from titan_contrastive.parallelisms import destroy_distributed
from titan_contrastive.train import Trainer

LOCAL = 2  # samples per rank per microbatch
REL = 1e-10


def make_trainer(dump: Path, *extra: str) -> Trainer:
    return Trainer(
        parse_args(
            [
                "--training.dtype=float64",
                "--training.max_norm=0.5",
                "--training.steps=3",
                "--metrics.log_freq=1",
                "--metrics.enable_tensorboard=false",
                "--eval.enable=false",
                "--lr_scheduler.warmup_steps=1",
                f"--job.dump_folder={dump}",
                *extra,
            ]
        )
    )


def losses(dump: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (dump / "metrics.jsonl").read_text().splitlines()]


def full_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _train_layouts(tmp: str, layouts: list[tuple[str, list[str]]]) -> None:
    for name, extra in layouts:
        trainer = make_trainer(Path(tmp) / name, *extra)
        trainer.train()
        params = full_params(trainer)
        if torch.distributed.get_rank() == 0:
            torch.save(params, Path(tmp) / f"{name}.pt")
        trainer.metrics.close()


def reference(tmp: Path, local: int, ga: int, *extra: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    dump = tmp / f"reference_{local}_{ga}"
    batch = [f"--training.local_batch_size={local}", f"--training.global_batch_size={local * ga}"]
    trainer = make_trainer(dump, *batch, *extra)
    trainer.train()
    trainer.metrics.close()
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, losses(dump)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), what
    for key in want:
        err = ((got[key] - want[key]).norm() / want[key].norm()).item()
        assert err <= REL, f"{what}: {key} relative error {err:.2e}"


def layout(name: str, replicate: int, shard: int, ga: int, world: int, defer: bool = False) -> tuple[str, list[str]]:
    return (
        f"{name}_ga{ga}_defer{int(defer)}",
        [
            f"--parallelism.data_parallel_replicate_degree={replicate}",
            f"--parallelism.data_parallel_shard_degree={shard}",
            f"--parallelism.defer_grad_sync={str(defer).lower()}",
            f"--training.local_batch_size={LOCAL}",
            f"--training.global_batch_size={LOCAL * ga * world}",
        ],
    )


@pytest.mark.parametrize("world", TWO_AND_FOUR)
def test_layouts_match_a_single_process(tmp_path: Path, world: int) -> None:
    if world == 2:
        layouts = [
            layout("ddp", 2, 1, 1, 2),
            layout("ddp", 2, 1, 2, 2),
            layout("fsdp", 1, 2, 1, 2),
            layout("fsdp", 1, 2, 2, 2),
            layout("fsdp", 1, 2, 2, 2, defer=True),
        ]
    else:
        layouts = [
            layout("fsdp", 1, 4, 2, 4),
            layout("fsdp", 1, 4, 2, 4, defer=True),
            layout("hsdp", 2, 2, 1, 4),
            layout("hsdp", 2, 2, 2, 4),
            layout("hsdp", 2, 2, 2, 4, defer=True),
        ]
    run_distributed(_train_layouts, world, str(tmp_path), layouts)
    refs = {ga: reference(tmp_path, LOCAL * world, ga) for ga in (1, 2)}
    for name, _ in layouts:
        ga = int(name.split("_ga")[1][0])
        want_params, want_losses = refs[ga]
        assert_same(torch.load(tmp_path / f"{name}.pt"), want_params, name)
        got = losses(tmp_path / name)
        assert len(got) == 3 and all(abs(g - w) <= REL * abs(w) for g, w in zip(got, want_losses)), (
            name,
            got,
            want_losses,
        )


def test_fsdp_on_one_device_matches_a_single_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """parallelism.fsdp_one_device: FSDP2 over a group of one (no torchrun), 2 microbatches, global
    negatives, dropout on; its checkpoint resumes without FSDP. Both end at the plain run's parameters."""
    from titan_contrastive.models.clip.args import clip_flavors

    monkeypatch.setitem(clip_flavors, "debug", dataclasses.replace(clip_flavors["debug"], dropout=0.1))
    common = ["--loss.negatives=global", "--checkpoint.enable=true", "--checkpoint.interval=2"]
    want_params, want_losses = reference(tmp_path, LOCAL, 2, *common)
    runs = [
        ("one_device", "3", "true"),
        ("one_device_then_plain", "2", "true"),
        ("one_device_then_plain", "3", "false"),
    ]
    for name, steps, flag in runs:
        extra = layout(name, 1, 1, 2, 1)[1]
        trainer = make_trainer(
            tmp_path / name, *extra, *common, f"--training.steps={steps}", f"--parallelism.fsdp_one_device={flag}"
        )
        try:
            assert isinstance(trainer.model, FSDPModule) == (flag == "true"), name
            trainer.train()
            if steps == "3":
                assert_same(full_params(trainer), want_params, f"{name} ({flag})")
        finally:
            trainer.metrics.close()
            del trainer
            destroy_distributed()
        got = losses(tmp_path / name)
        assert len(got) == int(steps) and all(abs(g - w) <= REL * abs(w) for g, w in zip(got, want_losses)), name


def test_degrees_are_validated(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"replicate_degree \(2\) x data_parallel_shard_degree \(-1\) must equal WORLD_SIZE=1"
    ):
        make_trainer(tmp_path, "--parallelism.data_parallel_replicate_degree=2")
    with pytest.raises(ConfigError, match="both -1"):
        make_trainer(tmp_path, "--parallelism.data_parallel_replicate_degree=-1")


def one_step_grads(tmp: Path, *extra: str, microbatches: int = 1) -> dict[str, torch.Tensor]:
    args = ["--training.local_batch_size=6", f"--training.global_batch_size={6 * microbatches}"]
    trainer = make_trainer(tmp, *args, "--training.max_norm=0", *extra)
    trainer.train_step([trainer.train_set.__getitems__(list(range(6 * i, 6 * i + 6))) for i in range(microbatches)])
    trainer.metrics.close()
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize(
    "extra",
    [
        ["--activation_checkpoint.mode=full"],
        ["--activation_checkpoint.mode=selective"],
        # compiled alone: slow (compiled with AC below, and test_compiled_blocks_keep_the_global_negatives_gradient)
        pytest.param(["--compile.enable=true", "--compile.backend=aot_eager"], marks=pytest.mark.slow),
        ["--activation_checkpoint.mode=selective", "--compile.enable=true", "--compile.backend=aot_eager"],
    ],
)
def test_ac_and_compile_keep_gradients(tmp_path: Path, extra: list[str]) -> None:
    want = one_step_grads(tmp_path / "plain")
    got = one_step_grads(tmp_path / "variant", *extra)
    assert_same(got, want, " ".join(extra))


def test_compiled_blocks_keep_the_global_negatives_gradient(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Global negatives run each compiled block twice per microbatch (no-grad first pass, then the
    re-forward with its cached gradient): 3 microbatches of 6, dropout on, against eager."""
    from titan_contrastive.models.clip.args import clip_flavors

    monkeypatch.setitem(clip_flavors, "debug", dataclasses.replace(clip_flavors["debug"], dropout=0.1))
    want = one_step_grads(tmp_path / "eager", "--loss.negatives=global", microbatches=3)
    compiled = ["--compile.enable=true", "--compile.backend=aot_eager"]
    got = one_step_grads(tmp_path / "compiled", "--loss.negatives=global", *compiled, microbatches=3)
    assert_same(got, want, "compiled global negatives")


@pytest.mark.parametrize("negatives", ["microbatch", "global"])
def test_bfloat16_autocast_tracks_float32(tmp_path: Path, negatives: str) -> None:
    """Also with global negatives, whose step checks that the embeddings are normalized: the
    model normalizes in bf16 under autocast (|1 - ||z||| about 3e-3) and that must pass."""

    def run(name: str, *extra: str) -> list[float]:
        trainer = Trainer(
            parse_args(
                [
                    "--training.steps=3",
                    "--training.local_batch_size=16",
                    "--metrics.log_freq=1",
                    "--eval.enable=false",
                    "--metrics.enable_tensorboard=false",
                    f"--job.dump_folder={tmp_path / name}",
                    f"--loss.negatives={negatives}",
                    "--training.global_batch_size=32",
                    *extra,
                ]
            )
        )
        trainer.train()
        trainer.metrics.close()
        return losses(tmp_path / name)

    fp32, bf16 = run("fp32"), run("bf16", "--training.mixed_precision_param=bfloat16")
    assert all(abs(a - b) <= 2e-2 * a for a, b in zip(fp32, bf16)), (fp32, bf16)
    assert fp32 != bf16  # autocast really ran in bfloat16


def test_fsdp_on_one_device_runs_the_residual_stream_in_bfloat16(tmp_path: Path) -> None:
    """With bf16 mixed precision, autocast keeps the text tower's residual stream in float32 (float32
    embeddings; each residual add promotes); FSDP2 on one device (parallelism.fsdp_one_device) runs it in
    bf16, and its losses track float32 as autocast's do."""
    seen: dict[str, torch.dtype] = {}

    def run(name: str, *extra: str) -> list[float]:
        args = ["--training.steps=3", "--training.local_batch_size=16", "--training.global_batch_size=32"]
        trainer = make_trainer(tmp_path / name, "--training.dtype=float32", *args, *extra)
        try:
            text_block = trainer.model.text.transformer.blocks[-1]
            text_block.register_forward_pre_hook(lambda module, inputs: seen.setdefault(name, inputs[0].dtype) and None)
            trainer.train()
        finally:
            trainer.metrics.close()
            del trainer
            destroy_distributed()
        return losses(tmp_path / name)

    bf16 = "--training.mixed_precision_param=bfloat16"
    fp32, fsdp = run("fp32"), run("fsdp", bf16, "--parallelism.fsdp_one_device=true")
    run("autocast", bf16)
    assert seen == {"fp32": torch.float32, "fsdp": torch.bfloat16, "autocast": torch.float32}
    assert all(abs(a - b) <= 2e-2 * a for a, b in zip(fp32, fsdp)) and fp32 != fsdp, (fp32, fsdp)


def test_float16_scaler_skips_overflowing_steps(tmp_path: Path) -> None:
    trainer = Trainer(
        parse_args(
            [
                "--training.mixed_precision_param=float16",
                "--training.local_batch_size=8",
                "--eval.enable=false",
                "--metrics.enable_tensorboard=false",
                f"--job.dump_folder={tmp_path}",
            ]
        )
    )
    scaler = trainer.precision.scaler
    assert scaler is not None
    scaler._init_scale = 2.0**100  # noqa: SLF001 - force an overflow on the first step
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    out = trainer.train_step([trainer.train_set.__getitems__(list(range(8)))])
    assert out["skipped_steps"] == 1 and scaler.get_scale() < 2.0**100
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    out = trainer.train_step([trainer.train_set.__getitems__(list(range(8, 16)))])
    assert torch.isfinite(torch.tensor(out["loss"]))
    trainer.metrics.close()


def test_float64_with_mixed_precision_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="mixed_precision_param='bfloat16' with training.dtype='float64'"):
        make_trainer(tmp_path, "--training.mixed_precision_param=bfloat16")


def nan_batch(trainer: Trainer) -> dict[str, torch.Tensor]:
    batch = trainer.train_set.__getitems__(list(range(4)))
    batch["image"][0, 0, 0, 0] = float("nan")
    return batch


def test_nonfinite_stop_names_step_and_values(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, "--training.local_batch_size=4")
    with pytest.raises(NonFiniteError, match=r"step 1: non-finite loss=nan, grad_norm=nan; "):
        trainer.train_step([nan_batch(trainer)])
    trainer.metrics.close()


def test_nonfinite_skip_keeps_parameters_and_counts(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, "--training.local_batch_size=4", "--training.on_nonfinite=skip")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    out = trainer.train_step([nan_batch(trainer)])
    assert out["skipped_steps"] == 1 and trainer.step == 1
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    out = trainer.train_step([trainer.train_set.__getitems__(list(range(4, 8)))])  # training goes on
    assert out["skipped_steps"] == 1 and torch.isfinite(torch.tensor(out["loss"]))
    trainer.metrics.close()


def test_metrics_jsonl_is_strict_json_with_nonfinite_values(tmp_path: Path) -> None:
    """A skipped non-finite step is logged; metrics.jsonl stays strict JSON ("nan" as a string)."""
    import json

    trainer = make_trainer(tmp_path, "--training.local_batch_size=4", "--training.on_nonfinite=skip")
    out = trainer.train_step([nan_batch(trainer)])
    trainer.metrics.log_train(1, **out)
    trainer.metrics.close()

    def reject(constant: str) -> None:
        raise ValueError(f"non-strict JSON constant {constant}")

    records = [
        json.loads(line, parse_constant=reject) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert records[-1]["loss"] == "nan" and records[-1]["grad_norm"] == "nan" and records[-1]["skipped_steps"] == 1


def test_skipping_gives_up_after_max_consecutive_skips(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """on_nonfinite=skip stops (NonFiniteError: exit code 3) past max_consecutive_skips in a row; a
    finite step resets the count; the message names only the values that were non-finite."""
    trainer = make_trainer(
        tmp_path, "--training.local_batch_size=4", "--training.on_nonfinite=skip", "--training.max_consecutive_skips=2"
    )
    for _ in range(2):
        assert trainer.train_step([nan_batch(trainer)])["skipped_steps"] >= 1
    assert "2 in a row" in caplog.text
    with pytest.raises(
        NonFiniteError,
        match=r"step 3: non-finite loss=nan, grad_norm=nan, 3 steps in a row, past training.max_consecutive_skips=2",
    ):
        trainer.train_step([nan_batch(trainer)])
    trainer.metrics.close()
    guard = NonFiniteGuard("skip", 1)
    # loss=2.5 is not blamed
    assert guard.check(1, 2.5, float("inf"), 0) is True and "non-finite grad_norm=inf;" in caplog.text
    assert guard.check(2, 2.5, 1.0, 1) is None and guard.in_row == 0  # a finite step resets the count
    assert guard.check(3, float("nan"), 1.0, 1) is True
