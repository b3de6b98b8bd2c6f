"""AdamW's implementations: fused (one kernel) and foreach give the same update; fused is the default, on CPU too."""

from __future__ import annotations

import copy

import torch
from torch import nn

from titan_contrastive.components.optimizer import build_optimizer
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
