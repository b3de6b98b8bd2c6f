"""AdamW's implementations: fused (one kernel) and foreach give the same update; fused is the default, on CPU too.
Layer-wise learning-rate decay (`[optimizer] layer_decay`): each parameter's layer in its tower, its rate, the
trainer's steps at those rates, an exact resume, and the refusals."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from titan_contrastive.checkpoint.reader import CheckpointError
from titan_contrastive.components.optimizer import build_optimizer
from titan_contrastive.components.tower_layers import tower_depth, tower_layer
from titan_contrastive.config import ConfigError
from titan_contrastive.config.job_config import Optimizer as OptimizerConfig


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3)).double()


def train(net: nn.Module, implementation: str, steps: int = 4) -> torch.optim.Optimizer:
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, implementation=implementation)
    optimizer = build_optimizer(net, cfg)
    for step in range(steps):
        ids = torch.randint(0, 11, (8,), generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        net(ids).pow(2).sum().backward()
        optimizer.step()
    return optimizer


def test_fused_and_foreach_give_the_same_parameters() -> None:
    foreach, fused = model(), model()
    fused.load_state_dict(foreach.state_dict())
    start = copy.deepcopy(foreach)
    train(foreach, "foreach")
    train(fused, "fused")
    for (name, a), b, s in zip(foreach.named_parameters(), fused.parameters(), start.parameters()):
        assert not torch.equal(a, s), name  # it trained
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14), (name, (a - b).abs().max())


def test_the_default_is_fused_and_foreach_when_asked() -> None:
    default = build_optimizer(model(), OptimizerConfig()).defaults
    assert default["fused"] and not default["foreach"]
    foreach = train(model(), "foreach", steps=0).defaults
    assert foreach["foreach"] and not foreach["fused"]


# ---------------------------------------------------------------- layer-wise learning-rate decay


def test_a_parameter_s_layer_in_its_tower() -> None:
    """Our towers' and transformers' names: before the blocks 0, block i at i + 1 (the outermost index: T5's
    block.N holds layer.M), after them depth + 1."""
    cases = {
        "visual.conv1.weight": 0,
        "visual.transformer.blocks.1.attn.in_proj.weight": 2,
        "visual.proj": 13,
        "text.ln_final.weight": 13,
        "visual.transformer.embeddings.patch_embedding.weight": 0,
        "visual.transformer.pre_layrnorm.weight": 0,
        "visual.transformer.encoder.layers.11.self_attn.q_proj.weight": 12,
        "visual.transformer.post_layernorm.bias": 13,
        "visual.projection.weight": 13,
        "visual.transformer.head.attention.in_proj_weight": 13,
        "query_tower.embeddings.word_embeddings.weight": 0,
        "query_tower.encoder.layer.5.attention.self.query.weight": 6,
        "query_tower.encoder.block.2.layer.1.DenseReluDense.wi.weight": 3,
        "query_tower.encoder.final_layer_norm.weight": 13,
    }
    for name, layer in cases.items():
        prefix = name.split(".")[0] + "."
        assert tower_layer(name, prefix, 12) == layer, name
    assert (
        tower_depth(["text.transformer.blocks.0.x", "text.transformer.blocks.7.y", "visual.blocks.9.z"], "text.") == 8
    )


def test_layer_decay_sets_each_parameter_s_learning_rate() -> None:
    """clip/debug (2 blocks per tower) at layer_decay 0.5: embeddings x 1/8, block 0 x 1/4, block 1 x 1/2, what
    follows and the logit scale x 1; weight decay still on matrices only; the full-lr groups first."""
    from titan_contrastive.models.clip import CLIP, clip_flavors

    net = CLIP(clip_flavors["debug"])
    towers = {"image": "visual.", "text": "text."}
    plain = build_optimizer(net, OptimizerConfig(lr=0.1), towers)
    assert len(plain.param_groups) == 2 and {g["lr"] for g in plain.param_groups} == {0.1}
    optimizer = build_optimizer(net, OptimizerConfig(lr=0.1, layer_decay=0.5), towers)
    lr = {id(p): (g["lr"], g["weight_decay"]) for g in optimizer.param_groups for p in g["params"]}
    want = {
        "visual.conv1.weight": (0.0125, 0.1),
        "visual.class_embedding": (0.0125, 0.0),
        "visual.ln_pre.weight": (0.0125, 0.0),
        "visual.transformer.blocks.0.attn.in_proj.weight": (0.025, 0.1),
        "visual.transformer.blocks.1.mlp.c_fc.bias": (0.05, 0.0),
        "visual.ln_post.weight": (0.1, 0.0),
        "visual.proj": (0.1, 0.1),
        "text.token_embedding.weight": (0.0125, 0.0),
        "text.transformer.blocks.1.attn.out_proj.weight": (0.05, 0.1),
        "text.text_projection": (0.1, 0.1),
        "logit_scale": (0.1, 0.0),
    }
    params = dict(net.named_parameters())
    for name, (rate, decay) in want.items():
        assert lr[id(params[name])] == pytest.approx((rate, decay), rel=1e-12), name
    assert len(lr) == len(params) and optimizer.param_groups[0]["lr"] == 0.1


def test_the_trainer_steps_each_layer_at_its_rate_and_resumes_exactly(tmp_path: Path) -> None:
    """AdamW's first step moves a weight by lr x its scale (|m / sqrt(v)| = 1 then): measured per layer through
    the trainer's scheduler; a resume with the same decay lands on the uninterrupted run's parameters bit for
    bit; another decay is refused before anything loads."""
    from tests.test_trainer import make_trainer

    args = ["--optimizer.layer_decay=0.5", "--optimizer.lr=1e-3", "--optimizer.weight_decay=0", "--optimizer.eps=1e-30"]
    args += ["--lr_scheduler.warmup_steps=0", "--lr_scheduler.decay_type=none", "--training.local_batch_size=8"]
    args += ["--eval.enable=false"]
    trainer = make_trainer(str(tmp_path / "one"), *args)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train_step([trainer.train_set.__getitems__(list(range(8)))])
    for name, scale in {"visual.conv1.weight": 1 / 8, "text.transformer.blocks.0.mlp.c_fc.weight": 1 / 4}.items():
        moved = (dict(trainer.model.named_parameters())[name] - start[name]).abs()
        assert moved.max().item() == pytest.approx(1e-3 * scale, rel=1e-6), name
    trainer.metrics.close()

    resume = [*args, "--checkpoint.enable=true", "--checkpoint.interval=1"]
    whole = make_trainer(str(tmp_path / "whole"), *args, "--training.steps=2")
    whole.train()
    first = make_trainer(str(tmp_path / "resumed"), *resume, "--training.steps=1")
    first.train()
    second = make_trainer(str(tmp_path / "resumed"), *resume, "--training.steps=2")
    second.train()
    for (name, a), b in zip(whole.model.named_parameters(), second.model.parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(
        CheckpointError,
        match=r"optimizer.layer_decay: 0.5 -> 0.75 since checkpoint step-2, but the optimizer's parameter groups",
    ):
        make_trainer(str(tmp_path / "resumed"), *resume, "--training.steps=3", "--optimizer.layer_decay=0.75").train()
    for t in (whole, first, second):
        t.metrics.close()


def test_a_family_without_towers_refuses_it(tmp_path: Path) -> None:
    from tests.test_trainer import make_trainer

    with pytest.raises(ConfigError, match=r"optimizer.layer_decay=0.5: the vlm family names no towers"):
        make_trainer(str(tmp_path), "--model.name=vlm", "--optimizer.layer_decay=0.5")
    with pytest.raises(ConfigError, match=r"optimizer.layer_decay=0.0 .*a number in \(0, 1\]"):
        make_trainer(str(tmp_path), "--optimizer.layer_decay=0")
