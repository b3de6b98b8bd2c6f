"""The fused Triton kernels of the streaming loss against dense float64 references.

Compiled on CUDA when there is a GPU, else through Triton's interpreter (TRITON_INTERPRET=1, set
by conftest.py before anything imports triton), so CI on CPU checks the kernels' arithmetic and
masking; their speed is a GPU benchmark (benchmarks/loss_bench.py). Skipped without triton.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not 1 (tests/conftest.py sets it)", allow_module_level=True)

from tests.dist_utils import run_distributed  # noqa: E402
from tests.test_distributed_clip import GradRecorder  # noqa: E402
from tests.test_streaming_loss import loss_from_lse  # noqa: E402
from titan_contrastive.distributed_clip import StreamingClipStep, distributed_train_step  # noqa: E402
from titan_contrastive.kernels import streaming_triton  # noqa: E402
from titan_contrastive.kernels.streaming_triton import row_col_lse, sigmoid_weights, softmax_weights  # noqa: E402
from titan_contrastive.losses import (  # noqa: E402
    InfoNCE,
    Sigmoid,
    fused,  # noqa: E402
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROOT = Path(__file__).resolve().parent.parent
DTYPES = [(torch.float32, "triton_exact", 1e-5), (torch.bfloat16, "triton", 1e-2)]
DTYPE_IDS = ["fp32-exact", "bf16"]


def wide(d: int) -> object:
    """A wide embedding: on a GPU its own tile configs; under the interpreter the same 32-wide
    d-slices as 256, only more of them (the slow marker, for the default suite's time)."""
    return d if torch.cuda.is_available() else pytest.param(d, marks=pytest.mark.slow)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double().cpu() - want.cpu()).norm() / want.cpu().norm()).item()


def embeddings(n: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1).to(DEVICE, dtype)


@pytest.mark.parametrize("d", [64, 128, 256, wide(512), wide(768), wide(1024)])
@pytest.mark.parametrize("dtype, kernel, tol", DTYPES, ids=DTYPE_IDS)
def test_kernels_match_dense_float64(d: int, dtype: torch.dtype, kernel: str, tol: float) -> None:
    """Both kernels on a 37 x 53 block (no multiple of any tile; two column panels of the forward;
    on the interpreter two programs, one owning two row blocks) against float64."""
    m, n, scale, offset = 37, 53, 14.285, 9
    q, k = embeddings(m, d, dtype, 0), embeddings(n, d, dtype, 1)
    s = scale * (q.double() @ k.double().T).cpu()
    exact = kernel == "triton_exact"
    row, col = row_col_lse(q, k, scale, exact=exact, panel=32)
    assert rel(row, torch.logsumexp(s, 1)) <= tol and rel(col, torch.logsumexp(s, 0)) <= tol
    if streaming_triton.INTERPRET:  # both paths ran: the rows resident (d <= 128 here) and streamed over d
        assert streaming_triton._lse_pass_kernel.best_config.kwargs["RESIDENT"] == (d <= 128)
    a, b = torch.logsumexp(s, 1), torch.logsumexp(s, 0)
    positive = torch.arange(n)[None, :] == torch.arange(m)[:, None] + offset
    want = (s - a[:, None]).exp() + (s - b[None, :]).exp() - 2 * positive
    got = softmax_weights(q, k, a.float().to(DEVICE), b.float().to(DEVICE), scale, offset, exact=exact)
    assert got.dtype == (torch.float32 if exact else dtype)
    assert rel(got, want) <= tol
    if streaming_triton.INTERPRET:
        assert streaming_triton._weights_kernel.best_config.kwargs["RESIDENT"] == (d <= 128)


@pytest.mark.parametrize("dtype, kernel, tol", DTYPES, ids=DTYPE_IDS)
def test_fused_gradients_of_two_row_shares_equal_dense_autograd(dtype: torch.dtype, kernel: str, tol: float) -> None:
    """fused_lse / fused_embedding_grads for rows [0, 20) and [20, 53), as two ranks would call
    them: merged column LSEs, concatenated dZx and summed dZy shares equal autograd of the dense
    float64 loss; panels of 16 do not divide either share."""
    n, d, scale = 53, 96, torch.tensor(11.0, device=DEVICE)
    zx, zy = embeddings(n, d, dtype, 2), embeddings(n, d, dtype, 3)
    x64, y64 = zx.double().cpu().requires_grad_(), zy.double().cpu().requires_grad_()
    want = InfoNCE().dense(x64, y64, torch.tensor(11.0, dtype=torch.float64))
    want.backward()
    shares = [range(0, 20), range(20, n)]
    lses = [fused.fused_lse(zx[r.start : r.stop], zy, scale, kernel) for r in shares]
    row = torch.cat([r for r, _ in lses])
    col = torch.stack([c for _, c in lses]).logsumexp(0)
    loss = loss_from_lse(zx, zy, row, col, scale)
    assert abs(loss.item() - want.item()) <= tol * want.item()
    gx, gy = zip(
        *(
            fused.fused_embedding_grads(
                zx[r.start : r.stop], zy, row[r.start : r.stop], col, scale, r.start, kernel, panel=16
            )
            for r in shares
        )
    )
    assert rel(torch.cat(gx), x64.grad) <= tol
    assert rel(sum(gy), y64.grad) <= tol


@pytest.mark.parametrize("d", [64, 512, wide(1024)])
@pytest.mark.parametrize("dtype, kernel, tol", DTYPES, ids=DTYPE_IDS)
def test_sigmoid_kernel_matches_dense_float64(d: int, dtype: torch.dtype, kernel: str, tol: float) -> None:
    """SigLIP's W = -z sigmoid(-z (S + b)) on a 37 x 53 block with the positives shifted by 9, and
    the row sums it adds atomically (loss terms, W) on top of what the rows already hold."""
    m, n, scale, bias, offset = 37, 53, 10.0, -4.0, 9
    q, k = embeddings(m, d, dtype, 0), embeddings(n, d, dtype, 1)
    logits = scale * (q.double() @ k.double().T).cpu() + bias
    z = torch.where(torch.arange(n)[None, :] == torch.arange(m)[:, None] + offset, 1.0, -1.0).double()
    # small: float32 adds must not round the sums away
    held = torch.linspace(0, 0.25, m, dtype=torch.float32, device=DEVICE)
    loss_rows, bias_rows = held.clone(), held.clone()
    got = sigmoid_weights(
        q, k, scale, bias, offset, loss_rows=loss_rows, bias_rows=bias_rows, exact=kernel == "triton_exact"
    )
    want = -z * torch.sigmoid(-z * logits)
    assert rel(got, want) <= tol
    assert rel(loss_rows - held, -F.logsigmoid(z * logits).sum(1)) <= tol and rel(bias_rows - held, want.sum(1)) <= tol
    if streaming_triton.INTERPRET:  # both paths ran: resident rows (d <= 128 here), two column tiles a program
        assert streaming_triton._sigmoid_kernel.best_config.kwargs["RESIDENT"] == (d <= 128)


@pytest.mark.parametrize("dtype, kernel, tol", DTYPES, ids=DTYPE_IDS)
def test_fused_sigmoid_of_two_row_shares_equals_dense_autograd(dtype: torch.dtype, kernel: str, tol: float) -> None:
    """fused_sigmoid for rows [0, 20) and [20, 53), as two ranks would call it, panels of 16: the
    summed losses, concatenated dZx, summed dZy shares and dL/db equal autograd of the dense loss."""
    n, d = 53, 96
    zx, zy = embeddings(n, d, dtype, 2), embeddings(n, d, dtype, 3)
    x64, y64 = zx.double().cpu().requires_grad_(), zy.double().cpu().requires_grad_()
    b64 = torch.tensor(-3.0, dtype=torch.float64, requires_grad=True)
    want = Sigmoid().dense(x64, y64, torch.tensor(11.0, dtype=torch.float64), b64)
    want.backward()
    scale, bias = torch.tensor(11.0, device=DEVICE), torch.tensor(-3.0, device=DEVICE)
    parts = [
        fused.fused_sigmoid(zx[r.start : r.stop], zy, scale, bias, r.start, kernel, panel=16)
        for r in (range(0, 20), range(20, n))
    ]
    assert abs(sum(p[0] for p in parts).item() - want.item()) <= tol * want.item()
    assert rel(torch.cat([p[1] for p in parts]), x64.grad) <= tol and rel(sum(p[2] for p in parts), y64.grad) <= tol
    assert abs(sum(p[3].sum() for p in parts).item() - b64.grad.item()) <= tol * abs(b64.grad.item())


class SigTowers(torch.nn.Module):
    """Two linear towers to d=64, normalized; a learnable log temperature and bias."""

    def __init__(self) -> None:
        super().__init__()
        self.fx, self.fy = torch.nn.Linear(8, 64), torch.nn.Linear(5, 64)
        self.logit_scale = torch.nn.Parameter(torch.tensor([2.0]))
        self.logit_bias = torch.nn.Parameter(torch.tensor([-4.0]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.normalize(self.fx(x), dim=-1), F.normalize(self.fy(y), dim=-1), self.logit_scale.exp(), self.logit_bias


@pytest.mark.parametrize("kernel, tol", [("triton_exact", 1e-5), ("triton", 1e-2)])
def test_streaming_sigmoid_step_with_the_kernel_equals_dense(kernel: str, tol: float) -> None:
    """The sigmoid loss through StreamingClipStep and the fused kernel, t' and b learnable, uneven
    microbatches, against the dense float64 loss of the same model."""
    torch.manual_seed(0)
    model = SigTowers().to(DEVICE)
    reference = SigTowers().double()
    reference.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(50, 8, generator=g), torch.randn(50, 5, generator=g)
    loss = StreamingClipStep(stream_chunk_size=16, kernel=kernel, objective=Sigmoid())(
        lambda mb: model(x[mb].to(DEVICE), y[mb].to(DEVICE)), [slice(0, 20), slice(20, 37), slice(37, 50)]
    )
    want = Sigmoid().dense(*reference(x.double(), y.double()))
    want.backward()
    assert abs(loss.item() - want.item()) <= tol * want.item()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert rel(p.grad.cpu(), q.grad) <= tol, name


def test_every_output_element_is_written_and_no_other() -> None:
    """W into a NaN-poisoned strided view: every element of the view written, the rest untouched."""
    q, k = embeddings(45, 96, torch.float32, 4), embeddings(70, 96, torch.float32, 5)
    row, col = row_col_lse(q, k, 10.0, exact=True)
    assert torch.isfinite(row).all() and torch.isfinite(col).all()
    buffer = torch.full((50, 80), float("nan"), device=DEVICE)
    softmax_weights(q, k, row, torch.zeros(70, device=DEVICE), 10.0, 0, exact=True, out=buffer[:45, :70])
    assert torch.isfinite(buffer[:45, :70]).all()
    assert buffer[45:].isnan().all() and buffer[:, 70:].isnan().all()


class Towers(torch.nn.Module):
    """Two linear towers to d=64, normalized, and a learnable log temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.fx, self.fy = torch.nn.Linear(8, 64), torch.nn.Linear(5, 64)
        self.logit_scale = torch.nn.Parameter(torch.tensor([2.7]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return F.normalize(self.fx(x), dim=-1), F.normalize(self.fy(y), dim=-1), self.logit_scale.exp()


@pytest.mark.parametrize("kernel, tol", [("triton_exact", 1e-5), ("triton", 1e-2)])
def test_streaming_step_with_the_kernel_equals_dense_loss_and_gradients(kernel: str, tol: float) -> None:
    """The whole symmetric loss, the learnable scale's gradient included, through StreamingClipStep
    with uneven microbatches, against the dense float64 loss of the same model (`triton`: TF32 dots
    on CUDA)."""
    torch.manual_seed(0)
    model = Towers().to(DEVICE)
    reference = Towers().double()
    reference.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(50, 8, generator=g), torch.randn(50, 5, generator=g)
    loss = StreamingClipStep(stream_chunk_size=16, kernel=kernel)(
        lambda mb: model(x[mb].to(DEVICE), y[mb].to(DEVICE)), [slice(0, 20), slice(20, 37), slice(37, 50)]
    )
    want = InfoNCE().dense(*reference(x.double(), y.double()))
    want.backward()
    assert abs(loss.item() - want.item()) <= tol * want.item()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert rel(p.grad.cpu(), q.grad) <= tol, name


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda q, k: (q.double(), k.double()), r"float64: use loss.kernel=pytorch"),
        (lambda q, k: (q, torch.cat([k, k], 1)[:, ::2]), r"need row-major contiguous embeddings"),
        (lambda q, k: (q[:, :32], k), r"same d"),
    ],
)
def test_bad_inputs(bad, message: str) -> None:
    q, k = embeddings(8, 64, torch.float32, 6), embeddings(8, 64, torch.float32, 7)
    with pytest.raises(ValueError, match=message):
        row_col_lse(*bad(q, k), 1.0)
    with pytest.raises(ValueError, match=message):
        softmax_weights(*bad(q, k), torch.zeros(8), torch.zeros(8), 1.0, 0)


def test_bad_weight_buffer() -> None:
    q = embeddings(8, 64, torch.float32, 6)
    lse = torch.zeros(8, device=DEVICE)
    with pytest.raises(ValueError, match=r"out must be \[8, 8\] with unit column stride"):
        softmax_weights(q, q, lse, lse, 1.0, 0, out=torch.empty(16, 8, device=DEVICE)[::2].T)
    with pytest.raises(ValueError, match=r"LSEs must be \[8\] and \[8\]"):
        softmax_weights(q, q, lse[:7], lse, 1.0, 0)


def _kernel_step_matches_dense(wrapper: str, loss: str = "clip") -> None:
    """distributed_train_step with KERNEL=triton_exact on this process group (rows against all
    columns: partial column LSEs all-gathered, dZy shares reduce-scattered) == dense float64;
    `objective=Sigmoid()`: the sigmoid loss with a learnable bias."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    towers, dense = (SigTowers, Sigmoid().dense) if loss == "siglip" else (Towers, InfoNCE().dense)
    model = towers()
    reference = towers().double()
    reference.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    n = 12 * world
    x, y = torch.randn(n, 8, generator=g), torch.randn(n, 5, generator=g)
    want = dense(*reference(x.double(), y.double()))
    want.backward()
    if wrapper == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    recorder = GradRecorder(model.parameters())
    local = slice(rank * 12, (rank + 1) * 12)
    config = {
        "GLOBAL_BATCH_SIZE": n,
        "MICRO_BATCH_SIZE": 5,
        "STREAM_CHUNK_SIZE": 7,
        "TAU": None,
        "KERNEL": "triton_exact",
        "LOSS": loss,
    }
    loss = distributed_train_step(model, recorder, x[local], y[local], config)
    assert abs(loss - want.item()) <= 1e-5 * want.item()
    for got, (name, p) in zip(recorder.grads, reference.named_parameters()):
        assert rel(got, p.grad) <= 1e-5, name


@pytest.mark.parametrize("world, wrapper", [(2, "ddp"), (4, "fsdp")])
def test_distributed_kernel_step_equals_dense(world: int, wrapper: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("gloo processes on CPU: the interpreter path")
    run_distributed(_kernel_step_matches_dense, world, wrapper)


def test_auto_picks_pytorch_off_cuda_and_for_float64() -> None:
    assert fused.resolve_kernel("auto", torch.zeros(2, 4)) == "pytorch"
    assert fused.resolve_kernel("auto", torch.zeros(2, 4, dtype=torch.float64, device=DEVICE)) == "pytorch"
    assert fused.resolve_kernel("triton", torch.zeros(2, 4)) == "triton"


def test_auto_self_check_accepts_the_kernels_and_rejects_a_wrong_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check `auto` runs once per device before using the kernels: true for these kernels, and a
    warning + false when the weights come out wrong (what a miscompile would look like). Its problem
    made smaller (still two panels, the second ragged): the interpreter runs 333 rows in ~45 s."""
    monkeypatch.setattr(fused, "SELF_CHECK_ROWS", 45)
    monkeypatch.setattr(fused, "SELF_CHECK_PANEL", 32)
    check = fused._agrees_on_device.__wrapped__
    assert check("triton_exact", DEVICE, torch.float32, 32)
    from titan_contrastive.kernels import streaming_triton

    assert check("triton_exact", DEVICE, torch.float32, 32, "siglip")
    real = streaming_triton.softmax_weights
    monkeypatch.setattr(streaming_triton, "softmax_weights", lambda *a, **k: real(*a, **k).mul_(1.05))
    with pytest.warns(UserWarning, match=r"disagree with PyTorch on .* d=32 .*; using the PyTorch path"):
        assert not check("triton_exact", DEVICE, torch.float32, 32)
    monkeypatch.setattr(streaming_triton, "softmax_weights", lambda *a, **k: 1 / 0)
    with pytest.warns(
        UserWarning, match=r"failed on .* \(ZeroDivisionError: division by zero\); using the PyTorch path"
    ):
        assert not check("triton_exact", DEVICE, torch.float32, 32)


def test_trainer_global_negatives_with_the_kernel(tmp_path) -> None:  # noqa: ANN001
    """`[loss] kernel = "triton_exact"` in the trainer: the same step as the PyTorch path (float32)."""
    from tests.test_trainer import assert_close, grads, make_trainer

    args = [
        "--training.dtype=float32",
        "--training.local_batch_size=6",
        "--training.global_batch_size=18",
        "--loss.negatives=global",
        "--loss.stream_chunk_size=5",
    ]
    fused, plain = (make_trainer(str(tmp_path / k), *args, f"--loss.kernel={k}") for k in ("triton_exact", "pytorch"))
    fused.model.load_state_dict(plain.model.state_dict())
    micro = [fused.train_set.__getitems__(list(range(s, s + 6))) for s in (0, 6, 12)]
    got, want = fused.train_step(micro), plain.train_step(micro)
    assert abs(got["loss"] - want["loss"]) <= 1e-5 * want["loss"]
    assert_close(grads(fused.model), grads(plain.model), rel=1e-5)


def test_missing_triton_is_a_config_error(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from tests.test_trainer import make_trainer
    from titan_contrastive.config import ConfigError

    monkeypatch.setitem(sys.modules, "titan_contrastive.kernels.streaming_triton", None)  # import raises ImportError
    with pytest.raises(
        ConfigError, match=r"^loss.kernel=triton needs triton .*; pip install triton, or set loss.kernel=pytorch$"
    ):
        make_trainer(str(tmp_path), "--loss.kernel=triton", "--loss.negatives=global")


_AOT = r"""
import json, sys
from pathlib import Path
import triton
from benchmarks.kernel_sass import classify, compile_for_hopper, disassemble
from titan_contrastive.kernels import streaming_triton as st
from titan_contrastive.kernels.tiles import resident_fits

WANT = sys.argv[1].split(",")
CUOBJDUMP = (Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump").exists()


def spills(kernel):  # local-memory loads and stores in the SASS, as benchmarks/kernel_sass counts them
    return classify(disassemble(kernel))["spill"] if CUOBJDUMP else None


out = []
kernels = {"lse": st._lse_pass_kernel, "weights": st._weights_kernel, "sigmoid": st._sigmoid_kernel}
for dt, exact in (("bf16", False), ("fp32", True)):  # what `auto` runs: mixed precision, and float32
    for name in WANT:
        tuner, itemsize = kernels[name], 4 if exact else 2
        for cfg in [c for c in tuner.configs if not c.kwargs.get("RESIDENT") or resident_fits(c, itemsize, exact)]:
            k = compile_for_hopper(tuner.fn, cfg, dt, exact)
            out.append({"kernel": name, "dtype": dt, "config": str(cfg), "shared": k.metadata.shared,
                        "cp_async": "cp.async.cg.shared.global" in k.asm["ptx"],
                        "wgmma": "wgmma.mma_async" in k.asm["ptx"],
                        "resident": bool(cfg.kwargs.get("RESIDENT")),
                        "spills": spills(k) if cfg.kwargs.get("RESIDENT") else None})
print(json.dumps(out))
"""


def compiled_configs(kernels: str) -> list[dict]:
    """Compile the named kernels (comma-separated) x every autotune config for sm_90, without a GPU."""
    if not (Path(triton.__file__).parent / "backends/nvidia/bin/ptxas").exists() and shutil.which("ptxas") is None:
        pytest.skip("this triton has no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for real, not interpret
    done = subprocess.run(
        [sys.executable, "-c", _AOT, kernels], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # every config compiled: ~1 min each with a cold Triton cache
def test_every_autotune_config_compiles_for_hopper_within_shared_memory() -> None:
    """No GPU needed: Triton compiles each kernel x autotune config for sm_90 (PTX, then the bundled
    ptxas), for the bf16 and exact-float32 variants `auto` runs, and each fits an H100's 227 KiB
    of shared memory per block; the resident tiles spill no registers. Catches what the interpreter
    cannot: lowering errors, and tiles that no Hopper can launch."""
    compiled = compiled_configs("lse,weights")
    # the forward's 7 streamed configs and the W kernel's 5, each kernel's 2 resident ones in bf16
    # (the exact fp32 dot has none)
    assert len(compiled) == (7 + 2) + (5 + 2) + 7 + 5
    print(
        *(
            f"{c['kernel']} {c['dtype']} {c['config'].split(', num_ctas')[0]}: {c['shared'] // 1024} KiB"
            for c in compiled
        ),
        sep="\n",
    )
    too_big = [c for c in compiled if c["shared"] > 232448]
    assert not too_big, too_big
    assert all(c["cp_async"] for c in compiled)  # loads pipelined through shared memory
    assert all(c["wgmma"] for c in compiled if c["dtype"] == "bf16")  # Hopper tensor cores
    resident = [c for c in compiled if c["resident"]]
    if all(c["spills"] is None for c in resident):
        pytest.skip("this triton has no cuobjdump: register spills unchecked (the rest passed)")
    assert all(c["spills"] == 0 for c in resident), resident  # their point is fewer bytes moved


@pytest.mark.slow  # every config compiled: ~1 min each with a cold Triton cache
def test_the_sigmoid_kernel_compiles_for_hopper_within_shared_memory() -> None:
    """The same for the sigmoid kernel: every config for sm_90, bf16 and exact fp32, within 227 KiB,
    pipelined, on tensor cores in bf16, the resident tiles without spills."""
    compiled = compiled_configs("sigmoid")
    assert len(compiled) == 2 * 3 + 2  # the resident tiles in bf16
    assert not [c for c in compiled if c["shared"] > 232448]
    assert all(c["cp_async"] for c in compiled) and all(c["wgmma"] for c in compiled if c["dtype"] == "bf16")
    assert all(c["spills"] in (0, None) for c in compiled if c["resident"])


_SASS = r"""
import json, triton
from benchmarks.kernel_sass import classify, compile_for_hopper, disassemble
from titan_contrastive.kernels import streaming_triton as st

def counts(tuner, m, n, warps, stages):
    cfg = next(c for c in tuner.configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_D"], c.num_warps,
               c.num_stages, c.kwargs["RESIDENT"]) == (m, n, 64, warps, stages, False))
    sass = disassemble(compile_for_hopper(tuner.fn, cfg))
    return {**classify(sass), "logits": m * n / (32 * warps), "subnormal_fixups": sass.count("-126")}

print(json.dumps({"forward 64": counts(st._lse_pass_kernel, 64, 128, 4, 3),
                  "forward 128": counts(st._lse_pass_kernel, 128, 128, 4, 2),
                  "W": counts(st._weights_kernel, 128, 256, 8, 3),
                  "W sigmoid": counts(st._sigmoid_kernel, 64, 128, 4, 4)}))
"""


@pytest.mark.slow  # ~18 s of compiling for sm_90a on 2 cores
def test_the_kernels_spend_few_instructions_per_logit_on_hopper() -> None:
    """benchmarks/kernel_sass.py's counts on sm_90a SASS, for the tiles an H100 chose and the
    128-row forward tiles: every exponential is one MUFU.EX2 without the subnormal fix-up that
    `tl.exp` wraps around it (2 MUFU per logit: the softmax kernels' two exponentials, SigLIP's one
    and its reciprocal), the W kernels' epilogues stay under 16 and 48 instructions per logit (23.4
    and 66.2 with `tl.exp`, `tl.log`, `/` and a diagonal compare on every tile), and one warpgroup
    over 128 rows halves the forward's column-statistics shuffles per logit. Spills stay under 1 % of
    the instructions: a Triton that reloads a few loop-invariant values per tile passes, an epilogue
    that spills its tile (60f25a4's W) does not."""
    if not (Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump").exists():
        pytest.skip("this triton has no cuobjdump")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _SASS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    per_logit = {k: {c: v[c] / v["logits"] for c in v} for k, v in got.items()}
    for name, c in per_logit.items():
        assert 2.0 <= c["mufu"] <= 2.1 and got[name]["subnormal_fixups"] == 0, (name, c)
        assert got[name]["spill"] <= 0.01 * got[name]["total"], (name, got[name])
    assert per_logit["W"]["total"] < 16, per_logit["W"]
    assert per_logit["W sigmoid"]["total"] < 48, per_logit["W sigmoid"]  # 66.2 with exp, log and `/`
    assert per_logit["forward 128"]["shuffle"] <= 0.55 * per_logit["forward 64"]["shuffle"], per_logit
    assert per_logit["forward 128"]["total"] < 0.8 * per_logit["forward 64"]["total"], per_logit


def test_distributed_sigmoid_kernel_step_equals_dense() -> None:
    """distributed_train_step with LOSS=siglip through the fused kernel on 2 DDP processes: t' and b
    counted once over ranks and microbatches."""
    if torch.cuda.is_available():
        pytest.skip("gloo processes on CPU: the interpreter path")
    run_distributed(_kernel_step_matches_dense, 2, "ddp", "siglip")
