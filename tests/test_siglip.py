"""SigLIP's sigmoid loss, exact in every mode, against dense float64 references.

L = -(1/N) sum_i sum_j log sigmoid(z_ij (t <x_i, y_j> + b)), z = +1 on pairs, -1 elsewhere. The
references form the whole N x N logit matrix on one process and backpropagate once; the paths
under test are the microbatch loss (own rows against gathered columns), the streamed global
problem (one pass over chunk x N blocks, encoders re-forwarded through the cached-gradient
engine), the trainer in both negatives modes (GradCache chunks, fixed and learnable t' and b) and
`distributed_train_step` (dropout, RNG replay), on 1, 2 and 4 gloo processes under DDP and FSDP2,
with chunk sizes that divide nothing. Last, open_clip's own `SigLipLoss` (its loss.py, from the
open-clip-torch wheel) under DDP in each of its exchange modes must give the same loss and the same
parameters after one step.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist_utils import run_distributed
from tests.needs import require
from tests.test_distributed_clip import GradRecorder, _join
from tests.test_trainer import batch, full, make_trainer
from titan_contrastive.components.memory_probe import LargestTensor
from titan_contrastive.config import ConfigError
from titan_contrastive.distributed_clip import DistributedClipError, StreamingClipStep, distributed_train_step
from titan_contrastive.losses import MicrobatchLoss, Sigmoid

REL = 1e-10
N, MICRO, CHUNK = 24, 5, 7


def naive_sigmoid_loss(x: torch.Tensor, y: torch.Tensor, t: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The definition, term by term (the reference's reference)."""
    total = x.new_zeros(())
    for i in range(len(x)):
        for j in range(len(y)):
            z = 1.0 if i == j else -1.0
            total = total - F.logsigmoid(z * (t * (x[i] @ y[j]) + b))
    return total / len(x)


def test_dense_reference_is_the_definition() -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = (F.normalize(torch.randn(7, 4, generator=gen, dtype=torch.float64), dim=-1) for _ in range(2))
    t, b = torch.tensor(3.0, dtype=torch.float64), torch.tensor(-2.0, dtype=torch.float64)
    want = naive_sigmoid_loss(x, y, t, b)
    assert abs(Sigmoid().dense(x, y, t, b).item() - want.item()) <= REL * want.item()
    rows = (
        Sigmoid().rows(x[2:5], y, t, b, first_row=2, normalizer=7)
        + Sigmoid().rows(x[:2], y, t, b, normalizer=7)
        + Sigmoid().rows(x[5:], y, t, b, first_row=5, normalizer=7)
    )
    assert abs(rows.item() - want.item()) <= REL * want.item()  # row blocks with the diagonal offset add up


# ------------------------------------------------------------------ the trainer, clip/debug, float64


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else full(p.grad).detach().clone() for n, p in model.named_parameters()}


def _trainer_matches_dense(tmp: str, negatives: str, local: int, ga: int, extra: list[str]) -> None:
    """One train step of the trainer against the dense loss on one process: per accumulation step
    over all ranks' microbatches (negatives=microbatch), or over the whole global batch (global)."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = make_trainer(
        tmp,
        "--loss.name=siglip",
        f"--loss.negatives={negatives}",
        f"--training.local_batch_size={local}",
        f"--training.global_batch_size={local * ga * world}",
        "--loss.stream_chunk_size=5",
        *extra,
    )
    rank = dist.get_rank() if world > 1 else 0
    reference = trainer.spec.build_model(trainer.model_args).double()
    reference.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    steps = [batch(trainer, j * local * world, local * world) for j in range(ga)]
    out = trainer.train_step([{k: v[rank * local : (rank + 1) * local] for k, v in s.items()} for s in steps])
    trainer.metrics.close()

    problems = [{k: torch.cat([s[k] for s in steps]) for k in steps[0]}] if negatives == "global" else steps
    want = 0.0
    for p in problems:
        loss = Sigmoid().dense(*reference(p["image"].double(), p["text"])) / len(problems)
        loss.backward()
        want += loss.item()
    assert abs(out["loss"] - want) <= REL * want
    got, ref = grads(trainer.model), grads(reference)
    assert got.keys() == ref.keys()
    for name, w in ref.items():
        if w is None:  # a fixed temperature or bias: no gradient anywhere
            assert got[name] is None, name
            continue
        err = ((got[name] - w).norm() / w.norm()).item()
        assert err <= REL, f"{name}: relative error {err:.2e}"
    assert ref["logit_bias"] is None or ref["logit_bias"].abs().item() > 1e-6  # the bias gradient is exercised


FIXED = [
    "--loss.learn_logit_scale=false",
    "--loss.learn_logit_bias=false",
    "--loss.init_logit_scale=1.5",
    "--loss.init_logit_bias=-3",
]
GRADCACHE = ["--gradcache.enabled=true", "--gradcache.chunk_sizes=3"]
DDP = ["--parallelism.data_parallel_replicate_degree=-1", "--parallelism.data_parallel_shard_degree=1"]


@pytest.mark.parametrize(
    "negatives, local, ga, extra",
    [
        ("microbatch", 5, 2, []),
        ("microbatch", 5, 2, GRADCACHE),
        ("microbatch", 4, 2, FIXED),
        ("global", 4, 3, []),
        ("global", 5, 2, GRADCACHE),
        ("global", 4, 2, FIXED),
    ],
    ids=["micro", "micro-gradcache", "micro-fixed", "global", "global-gradcache", "global-fixed"],
)
def test_trainer_single_process(tmp_path: Path, negatives: str, local: int, ga: int, extra: list[str]) -> None:
    _trainer_matches_dense(str(tmp_path), negatives, local, ga, extra)


@pytest.mark.parametrize(
    "world, negatives, extra",
    [
        (2, "microbatch", DDP),
        (2, "global", FIXED),
        pytest.param(4, "microbatch", GRADCACHE, marks=pytest.mark.slow),  # the default suite's time
        (4, "global", [*DDP, *GRADCACHE]),
    ],
    ids=["2-ddp-micro", "2-fsdp-global-fixed", "4-fsdp-micro-gradcache", "4-ddp-global-gradcache"],
)
def test_trainer_data_parallel(tmp_path: Path, world: int, negatives: str, extra: list[str]) -> None:
    run_distributed(_trainer_matches_dense, world, str(tmp_path), negatives, 3, 2, extra)


OTHER_FAMILIES = {  # SigLiT (a locked pretrained text tower, SigLIP's paper) and the packed-patch toy VLM
    "lit": ["--model.name=lit", "--model.flavor=minilm_debug", "--data.dataset=emoji", "--model.freeze=text"],
    "vlm": ["--model.name=vlm", "--data.dataset=emoji", "--data.image_sizes=16,24"],
}


@pytest.mark.parametrize("negatives", ["microbatch", "global"])
@pytest.mark.parametrize("family", list(OTHER_FAMILIES))
def test_lit_and_vlm_learn_the_bias(tmp_path: Path, family: str, negatives: str) -> None:
    """Two accumulation steps of 4 under GradCache chunks of 3 against the definition over each step's batch
    (microbatch) or the whole 8 (global), every parameter's gradient, the bias's included."""
    if family == "lit":
        require("hf")
    trainer = make_trainer(
        str(tmp_path), "--loss.name=siglip", f"--loss.negatives={negatives}", "--training.local_batch_size=4",
        "--training.global_batch_size=8", "--loss.stream_chunk_size=3", "--gradcache.enabled=true",
        "--gradcache.chunk_sizes=3", "--eval.enable=false", *OTHER_FAMILIES[family],
    )  # fmt: skip
    assert trainer.model_args.num_params() == sum(p.numel() for p in trainer.model.parameters())
    reference = trainer.spec.build_model(trainer.model_args).double().eval()
    reference.load_state_dict(trainer.model.state_dict())
    trainer.model.eval()  # MiniLM's dropout (its replay is tested elsewhere)
    steps = [batch(trainer, 0, 4), batch(trainer, 4, 4)]
    out = trainer.train_step(steps)
    trainer.metrics.close()
    problems = [batch(trainer, 0, 8)] if negatives == "global" else steps
    want = 0.0
    for p in problems:
        inputs = [p[k].double() if p[k].is_floating_point() else p[k] for k in trainer.spec.input_keys]
        x, y, t, b = reference(*inputs)
        loss = naive_sigmoid_loss(x, y, t, b) / len(problems)
        loss.backward()
        want += loss.item()
    assert abs(out["loss"] - want) <= REL * want
    got, ref = grads(trainer.model), grads(reference)
    assert ref["logit_bias"].abs().item() > 1e-6
    for name, w in ref.items():
        if got[name] is None:  # the locked tower (the reference's is not locked)
            assert family == "lit" and name.startswith("text."), name
            continue
        err = ((got[name] - w).norm() / w.norm()).item()
        assert err <= REL, f"{name}: relative error {err:.2e}"


def test_optional_numbers_parse_from_cli_and_toml(tmp_path: Path) -> None:
    from titan_contrastive.config import parse_args

    assert parse_args([]).loss.init_logit_scale is None
    assert parse_args(["--loss.init_logit_scale=1.5"]).loss.init_logit_scale == 1.5
    assert parse_args(["--loss.init_logit_bias", "-3"]).loss.init_logit_bias == -3.0
    assert parse_args(["--loss.init_logit_bias=2", "--loss.init_logit_bias=none"]).loss.init_logit_bias is None
    (tmp_path / "c.toml").write_text('[loss]\nname = "siglip"\ninit_logit_bias = -7.5\n')
    assert parse_args([f"--job.config_file={tmp_path / 'c.toml'}"]).loss.init_logit_bias == -7.5
    with pytest.raises(ConfigError, match=r"loss.init_logit_scale='warm' is invalid: expected a number"):
        parse_args(["--loss.init_logit_scale=warm"])


def test_siglip_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"^loss.init_logit_bias=-5.0: loss.name='clip' has no bias; use --loss.name=siglip"
    ):
        make_trainer(str(tmp_path), "--loss.init_logit_bias=-5")
    with pytest.raises(ConfigError, match=r"^loss.name='siglip': the vae family trains with 'pixel'"):
        make_trainer(str(tmp_path), "--model.name=vae", "--data.dataset=emoji", "--loss.name=siglip")
    trainer = make_trainer(str(tmp_path), "--loss.name=siglip")  # SigLIP's initial values
    assert trainer.model.logit_scale.item() == pytest.approx(math.log(10)) and trainer.model.logit_bias.item() == -10.0
    trainer.metrics.close()
    vlm = ["--model.name=vlm", "--data.dataset=emoji"]  # the temperature keys reach every contrastive family
    with pytest.raises(ConfigError, match=r"^loss.init_logit_bias=-1.0: loss.name='clip' has no bias"):
        make_trainer(str(tmp_path), *vlm, "--loss.init_logit_bias=-1")
    trainer = make_trainer(str(tmp_path), *vlm, "--loss.init_logit_scale=1.25", "--loss.learn_logit_scale=false")
    assert trainer.model.logit_scale.item() == 1.25 and not trainer.model.logit_scale.requires_grad
    trainer.metrics.close()


# ------------------------------------------------------------------ distributed_train_step, dropout


class SigEncoder(nn.Module):
    """Two encoders with dropout; forward returns (zx, zy) or (zx, zy, exp(t'), b)."""

    def __init__(self, learnable: bool) -> None:
        super().__init__()
        self.encoder_x = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.3), nn.Linear(16, 6))
        self.encoder_y = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 6))
        self.learnable = learnable
        if learnable:
            self.logit_scale = nn.Parameter(torch.tensor([math.log(4.0)]))
            self.logit_bias = nn.Parameter(torch.tensor([-2.5]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        zx, zy = F.normalize(self.encoder_x(x), dim=-1), F.normalize(self.encoder_y(y), dim=-1)
        return (zx, zy, self.logit_scale.exp(), self.logit_bias) if self.learnable else (zx, zy)


TAU, BIAS = 0.25, -2.5


def step_data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(N, 8, generator=gen, dtype=torch.float64), torch.randn(N, 5, generator=gen, dtype=torch.float64)


def dense_step_reference(model: SigEncoder, world: int) -> tuple[float, list[torch.Tensor]]:
    """Dense loss over all N; embeddings from each rank's microbatches in the step's RNG order."""
    model = copy.deepcopy(model)
    x, y = step_data()
    local, zx, zy = N // world, [], []
    for rank in range(world):
        torch.manual_seed(100 + rank)
        for i in range(rank * local, (rank + 1) * local, MICRO):
            end = min(i + MICRO, (rank + 1) * local)
            zx_i, zy_i, *_ = model(x[i:end], y[i:end])
            zx.append(zx_i)
            zy.append(zy_i)
    if model.learnable:
        t, b = model.logit_scale.exp(), model.logit_bias
    else:
        t, b = torch.tensor(1 / TAU, dtype=torch.float64), torch.tensor(BIAS, dtype=torch.float64)
    loss = Sigmoid().dense(torch.cat(zx), torch.cat(zy), t, b)
    loss.backward()
    return loss.item(), [p.grad for p in model.parameters()]


def _step_matches_dense(learnable: bool, wrapper: str) -> None:
    import torch.distributed as dist

    _join()
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    model = SigEncoder(learnable).double()
    want_loss, want = dense_step_reference(model, world)
    if wrapper == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif wrapper == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.encoder_x)
        fully_shard(model.encoder_y)
        fully_shard(model)
    recorder = GradRecorder(model.parameters())
    x, y = step_data()
    mine = slice(rank * N // world, (rank + 1) * N // world)
    torch.manual_seed(100 + rank)
    config = {
        "GLOBAL_BATCH_SIZE": N,
        "MICRO_BATCH_SIZE": MICRO,
        "STREAM_CHUNK_SIZE": CHUNK,
        "LOSS": "siglip",
        "TAU": None if learnable else TAU,
        "BIAS": None if learnable else BIAS,
    }
    loss = distributed_train_step(model, recorder, x[mine], y[mine], config)
    assert abs(loss - want_loss) <= REL * want_loss, (loss, want_loss)
    assert len(recorder.grads) == len(want)
    for i, (g, w) in enumerate(zip(recorder.grads, want)):
        err = ((g - w).norm() / w.norm()).item()
        assert err <= REL, f"parameter {i} {tuple(w.shape)}: relative error {err:.2e}"


@pytest.mark.parametrize("learnable", [False, True], ids=["fixed", "learnable"])
def test_distributed_train_step_single_process(learnable: bool) -> None:
    _step_matches_dense(learnable, "none")


@pytest.mark.parametrize(
    "world, wrapper, learnable", [(2, "ddp", True), (2, "fsdp", False), (4, "fsdp", True), (4, "ddp", False)]
)
def test_distributed_train_step_data_parallel(world: int, wrapper: str, learnable: bool) -> None:
    run_distributed(_step_matches_dense, world, learnable, wrapper)


def test_without_rng_replay_dropout_breaks_exactness(monkeypatch: pytest.MonkeyPatch) -> None:
    import contextlib

    import titan_contrastive.grad_cache.engine as engine

    monkeypatch.setattr(engine, "RandContext", contextlib.nullcontext)
    with pytest.raises(AssertionError, match="relative error"):
        _step_matches_dense(True, "none")


def test_bad_siglip_config_is_one_line() -> None:
    model = SigEncoder(False).double()
    x, y = step_data()
    base = {"GLOBAL_BATCH_SIZE": N, "MICRO_BATCH_SIZE": MICRO, "STREAM_CHUNK_SIZE": CHUNK, "TAU": TAU}
    with pytest.raises(
        DistributedClipError,
        match=r"^no bias: siglip loss \(sigmoid\) needs logit_bias as the model's fourth output, or a fixed BIAS",
    ):
        distributed_train_step(model, GradRecorder(model.parameters()), x, y, {**base, "LOSS": "siglip", "BIAS": None})
    with pytest.raises(
        DistributedClipError, match=r"^config\['BIAS'\]=-2: clip loss \(InfoNCE, symmetric\) has no bias$"
    ):
        distributed_train_step(model, GradRecorder(model.parameters()), x, y, {**base, "BIAS": -2})
    with pytest.raises(
        DistributedClipError, match=r"^config\['LOSS'\]='sigmoid' is not an objective; valid: clip, pairwise, siglip$"
    ):
        distributed_train_step(model, GradRecorder(model.parameters()), x, y, {**base, "LOSS": "sigmoid", "BIAS": -2.0})


# ------------------------------------------------------------------ memory: nothing above chunk x N


def test_global_mode_never_allocates_more_than_chunk_by_n() -> None:
    n, d, chunk, micro = 240, 4, 8, 60
    gen = torch.Generator().manual_seed(1)
    zx0 = F.normalize(torch.randn(n, d, generator=gen, dtype=torch.float64), dim=-1).requires_grad_()
    zy0 = F.normalize(torch.randn(n, d, generator=gen, dtype=torch.float64), dim=-1).requires_grad_()

    def encode(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        return zx0[rows] * 1.0, zy0[rows] * 1.0  # the embeddings are the "parameters"

    step = StreamingClipStep(stream_chunk_size=chunk, fixed_scale=1 / TAU, objective=Sigmoid(), fixed_bias=BIAS)
    with LargestTensor() as probe:
        loss = step(encode, [slice(i, i + micro) for i in range(0, n, micro)])
    assert probe.largest <= chunk * n < micro * n, probe.largest
    got = (zx0.grad.clone(), zy0.grad.clone())
    zx0.grad = zy0.grad = None
    with LargestTensor() as dense_probe:  # control: the dense loss does allocate N x N
        want = Sigmoid().dense(
            zx0, zy0, torch.tensor(1 / TAU, dtype=torch.float64), torch.tensor(BIAS, dtype=torch.float64)
        )
        want.backward()
    assert dense_probe.largest >= n * n
    assert abs(loss.item() - want.item()) <= REL * want.item()
    for g, w in zip(got, (zx0.grad, zy0.grad)):
        assert ((g - w).norm() / w.norm()).item() <= REL


# ------------------------------------------------------------------ open_clip's own SigLipLoss


def open_clip_loss_module():  # noqa: ANN201 - the module
    """open_clip's loss.py from the installed open-clip-torch wheel, loaded on its own (the package
    itself imports torchvision, which does not import beside this torch on CPU; loss.py imports
    only torch)."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("open-clip-torch is not installed (scripts/setup.sh installs it with --no-deps)")
    path = Path(next(iter(spec.submodule_search_locations))) / "loss.py"
    module_spec = importlib.util.spec_from_file_location("open_clip_loss", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def _matches_open_clip(dist_impl: str) -> None:
    """One SGD step of the same model on the same data: open_clip's SigLipLoss (DDP averages the
    ranks' losses) against ours, as the microbatch loss and as distributed_train_step."""
    import torch.distributed as dist

    _join()
    rank, world = dist.get_rank(), dist.get_world_size()
    open_clip = open_clip_loss_module()
    x, y = step_data()
    mine = slice(rank * N // world, (rank + 1) * N // world)
    results = {}
    for name in ("open_clip", "ours_microbatch", "ours_global"):
        torch.manual_seed(0)
        # eval: no dropout across the three
        model = nn.parallel.DistributedDataParallel(SigEncoder(True).double().eval())
        sgd = torch.optim.SGD(model.parameters(), lr=0.5)
        if name == "ours_global":
            loss = distributed_train_step(
                model,
                sgd,
                x[mine],
                y[mine],
                {
                    "GLOBAL_BATCH_SIZE": N,
                    "MICRO_BATCH_SIZE": MICRO,
                    "STREAM_CHUNK_SIZE": CHUNK,
                    "TAU": None,
                    "LOSS": "siglip",
                },
            )
        else:
            fn = (
                open_clip.SigLipLoss(rank=rank, world_size=world, dist_impl=dist_impl)
                if name == "open_clip"
                else MicrobatchLoss(Sigmoid(), dist.group.WORLD)
            )
            value = fn(*model(x[mine], y[mine]))
            value.backward()
            sgd.step()
            mean = value.detach().clone()
            dist.all_reduce(mean)
            loss = (mean / world).item() if name == "open_clip" else value.item()
        results[name] = (loss, [p.detach().clone() for p in model.parameters()])
    want_loss, want_params = results["open_clip"]
    for name in ("ours_microbatch", "ours_global"):
        loss, params = results[name]
        assert abs(loss - want_loss) <= REL * abs(want_loss), (name, loss, want_loss)
        for p, w in zip(params, want_params):
            assert ((p - w).norm() / w.norm()).item() <= REL, name


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dist_impl", ["bidir", "shift", "reduce", "gather"])
def test_same_step_as_open_clip_siglip(world: int, dist_impl: str) -> None:
    open_clip_loss_module()  # skip cleanly when the wheel is missing
    run_distributed(_matches_open_clip, world, dist_impl)
