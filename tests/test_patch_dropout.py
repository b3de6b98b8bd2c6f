"""FLIP's patch dropout (`models/patch_dropout.py`, `[model] patch_dropout`): which tokens it keeps; that every
step kind (GradCache chunks that divide nothing, streamed global negatives on 1, 2 and 4 gloo processes)
replays it exactly, residual dropout on too, in float64 against the dense objective over the same forwards;
its FLOPs; the hf_clip kinds; the families and folders that refuse it; and a resume that turns it off."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from tests.dist_utils import run_distributed
from tests.needs import needs
from tests.test_hard_negatives import assert_grads_close, assert_step_equals_its_forwards
from tests.test_trainer import REL, full, grads, make_trainer
from titan_contrastive.config import ConfigError
from titan_contrastive.losses import InfoNCE
from titan_contrastive.models.clip import CLIP, clip_flavors
from titan_contrastive.models.patch_dropout import PatchDropout, kept_patches

DROP = "--model.patch_dropout=0.5"


@pytest.fixture
def dropout_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The debug flavor with residual dropout too: both draws in one forward must replay."""
    monkeypatch.setitem(clip_flavors, "debug", dataclasses.replace(clip_flavors["debug"], dropout=0.1))


def test_each_image_keeps_its_prefix_and_a_share_of_its_patches_in_order() -> None:
    x = torch.arange(6 * 11 * 2, dtype=torch.float64).reshape(6, 11, 2)  # a class token, then 10 patches
    drop = PatchDropout(0.65, prefix=1)
    torch.manual_seed(0)
    out = drop(x)
    assert out.shape == (6, 1 + 3, 2) and kept_patches(10, 0.65) == 3
    assert torch.equal(out[:, 0], x[:, 0])
    positions = (out[:, 1:, 0] - x[:, :1, 0]) / 2  # the kept tokens' positions among the sample's
    assert torch.equal(out[:, 1:], x.gather(1, positions.long()[..., None].expand(-1, -1, 2)))
    assert (positions.diff(dim=1) > 0).all() and (positions >= 1).all()  # distinct, in order, never the prefix
    assert len({tuple(p) for p in positions.tolist()}) > 1  # drawn per image
    torch.manual_seed(1)
    at = torch.arange(10.0).expand(6, 10)[..., None]  # each patch holds its position
    kept = sum(torch.zeros(6, 10).scatter_(1, PatchDropout(0.5)(at)[..., 0].long(), 1).sum(0) for _ in range(400))
    assert ((kept / 2400 - 0.5).abs() < 0.05).all()  # every patch kept about half the time
    assert PatchDropout(0.99)(x).shape == (6, 1, 2)  # at least one patch
    with pytest.raises(ValueError, match=r"prob=1.0 must be in \[0, 1\)"):
        PatchDropout(1.0)


def test_evaluation_and_zero_keep_every_patch_and_draw_nothing() -> None:
    x = torch.randn(3, 5, 4)
    state = torch.get_rng_state()
    assert PatchDropout(0.5).eval()(x) is x and PatchDropout(0.0)(x) is x
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("prob", [0.0, 0.5, 0.8])
def test_the_blocks_see_the_kept_tokens_and_the_flops_count_them(prob: float) -> None:
    args = dataclasses.replace(clip_flavors["debug"], patch_dropout=prob)
    torch.manual_seed(0)
    model = CLIP(args)
    images, texts = torch.randn(2, 1, 28, 28), torch.randint(3, 200, (2, args.context_length))
    seen = []
    model.visual.transformer.blocks[0].register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1]))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as forward:
        model(images, texts)
    assert seen == [1 + kept_patches(49, prob)]
    assert forward.get_total_flops() * 3 == args.flops_per_sample() * 2
    model.eval()(images, texts)
    assert seen[-1] == 50


@pytest.mark.parametrize("step", ["gradcache", "global"])
def test_every_step_kind_replays_the_dropped_patches(tmp_path: Path, dropout_on: None, step: str) -> None:
    """GradCache chunks of 3 over 7, and global negatives over 2 microbatches of 3 streamed in chunks of 5."""
    if step == "gradcache":
        trainer = make_trainer(
            str(tmp_path),
            DROP,
            "--training.local_batch_size=7",
            "--gradcache.enabled=true",
            "--gradcache.chunk_sizes=3",
        )
        batch = trainer.train_set.__getitems__(list(range(7)))
        microbatches, pieces = [batch], trainer.step_context.split(batch, 3)
    else:
        trainer = make_trainer(
            str(tmp_path),
            DROP,
            "--training.local_batch_size=3",
            "--training.global_batch_size=6",
            "--loss.negatives=global",
            "--loss.stream_chunk_size=5",
        )
        microbatches = pieces = [trainer.train_set.__getitems__(list(range(i, i + 3))) for i in (0, 3)]
    tokens = []
    trainer.model.visual.transformer.blocks[0].register_forward_pre_hook(lambda m, a: tokens.append(a[0].shape[1]))
    assert_step_equals_its_forwards(trainer, microbatches, pieces, seed=4)
    assert tokens and set(tokens) == {1 + 24}  # 24 of the 49 patches, every pass
    trainer.metrics.close()


def _global_on_ranks(tmp: str, local: int, ga: int, layout: list[str]) -> None:
    """Each rank runs the step from one seed; the reference encodes each rank's microbatches in order from that
    seed, as the rank's first pass does, and scores all of them as one problem."""
    clip_flavors["debug"] = dataclasses.replace(clip_flavors["debug"], dropout=0.1)  # this rank's process only
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    trainer = make_trainer(
        tmp,
        DROP,
        f"--training.local_batch_size={local}",
        f"--training.global_batch_size={local * ga * world}",
        "--loss.negatives=global",
        "--loss.stream_chunk_size=5",
        *layout,
    )
    steps = [trainer.train_set.__getitems__(list(range(j * local * world, (j + 1) * local * world))) for j in range(ga)]
    mine = [{k: v[rank * local : (rank + 1) * local] for k, v in s.items()} for s in steps]
    reference = trainer.spec.build_model(trainer.model_args).double().train()
    reference.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    torch.manual_seed(11)
    out = trainer.train_step(mine)
    parts = []
    for r in range(world):
        torch.manual_seed(11)
        rows = slice(r * local, (r + 1) * local)
        parts += [reference(s["image"][rows].double(), s["text"][rows]) for s in steps]
    loss = InfoNCE().dense(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), parts[0][2])
    loss.backward()
    assert_grads_close(grads(trainer.model), grads(reference))
    assert abs(out["loss"] - loss.item()) <= REL * loss.item()
    trainer.metrics.close()


DDP = ["--parallelism.data_parallel_replicate_degree=-1", "--parallelism.data_parallel_shard_degree=1"]


@pytest.mark.parametrize(
    "world, local, ga, layout",
    [(2, 3, 2, []), pytest.param(4, 2, 3, DDP, marks=pytest.mark.slow)],
    ids=["fsdp2", "ddp4"],
)
def test_global_negatives_on_ranks_replay_each_rank_s_draws(
    tmp_path: Path, world: int, local: int, ga: int, layout: list[str]
) -> None:
    run_distributed(_global_on_ranks, world, str(tmp_path), local, ga, layout)


@needs("hf")
@pytest.mark.parametrize("kind, prefix", [("clip", 1), ("siglip", 0)])
def test_hf_clip_replays_the_dropped_patches(tmp_path: Path, kind: str, prefix: int) -> None:
    """A transformers CLIP (its class token kept) or SigLIP (no class token: its attention head pools what is
    kept), 4 patches of which 2 are kept: GradCache chunks of 3 over 7 against the same forwards, dropout on."""
    from tests.test_hf_clip import clip_run

    trainer = clip_run(
        tmp_path, kind, DROP, "--training.local_batch_size=7", "--gradcache.enabled=true", "--gradcache.chunk_sizes=3"
    )
    tokens = []
    layer = trainer.model.visual.transformer.encoder.layers[0]
    layer.register_forward_pre_hook(
        lambda m, a, k: tokens.append((a or (k["hidden_states"],))[0].shape[1]), with_kwargs=True
    )
    batch = trainer.train_set.__getitems__(list(range(7)))
    batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    assert_step_equals_its_forwards(trainer, [batch], trainer.step_context.split(batch, 3), seed=5)
    assert tokens and set(tokens) == {prefix + 2}
    args = trainer.model_args
    assert args.flops_per_sample() == 6 * (args._counts[2] * (prefix + 2) + args._counts[3] * args.context_length)
    assert (
        trainer.model.state_dict().keys()
        == clip_run(tmp_path / "plain", kind, "--training.local_batch_size=4").model.state_dict().keys()
    )
    trainer.model.eval()(batch["image"][:2], batch["text"][:2])
    assert tokens[-1] == prefix + 4
    trainer.metrics.close()


def test_a_model_without_patches_to_drop_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model.patch_dropout=0.5: the vlm family has no image patches to drop"):
        make_trainer(str(tmp_path), "--model.name=vlm", DROP)
    with pytest.raises(ConfigError, match=r"model.patch_dropout=1.0 .*a number in \[0, 1\)"):
        make_trainer(str(tmp_path), "--model.patch_dropout=1")


@needs("hf")
def test_siglip2_s_patch_budget_is_its_own_dropout(tmp_path: Path) -> None:
    from tests.test_hf_clip import clip_run

    with pytest.raises(
        ConfigError, match=r"model.patch_dropout=0.5: .* is SigLIP 2 \(NaFlex\).* set model.patch_dropout=0"
    ):
        clip_run(tmp_path, "siglip2", DROP)


def test_a_resume_may_turn_it_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """FLIP ends with unmasked tuning: the run resumes with patch_dropout 0, which is logged and applied."""
    common = ["--training.local_batch_size=4", "--checkpoint.enable=true", "--checkpoint.interval=2"]
    common += ["--eval.enable=false"]
    trainer = make_trainer(str(tmp_path), DROP, *common, "--training.steps=2")
    trainer.train()
    trainer.metrics.close()
    with caplog.at_level(logging.INFO, logger="titan_contrastive"):
        resumed = make_trainer(str(tmp_path), *common, "--training.steps=3")
        tokens = []
        resumed.model.visual.transformer.blocks[0].register_forward_pre_hook(lambda m, a: tokens.append(a[0].shape[1]))
        resumed.train()
    assert "config changed since step-2, applied: model.patch_dropout: 0.5 -> 0.0" in caplog.text
    assert resumed.train_state.step == 3 and tokens[0] == 50
    resumed.metrics.close()


@needs("hf")
def test_lit_s_image_tower_drops_patches_too(tmp_path: Path) -> None:
    """lit: the ViT against MiniLM, GradCache chunks of 3 over 7 against the same forwards (MiniLM's dropout on)."""
    trainer = make_trainer(
        str(tmp_path),
        DROP,
        "--model.name=lit",
        "--model.flavor=minilm_debug",
        "--data.dataset=emoji",
        "--data.context_length=16",
        "--training.local_batch_size=7",
        "--gradcache.enabled=true",
        "--gradcache.chunk_sizes=3",
    )
    assert trainer.model.visual.patch_dropout.prob == 0.5
    assert (
        trainer.model_args.flops_per_sample()
        < dataclasses.replace(trainer.model_args, patch_dropout=0).flops_per_sample()
    )
    batch = trainer.train_set.__getitems__(list(range(7)))
    assert_step_equals_its_forwards(trainer, [batch], trainer.step_context.split(batch, 3), seed=6)
    trainer.metrics.close()
