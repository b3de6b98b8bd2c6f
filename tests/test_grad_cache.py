"""GradCache against a dense full-batch backward (float64, rel. err <= 1e-10).

The reference runs the same encoders on the same chunks in the same order from the same seed
(so dropout draws the same masks), concatenates the representations *with* their graphs and
backpropagates the loss once: the only difference from GradCache is the caching.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist_utils import run_distributed
from titan_contrastive.batching import BatchError, split_inputs
from titan_contrastive.grad_cache import GradCache, GradCacheError, Replay, cached
from titan_contrastive.grad_cache.inputs import get_rep

REL = 1e-10
B = 13  # chunk sizes below do not divide it


def info_nce(
    q: torch.Tensor, p: torch.Tensor, n: torch.Tensor | None = None, *, temperature: float = 0.1
) -> torch.Tensor:
    """DPR-style: query i against all positives (+ hard negatives); loss_fn(*reps, **kwargs)."""
    keys = p if n is None else torch.cat([p, n])
    logits = F.normalize(q, dim=-1) @ F.normalize(keys, dim=-1).T / temperature
    return F.cross_entropy(logits, torch.arange(len(q), device=q.device))


class Tower(nn.Module):
    """Dict or tensor inputs, dropout inside; returns a tensor, a tuple or an output object."""

    def __init__(self, d_in: int, out: str = "tensor") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, 12), nn.GELU(), nn.Dropout(0.25), nn.Linear(12, 6))
        self.out = out

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, flag: str = "") -> Any:
        rep = self.net(x if mask is None else x * mask)
        if self.out == "tuple":
            return rep, rep.sum()
        if self.out == "object":
            return Output(pooler_output=rep, hidden=rep * 2)
        return rep


@dataclass
class Output:
    pooler_output: torch.Tensor
    hidden: torch.Tensor


def towers(*kinds: str) -> list[Tower]:
    torch.manual_seed(0)
    return [Tower(8, kind).double() for kind in kinds]


def data(n: int = B, d: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def reference(
    models: list[nn.Module], inputs: list[Any], chunk_sizes: list[int], loss_kwargs: dict | None = None, seed: int = 5
) -> tuple[float, list[list[torch.Tensor]]]:
    """Dense: the same chunked forwards in the same RNG order, one loss, one backward."""
    copies: dict[int, nn.Module] = {}
    models = [copies.setdefault(id(m), copy.deepcopy(m)) for m in models]
    torch.manual_seed(seed)
    reps = []
    for model, x, size in zip(models, inputs, chunk_sizes):
        reps.append(torch.cat([get_rep(_call(model, c)) for c in split_inputs(x, size)]))
    loss = info_nce(*reps, **(loss_kwargs or {}))
    loss.backward()
    unique = list({id(m): m for m in models}.values())
    return loss.item(), [[p.grad.clone() for p in m.parameters()] for m in unique]


def _call(model: nn.Module, chunk: Any) -> Any:
    if isinstance(chunk, dict):
        return model(**chunk)
    if isinstance(chunk, (list, tuple)):
        return model(*chunk)
    return model(chunk)


def grads_of(models: list[nn.Module]) -> list[list[torch.Tensor]]:
    unique = list({id(m): m for m in models}.values())
    return [[p.grad for p in m.parameters()] for m in unique]


def assert_close(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> None:
    for gm, wm in zip(got, want, strict=True):
        for g, w in zip(gm, wm, strict=True):
            err = ((g - w).norm() / w.norm()).item()
            assert err <= REL, f"relative error {err:.2e}"


def run_case(models: list[nn.Module], inputs: list[Any], chunk_sizes: list[int], **loss_kwargs: Any) -> None:
    want_loss, want = reference(models, inputs, chunk_sizes, loss_kwargs)
    gc = GradCache(models, chunk_sizes, info_nce)
    torch.manual_seed(5)
    loss = gc.cache_step(*inputs, **loss_kwargs)
    assert abs(loss.item() - want_loss) <= REL * want_loss
    assert_close(grads_of(models), want)


def test_two_towers_tensor_inputs_uneven_chunks() -> None:
    q, p = towers("tensor", "tensor")
    run_case([q, p], [data(), data(seed=2)], [4, 5])


def test_one_tower_both_sides() -> None:
    """One model object passed twice (tied towers): its gradient collects both sides."""
    (m,) = towers("tensor")
    run_case([m, m], [data(), data(seed=2)], [3, 6])


def test_hard_negatives_and_loss_kwargs() -> None:
    q, p = towers("tensor", "tensor")
    run_case([q, p, p], [data(), data(seed=2), data(n=7, seed=3)], [5, 4, 3], temperature=0.05)


def test_dict_list_and_output_object_inputs() -> None:
    q, p = towers("object", "tuple")
    # a non-tensor entry goes to every chunk
    as_dict = {"x": data(), "mask": (data(seed=9) > 0).double(), "flag": "kept as is"}
    run_case([q, p], [as_dict, [data(seed=2), (data(seed=8) > 0).double()]], [2, 5])


def test_dropout_needs_the_rng_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    import titan_contrastive.grad_cache.engine as module  # the replay every cached-gradient path shares

    monkeypatch.setattr(module, "RandContext", contextlib.nullcontext)
    q, p = towers("tensor", "tensor")
    with pytest.raises(AssertionError, match="relative error"):
        run_case([q, p], [data(), data(seed=2)], [4, 5])


def test_functional_api_with_keyword_arguments() -> None:
    q, p = towers("tensor", "tensor")
    x, y = data(), data(seed=2)
    want_loss, want = reference([q, p], [x, y], [4, 5])

    @cached
    def encode(model: nn.Module, batch: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return model(batch) * scale

    torch.manual_seed(5)
    qs = [encode(q, c, scale=1.0) for c in x.split(4)]
    ps = [encode(p, c, scale=1.0) for c in y.split(5)]
    loss = info_nce(torch.cat([r for r, _ in qs]), torch.cat([r for r, _ in ps]))
    loss.backward()
    for rep, closure in qs + ps:
        closure(rep)
    assert abs(loss.item() - want_loss) <= REL * want_loss
    assert_close(grads_of([q, p]), want)


def test_clear_errors() -> None:
    q, p = towers("tensor", "tensor")
    with pytest.raises(GradCacheError, match=r"chunk_sizes\[1\]=0: must be an integer >= 1"):
        GradCache([q, p], [4, 0], info_nce)
    assert GradCacheError is BatchError  # one error type: a bad split and a bad GradCache argument alike
    with pytest.raises(BatchError, match="tensors disagree on the batch dimension .*'x'.*: 13.*'mask'.*: 12"):
        split_inputs({"x": data(), "mask": data(n=12)}, 4)
    with pytest.raises(GradCacheError, match="fp16=True needs a scaler"):
        GradCache([q, p], 4, info_nce, fp16=True)
    with pytest.raises(
        GradCacheError, match=r"cannot find a representation in the model output of type dict \(fields: \['logits'\]\)"
    ):
        GradCache([lambda x: {"logits": x}], 4, info_nce).forward_no_grad(lambda x: {"logits": x}, [data()])
    with pytest.raises(GradCacheError, match="2 inputs for 3 models"):
        GradCache([q, p, p], 4, info_nce).cache_step(data(), data())
    # was a raw torch.cat error
    with pytest.raises(GradCacheError, match=r"input 0 is an empty batch \(0 samples\)") as info:
        GradCache([q, p], 4, info_nce).cache_step(data(n=0), data(n=0))
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------ data parallel: DDP and FSDP2


class PairTower(nn.Module):
    """One model, two outputs (a CLIP-like model: both sides in one forward), dropout inside."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.p = towers("tensor", "tensor")
        self.calls = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        return self.q(x), self.p(y)


def pair_reference(
    model: PairTower, x: torch.Tensor, y: torch.Tensor, chunk: int, seed: int
) -> tuple[float, list[torch.Tensor]]:
    """Dense: the same chunks in the same RNG order, with their graphs, one loss, one backward."""
    model = copy.deepcopy(model)
    torch.manual_seed(seed)
    outs = [model(a, b) for a, b in zip(x.split(chunk), y.split(chunk))]
    loss = info_nce(torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs]))
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("chunk", [4, 13, 20])
def test_one_model_keeps_its_last_chunk_graph(chunk: int) -> None:
    """One model: pass 1 keeps the last chunk's graph, so k chunks take 2k - 1 forwards (k <= 1:
    one), and the loss and every gradient still equal the dense backward's (dropout on)."""
    model = PairTower()
    x, y = data(), data(seed=2)
    want_loss, want = pair_reference(model, x, y, chunk, seed=5)
    torch.manual_seed(5)
    loss = GradCache(
        [model],
        chunk,
        info_nce,
        split_input_fn=lambda pair, size: list(zip(pair[0].split(size), pair[1].split(size))),
        get_rep_fn=tuple,
    ).cache_step((x, y))
    chunks = -(-B // chunk)
    assert model.calls == 2 * chunks - 1
    assert abs(loss.item() - want_loss) <= REL * want_loss
    assert_close([[p.grad for p in model.parameters()]], [want])


class LockedPair(PairTower):
    """A PairTower whose first side is locked (no gradient, eval mode: no dropout draws) and which
    takes `replay`: in a re-forward it returns pass 1's output of that side instead of running it
    (what `components.freeze.locked_forward` does for the families)."""

    def __init__(self) -> None:
        super().__init__()
        self.q.requires_grad_(False).eval()
        self.locked_rows = 0
        self.replays: list[Replay | None] = []

    def forward(
        self, x: torch.Tensor, y: torch.Tensor, *, replay: Replay | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.replays.append(replay)
        if replay is None:
            self.locked_rows += len(x)
            with torch.no_grad():
                locked = self.q(x)
        else:
            locked = replay[0]
        return locked, self.p(y)


@pytest.mark.parametrize("replay", [True, False])
def test_replay_hands_the_re_forward_its_first_pass_outputs(replay: bool) -> None:
    """`replay=True`: each re-forward gets pass 1's outputs of its chunk as the keyword `replay` (a
    `Replay`, not a tuple: data-parallel wrappers rewrite tensors inside tuples), so the locked side
    runs once per sample; without it the model gets no `replay` and the locked side runs again.
    Either way the loss and the trained side's gradients equal the dense backward's (dropout on)."""
    model = LockedPair()
    x, y = data(), data(seed=2)
    dense = copy.deepcopy(model)
    torch.manual_seed(5)
    outs = [dense(a, b) for a, b in zip(x.split(4), y.split(4))]
    want_loss = info_nce(torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs]))
    want_loss.backward()
    torch.manual_seed(5)
    split = lambda pair, size: list(zip(pair[0].split(size), pair[1].split(size)))  # noqa: E731
    loss = GradCache([model], 4, info_nce, split_input_fn=split, get_rep_fn=tuple, replay=replay).cache_step((x, y))
    assert abs(loss.item() - want_loss.item()) <= REL * want_loss.item()
    assert_close([[p.grad for p in model.p.parameters()]], [[p.grad for p in dense.p.parameters()]])
    assert all(p.grad is None for p in model.q.parameters())
    first, again = model.replays[:4], model.replays[4:]  # 4 chunks; the last one's graph is kept, not re-run
    assert first == [None] * 4 and len(again) == 3
    if replay:
        assert model.locked_rows == B
        for i, got in enumerate(again):
            assert isinstance(got, Replay) and not isinstance(got, tuple) and len(got) == 2
            with torch.no_grad():
                assert torch.equal(got[0], model.q(x[4 * i : 4 * i + 4]))
    else:
        assert again == [None] * 3 and model.locked_rows == B + 12


def _dp_matches_dense(wrapper: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    q, p = towers("tensor", "tensor")
    x, y = data(n=2 * B), data(n=2 * B, seed=2)
    mine = slice(rank * B, (rank + 1) * B)
    # each rank's loss is over its own local batch; DDP / FSDP2 average the ranks' gradients
    refs = [
        reference([q, p], [x[r * B : (r + 1) * B], y[r * B : (r + 1) * B]], [4, 5], seed=5 + r) for r in range(world)
    ]
    want = [[sum(r[1][m][i] for r in refs) / world for i in range(len(refs[0][1][m]))] for m in range(2)]
    if wrapper == "ddp":
        models = [nn.parallel.DistributedDataParallel(q), nn.parallel.DistributedDataParallel(p)]
    else:
        from torch.distributed.fsdp import fully_shard

        models = [fully_shard(q), fully_shard(p)]
    torch.manual_seed(5 + rank)
    GradCache(models, [4, 5], info_nce).cache_step(x[mine], y[mine], no_sync_except_last=True)
    got = [[g.full_tensor() if hasattr(g, "full_tensor") else g for g in m] for m in grads_of([q, p])]
    assert_close(got, want)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_two_processes_no_sync_except_last_match_dense(wrapper: str) -> None:
    run_distributed(_dp_matches_dense, 2, wrapper)


def _dp_pair_matches_dense(wrapper: str) -> None:
    """One model on 2 ranks: the kept chunk's forward runs under no_sync (DDP decides in forward)
    and its backward first, the last re-forward syncs; chunks of 4 over 13 rows per rank."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = PairTower()
    x, y = data(n=2 * B), data(n=2 * B, seed=2)
    mine = slice(rank * B, (rank + 1) * B)
    refs = [pair_reference(model, x[r * B : (r + 1) * B], y[r * B : (r + 1) * B], 4, seed=5 + r) for r in range(world)]
    want = [sum(r[1][i] for r in refs) / world for i in range(len(refs[0][1]))]
    if wrapper == "ddp":
        wrapped: nn.Module = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        wrapped = fully_shard(model)
    torch.manual_seed(5 + rank)
    split = lambda pair, size: list(zip(pair[0].split(size), pair[1].split(size)))  # noqa: E731
    GradCache([wrapped], 4, info_nce, split_input_fn=split, get_rep_fn=tuple).cache_step(
        (x[mine], y[mine]), no_sync_except_last=True
    )
    assert model.calls == 2 * 4 - 1
    got = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in (p.grad for p in model.parameters())]
    assert_close([got], [want])


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_two_processes_one_model_kept_chunk_match_dense(wrapper: str) -> None:
    run_distributed(_dp_pair_matches_dense, 2, wrapper)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_fp16_scaler_on_cuda() -> None:  # pragma: no cover - CI has no GPU
    torch.manual_seed(0)
    q, p = Tower(8).cuda(), Tower(8).cuda()
    x, y = data().float().cuda(), data(seed=2).float().cuda()
    want_q = copy.deepcopy(q)
    want_p = copy.deepcopy(p)
    torch.manual_seed(5)
    # under float16 autocast like the GradCache run: CUDA's dropout draws its mask per dtype (a float32
    # reference sees other masks and other gradients altogether)
    with torch.autocast("cuda", dtype=torch.float16):
        reps = torch.cat([want_q(c) for c in x.split(4)]), torch.cat([want_p(c) for c in y.split(5)])
    info_nce(*(r.float() for r in reps)).backward()
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    torch.manual_seed(5)
    GradCache([q, p], [4, 5], info_nce, fp16=True, scaler=scaler).cache_step(x, y)
    scaler.unscale_(torch.optim.SGD(list(q.parameters()) + list(p.parameters()), lr=0.0))
    for got, want in zip(
        list(q.parameters()) + list(p.parameters()), list(want_q.parameters()) + list(want_p.parameters())
    ):
        assert torch.allclose(got.grad, want.grad, rtol=2e-2, atol=1e-3)


def test_bfloat16_autocast_on_a_plain_function_tracks_float32() -> None:
    """autocast_dtype works for a function "model" (no .parameters()), surrogate in float32."""
    q, p = (t.float() for t in towers("tensor", "tensor"))
    x, y = data().float(), data(seed=2).float()
    grads = []
    for dtype in (None, torch.bfloat16):
        for m in (q, p):
            m.zero_grad()
        torch.manual_seed(5)
        GradCache([lambda a: q(a), lambda b: p(b)], [4, 5], info_nce, autocast_dtype=dtype).cache_step(x, y)
        grads.append([t.grad.clone() for t in q.parameters()])
    for fp32, bf16 in zip(*grads):
        assert not torch.equal(fp32, bf16) and torch.allclose(fp32, bf16, rtol=5e-2, atol=5e-3)
