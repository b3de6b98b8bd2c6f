"""The step protocol's shared pieces: the grad-sync helper, the RNG helper, the cached-gradient
engine with a several-output model, the dataset protocol, and adding a step kind (one module,
one registration line) without touching the trainer. float64, CPU, real gloo processes."""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist_utils import run_distributed
from tests.test_trainer import assert_close, make_trainer
from titan_contrastive import steps
from titan_contrastive.checkpoint import RNGState
from titan_contrastive.datasets import Dataset, ZeroShotDataset, build_dataset
from titan_contrastive.grad_cache import GradCache, GradCacheError, forward_backward, forward_no_grad
from titan_contrastive.grad_cache.rng import RandContext, capture_rng, restore_rng
from titan_contrastive.grad_cache.sync import grad_sync
from titan_contrastive.models import registry

REL = 1e-10


# ------------------------------------------------------------------ one grad-sync helper


def _grad_sync_defers_reduction(wrapper: str) -> None:
    """Rank r backpropagates (r + 1) * x twice, the first time inside grad_sync(sync=False): the
    reduction happens once, after the second, and averages what both accumulated."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Linear(4, 4, bias=False).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    if wrapper == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        wrapped = fully_shard(model)
    for sync in (False, True):
        with grad_sync(wrapped, sync):
            wrapped((rank + 1) * x).sum().backward()
        if not sync:  # nothing reduced yet: DDP holds this rank's own gradient, FSDP2 none at all
            grad = model.weight.grad
            if wrapper == "ddp":
                assert torch.equal(grad, (rank + 1) * x.sum(0).expand(4, 4))
            else:
                assert grad is None
    mean_factor = sum(r + 1 for r in range(world)) / world
    want = 2 * mean_factor * x.sum(0).expand(4, 4)  # d/dW of sum(W (r+1) x), twice, averaged over ranks
    got = model.weight.grad.full_tensor() if hasattr(model.weight.grad, "full_tensor") else model.weight.grad
    assert torch.allclose(got, want, rtol=REL, atol=0)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_grad_sync_reduces_only_when_asked(wrapper: str) -> None:
    run_distributed(_grad_sync_defers_reduction, 2, wrapper)


def test_grad_sync_on_a_plain_module_changes_nothing() -> None:
    model = nn.Linear(2, 2)
    with grad_sync(model, False):
        model(torch.ones(1, 2)).sum().backward()
    assert model.weight.grad is not None


# ------------------------------------------------------------------ one RNG helper


def test_capture_and_restore_replay_the_stream() -> None:
    torch.manual_seed(3)
    snapshot = capture_rng()
    first = torch.rand(5)
    restore_rng(snapshot)
    assert torch.equal(torch.rand(5), first)


def test_rand_context_replays_then_puts_the_outer_stream_back() -> None:
    torch.manual_seed(4)
    ctx = RandContext()
    drawn = torch.rand(3)
    following = torch.rand(3)
    torch.manual_seed(4)
    ctx = RandContext()
    drawn_again = torch.rand(3)
    with ctx:
        assert torch.equal(torch.rand(3), drawn)  # the replay
    assert torch.equal(drawn_again, drawn) and torch.equal(torch.rand(3), following)  # as if no replay happened


def test_rng_state_round_trips_through_a_state_dict() -> None:
    state = RNGState("cpu")
    saved = state.state_dict()
    want = torch.rand(4)
    torch.rand(10)
    state.load_state_dict(saved)
    assert torch.equal(torch.rand(4), want) and set(saved) == {"cpu"}


# ------------------------------------------------------------------ one cached-gradient engine


class TwoTowers(nn.Module):
    """Several outputs: two normalized embeddings with dropout, and a 0-dim temperature."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.3), nn.Linear(8, 4))
        self.b = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.3), nn.Linear(8, 4))
        self.logit_scale = nn.Parameter(torch.tensor([1.5]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return F.normalize(self.a(x), dim=-1), F.normalize(self.b(y), dim=-1), self.logit_scale.exp().reshape(())


def symmetric_infonce(zx: torch.Tensor, zy: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    logits = scale * zx @ zy.T
    labels = torch.arange(len(zx))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def test_gradcache_takes_a_model_with_several_outputs() -> None:
    """One model, three outputs (the 0-dim one a per-step temperature), chunks of 4 over 11 samples,
    dropout: the dense backward over the same chunks in the same RNG order, float64."""
    model = TwoTowers().double()
    gen = torch.Generator().manual_seed(1)
    x, y = (
        torch.randn(11, 6, generator=gen, dtype=torch.float64),
        torch.randn(11, 5, generator=gen, dtype=torch.float64),
    )
    torch.manual_seed(9)
    parts = [model(x[i : i + 4], y[i : i + 4]) for i in range(0, 11, 4)]
    want_loss = symmetric_infonce(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), parts[0][2])
    want_loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    torch.manual_seed(9)
    loss = GradCache([model], 4, symmetric_infonce, get_rep_fn=tuple).cache_step([x, y])
    assert abs(loss.item() - want_loss.item()) <= REL * want_loss.item()
    assert_close({n: p.grad for n, p in model.named_parameters()}, want)


def test_engine_names_a_cache_that_does_not_fit_the_replay() -> None:
    model = TwoTowers().double()
    x, y = torch.randn(3, 6, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    outputs, states = forward_no_grad(lambda c: model(*c), [(x, y)])
    with pytest.raises(
        GradCacheError, match=r"re-forward of chunk 0 gave a representation of shape \(3, 4\), the cache holds \(2, 4\)"
    ):
        forward_backward(lambda c: model(*c), [(x, y)], states, lambda i, out: [torch.zeros(2, 4), None, None])
    with pytest.raises(GradCacheError, match="re-forward of chunk 0 gave 3 outputs, the cache holds 1"):
        forward_backward(lambda c: model(*c), [(x, y)], states, lambda i, out: [outputs[0][0]])


# ------------------------------------------------------------------ the dataset interface


@pytest.mark.parametrize("name", ["fashion_mnist", "emoji"])
def test_bundled_datasets_follow_the_protocol(name: str) -> None:
    dataset = build_dataset(name, "test")
    assert isinstance(dataset, Dataset)
    assert isinstance(dataset, ZeroShotDataset) or not dataset.class_names  # zero-shot evaluation needs templates
    batch = dataset.__getitems__([0, 3])
    assert batch["index"].tolist() == [0, 3] and len(dataset) > 3


# ------------------------------------------------------------------ adding a step kind

USER_STEP = '''
    """A user's step kind: plain accumulation that also records each step's loss."""
    import dataclasses

    from titan_contrastive.models import get_model_spec, register_model
    from titan_contrastive.steps import AccumulateStep

    class TracedStep(AccumulateStep):
        trace = []

        def __call__(self, microbatches):
            loss = super().__call__(microbatches)
            TracedStep.trace.append((len(microbatches), loss))
            return loss

        def describe(self):
            return "traced step: " + super().describe()

    # the one line
    register_model(dataclasses.replace(get_model_spec("clip"), name="clip_traced", build_step=TracedStep.build))
'''


def test_a_new_step_kind_is_one_module_and_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A family-specific kind (ModelSpec.build_step), from the user's own module: the trainer runs
    it, logs its description, and its losses are what the run logs."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    (tmp_path / "user_steps.py").write_text(textwrap.dedent(USER_STEP))
    monkeypatch.syspath_prepend(str(tmp_path))
    caplog.set_level(logging.INFO, logger="titan_contrastive")
    trainer = make_trainer(
        str(tmp_path / "run"),
        "--job.custom_import=user_steps",
        "--model.name=clip_traced",
        "--metrics.log_freq=1",
        "--training.local_batch_size=4",
        "--training.global_batch_size=8",
        "--training.steps=2",
        "--eval.enable=false",
    )
    trainer.train()
    trainer.metrics.close()
    import user_steps

    logged = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert user_steps.TracedStep.trace == [(2, logged[0]), (2, logged[1])]
    assert "traced step: clip loss (InfoNCE, symmetric); negatives per contrastive problem: 4" in caplog.text


def test_a_contrastive_kind_is_chosen_by_its_registry_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CONTRASTIVE_STEPS maps ([loss] negatives, chunked) to a builder: replacing one entry changes
    what the trainer runs for that configuration, and nothing else."""
    calls = []

    class Recording(steps.AccumulateStep):
        def __call__(self, microbatches):
            calls.append(len(microbatches))
            return super().__call__(microbatches)

    monkeypatch.setitem(steps.CONTRASTIVE_STEPS, ("microbatch", False), Recording.build)
    trainer = make_trainer(
        str(tmp_path),
        "--training.local_batch_size=4",
        "--training.global_batch_size=12",
        "--training.steps=1",
        "--eval.enable=false",
    )
    assert type(trainer.gradient_step) is Recording
    trainer.train()
    trainer.metrics.close()
    assert calls == [3]
    chunked = make_trainer(
        str(tmp_path / "c"), "--gradcache.enabled=true", "--gradcache.chunk_sizes=2", "--eval.enable=false"
    )
    assert type(chunked.gradient_step) is steps.GradCacheStep
    chunked.metrics.close()
