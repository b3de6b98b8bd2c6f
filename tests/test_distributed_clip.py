"""The streaming distributed CLIP step (seed 001) against a plain dense float64 reference.

The reference is the symmetric InfoNCE over all N pairs with autograd through one [N, N]
logit matrix, on one process. Dropout is on in both encoders; the reference draws the same
masks by running each rank's microbatches in the same order from the same seed, so the only
difference left is the algorithm. Sizes are chosen so that neither MICRO_BATCH_SIZE nor
STREAM_CHUNK_SIZE divides the local batch.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist_utils import run_distributed
from titan_contrastive.components.memory_probe import LargestTensor, PeakMemory
from titan_contrastive.distributed_clip import DistributedClipError, StreamingClipStep, distributed_train_step
from titan_contrastive.losses import InfoNCE
from titan_contrastive.losses.fused import loss_dtype

N, MICRO, CHUNK, TAU = 24, 5, 7, 0.1
REL = 1e-10


class DualEncoder(nn.Module):
    """The seed's example model: encoder_x / encoder_y, normalized outputs; dropout in both."""

    def __init__(self, learnable: bool, scale_from_forward: bool = False) -> None:
        super().__init__()
        self.encoder_x = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.3), nn.Linear(16, 6))
        self.encoder_y = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 6))
        self.logit_scale = nn.Parameter(torch.tensor([2.3])) if learnable else None
        self.scale_from_forward = scale_from_forward
        self.calls = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.calls += 1
        zx, zy = F.normalize(self.encoder_x(x), dim=-1), F.normalize(self.encoder_y(y), dim=-1)
        if self.scale_from_forward:
            return zx, zy, None if self.logit_scale is None else self.logit_scale.exp()
        return zx, zy


class GradRecorder(torch.optim.Optimizer):
    """An 'optimizer' whose step stores the gradients (full tensors, FSDP shards gathered)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {})
        self.grads: list[torch.Tensor] = []

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        g = [p.grad for group in self.param_groups for p in group["params"]]
        self.grads = [x.full_tensor() if hasattr(x, "full_tensor") else x.clone() for x in g]


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(N, 8, generator=gen, dtype=torch.float64), torch.randn(N, 5, generator=gen, dtype=torch.float64)


def make_model(learnable: bool, scale_from_forward: bool = False) -> DualEncoder:
    torch.manual_seed(0)
    return DualEncoder(learnable, scale_from_forward).double()


def dense_reference(model: DualEncoder, world: int, learnable: bool) -> tuple[float, list[torch.Tensor]]:
    """Dense loss over all N, embeddings from each rank's microbatches in the step's RNG order."""
    model = copy.deepcopy(model)
    x, y = data()
    local = N // world
    zx, zy = [], []
    for rank in range(world):
        torch.manual_seed(100 + rank)
        for i in range(rank * local, (rank + 1) * local, MICRO):
            end = min(i + MICRO, (rank + 1) * local)
            out = model(x[i:end], y[i:end])
            zx.append(out[0])
            zy.append(out[1])
    scale = model.logit_scale.exp() if learnable else torch.tensor(1 / TAU, dtype=torch.float64)
    loss = InfoNCE().dense(torch.cat(zx), torch.cat(zy), scale)
    loss.backward()
    return loss.item(), [p.grad for p in model.parameters()]


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor], rel: float = REL) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        err = ((g - w).norm() / w.norm()).item()
        assert err <= rel, f"parameter {i} {tuple(w.shape)}: relative error {err:.2e}"


def _join() -> None:
    """Join the gloo group that run_distributed's environment describes (what torchrun sets)."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")


def _step_matches_dense(learnable: bool, wrapper: str) -> None:
    import torch.distributed as dist

    _join()
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = make_model(learnable, scale_from_forward=wrapper == "fsdp")
    want_loss, want_grads = dense_reference(model, world, learnable)
    inner = model
    if wrapper == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif wrapper == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.encoder_x)
        fully_shard(model.encoder_y)
        fully_shard(model)
    recorder = GradRecorder(model.parameters())
    x, y = data()
    local = slice(rank * N // world, (rank + 1) * N // world)
    torch.manual_seed(100 + rank)
    config = {
        "GLOBAL_BATCH_SIZE": N,
        "MICRO_BATCH_SIZE": MICRO,
        "STREAM_CHUNK_SIZE": CHUNK,
        "TAU": None if learnable else TAU,
    }
    loss = distributed_train_step(model, recorder, x[local], y[local], config)
    assert abs(loss - want_loss) <= REL * want_loss, (loss, want_loss)
    assert_close(recorder.grads, want_grads)
    microbatches = -(-(N // world) // MICRO)
    assert inner.calls == 2 * microbatches - 1  # the last microbatch's pass-A graph is kept, not re-run


@pytest.mark.parametrize("learnable", [False, True], ids=["fixed_tau", "learnable_scale"])
def test_single_process_unwrapped(learnable: bool) -> None:
    _step_matches_dense(learnable, "none")


@pytest.mark.parametrize("world, wrapper", [(2, "ddp"), (4, "ddp"), (2, "fsdp"), (4, "fsdp")])
@pytest.mark.parametrize("learnable", [False, True], ids=["fixed_tau", "learnable_scale"])
def test_distributed_matches_dense(world: int, wrapper: str, learnable: bool) -> None:
    run_distributed(_step_matches_dense, world, learnable, wrapper)


def test_without_rng_replay_dropout_breaks_exactness(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seed has no replay; with dropout its re-forward differs. This guards the replay."""
    import contextlib

    import titan_contrastive.grad_cache.engine as module  # the replay the streaming step shares with GradCache

    monkeypatch.setattr(module, "RandContext", contextlib.nullcontext)
    with pytest.raises(AssertionError, match="relative error"):
        _step_matches_dense(True, "none")


def test_logit_scale_counted_once_not_per_microbatch() -> None:
    """Against open_clip's accum-freq behaviour: the temperature gradient is the dense one,
    not k times it (k = 5 microbatches here)."""
    model = make_model(True)
    _, want = dense_reference(model, 1, True)
    recorder = GradRecorder(model.parameters())
    x, y = data()
    torch.manual_seed(100)
    distributed_train_step(
        model,
        recorder,
        x,
        y,
        {"GLOBAL_BATCH_SIZE": N, "MICRO_BATCH_SIZE": MICRO, "STREAM_CHUNK_SIZE": CHUNK, "TAU": None},
    )
    index = [name for name, _ in model.named_parameters()].index("logit_scale")
    got_scale, want_scale = recorder.grads[index], want[index]
    assert abs(want_scale.item()) > 1e-3
    assert torch.allclose(got_scale, want_scale, rtol=REL, atol=0)


# ------------------------------------------------------------------ memory: no N x N, no B x N


def test_never_allocates_more_than_chunk_by_n() -> None:
    n, d, chunk, micro = 240, 4, 8, 60
    gen = torch.Generator().manual_seed(1)
    zx0 = F.normalize(torch.randn(n, d, generator=gen, dtype=torch.float64), dim=-1).requires_grad_()
    zy0 = F.normalize(torch.randn(n, d, generator=gen, dtype=torch.float64), dim=-1).requires_grad_()

    def encode(rows: slice) -> tuple[torch.Tensor, torch.Tensor, None]:
        return zx0[rows] * 1.0, zy0[rows] * 1.0, None  # the embeddings are the "parameters"

    step = StreamingClipStep(stream_chunk_size=chunk, fixed_scale=1 / TAU)
    with LargestTensor() as probe:
        loss = step(encode, [slice(i, i + micro) for i in range(0, n, micro)])
    assert probe.largest <= chunk * n < micro * n, probe.largest  # O(chunk * N), never B x N or N x N

    got = (zx0.grad.clone(), zy0.grad.clone())
    zx0.grad = zy0.grad = None
    with LargestTensor() as dense_probe:  # control: the dense loss does allocate N x N
        want = InfoNCE().dense(zx0, zy0, torch.tensor(1 / TAU, dtype=torch.float64))
        want.backward()
    assert dense_probe.largest >= n * n
    assert abs(loss.item() - want.item()) <= REL * want.item()
    assert_close(list(got), [zx0.grad, zy0.grad])


@pytest.mark.parametrize("micro", [240, 70])
def test_step_holds_a_few_copies_of_the_embeddings(micro: int) -> None:
    """Besides O(chunk x N) blocks, the step holds the embeddings (the encode's outputs), their
    gradients (float32 accumulators, then the outputs' gradients) and temporaries of a few rows:
    at most 6 x N x d floats at any time (11 before the cache was scaled in place, the single
    microbatch no longer copied and the surrogate's backward written in the outputs' dtype)."""
    n, d, chunk = 240, 64, 8
    gen = torch.Generator().manual_seed(1)
    zx0 = F.normalize(torch.randn(n, d, generator=gen), dim=-1).requires_grad_()
    zy0 = F.normalize(torch.randn(n, d, generator=gen), dim=-1).requires_grad_()

    def encode(rows: slice) -> tuple[torch.Tensor, torch.Tensor, None]:
        return zx0[rows] * 1.0, zy0[rows] * 1.0, None

    step = StreamingClipStep(stream_chunk_size=chunk, fixed_scale=1 / TAU, grad_average_factor=2)
    microbatches = [slice(i, i + micro) for i in range(0, n, micro)]
    step(encode, microbatches)  # the first call also checks the normalization
    zx0.grad = zy0.grad = None
    with PeakMemory(torch.device("cpu")) as probe:
        step(encode, microbatches)
    assert probe.peak <= 6 * n * d * 4, probe.peak / (n * d * 4)
    want = torch.autograd.grad(
        InfoNCE().dense(zx0, zy0, torch.tensor(1 / TAU)), [zx0, zy0]
    )  # the factor 2 is the data-parallel average's: the step leaves 2x the gradient for it to halve
    assert_close([zx0.grad / 2, zy0.grad / 2], list(want), rel=1e-5)


# ------------------------------------------------------------------ bad input: one clear line each


def good_config(**changes: Any) -> dict[str, Any]:
    return {"GLOBAL_BATCH_SIZE": N, "MICRO_BATCH_SIZE": MICRO, "STREAM_CHUNK_SIZE": CHUNK, "TAU": TAU, **changes}


@pytest.mark.parametrize(
    "change, x_rows, y_rows, message",
    [
        ({"STREAM_CHUNK_SIZE": 0}, N, N, r"config\['STREAM_CHUNK_SIZE'\]=0: must be an integer >= 1"),
        ({"MICRO_BATCH_SIZE": -2}, N, N, r"config\['MICRO_BATCH_SIZE'\]=-2: must be an integer >= 1"),
        ({"TAU": 0.0}, N, N, r"config\['TAU'\]=0.0: must be a finite number > 0"),
        ({"TAU": float("inf")}, N, N, r"config\['TAU'\]=inf: must be a finite number > 0"),  # was reported as TAU=0.0
        ({"TAU": float("nan")}, N, N, r"config\['TAU'\]=nan: must be a finite number > 0"),
        # was accepted
        ({"MAX_LOGIT_SCALE": -1.0}, N, N, r"config\['MAX_LOGIT_SCALE'\]=-1.0: must be a finite number > 0"),
        ({"MAX_LOGIT_SCALE": "100"}, N, N, r"config\['MAX_LOGIT_SCALE'\]='100': must be a finite number > 0"),
        ({"GLOBAL_BATCH_SIZE": 30}, N, N, r"local batch is 24 but GLOBAL_BATCH_SIZE / WORLD_SIZE = 30 / 1 = 30"),
        ({}, N, N - 1, r"local_x has 24 samples but local_y has 23"),
        ({"TAU": None}, N, N, r"no temperature: the model has no `logit_scale` and TAU is not set"),
        ({"KERNEL": "fast"}, N, N, r"config\['KERNEL'\]='fast': choose one of auto, pytorch, triton, triton_exact"),
    ],
)
def test_bad_input_is_one_clear_line(change: dict, x_rows: int, y_rows: int, message: str) -> None:
    model = make_model(False)
    x, y = data()
    with pytest.raises(DistributedClipError, match=message) as info:
        distributed_train_step(
            model, torch.optim.SGD(model.parameters(), lr=0.1), x[:x_rows], y[:y_rows], good_config(**change)
        )
    assert "\n" not in str(info.value)


def test_missing_key_and_unnormalized_embeddings() -> None:
    model = make_model(False)
    x, y = data()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(DistributedClipError, match="config lacks STREAM_CHUNK_SIZE"):
        distributed_train_step(model, sgd, x, y, {k: v for k, v in good_config().items() if k != "STREAM_CHUNK_SIZE"})
    model.forward = lambda a, b: (model.encoder_x(a), F.normalize(model.encoder_y(b), dim=-1))  # forgot to normalize
    with pytest.raises(DistributedClipError, match=r"z_x is not L2-normalized .* z = torch.nn.functional.normalize"):
        distributed_train_step(model, sgd, x, y, good_config())


def test_auto_reads_float32_embeddings_in_the_autocast_dtype() -> None:
    """Only "auto" under bf16 / fp16 mixed precision rounds float32 embeddings to the compute dtype
    (as autocast does for the dense loss's matmul); explicit kernels and float64 keep theirs."""
    bf16, f32, f64 = torch.bfloat16, torch.float32, torch.float64
    assert loss_dtype("auto", f32, bf16) == bf16 and loss_dtype("auto", f32, torch.float16) == torch.float16
    assert (
        loss_dtype("auto", f32, f32) == f32
        and loss_dtype("auto", f32, None) == f32
        and loss_dtype("auto", f64, bf16) == f64
    )
    assert loss_dtype("triton_exact", f32, bf16) == f32 and loss_dtype("pytorch", f32, bf16) == f32


def _world_errors() -> None:
    _join()
    model = make_model(False)
    x, y = data()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(DistributedClipError, match="not DDP- or FSDP2-wrapped but WORLD_SIZE=2"):
        distributed_train_step(model, sgd, x[:12], y[:12], good_config())
    ddp = nn.parallel.DistributedDataParallel(model)
    with pytest.raises(DistributedClipError, match="GLOBAL_BATCH_SIZE=25 is not divisible by WORLD_SIZE=2"):
        distributed_train_step(ddp, sgd, x[:12], y[:12], good_config(GLOBAL_BATCH_SIZE=25))
    with pytest.raises(
        DistributedClipError, match=r"local batch is 24 but GLOBAL_BATCH_SIZE / WORLD_SIZE = 24 / 2 = 12"
    ):
        distributed_train_step(ddp, sgd, x, y, good_config())


def test_world_size_errors() -> None:
    run_distributed(_world_errors, 2)
