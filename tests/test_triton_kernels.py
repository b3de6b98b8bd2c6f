"""The fused Triton kernels of the streaming loss against dense float64 references.

Compiled on CUDA when there is a GPU, else through Triton's interpreter (TRITON_INTERPRET=1, set
by conftest.py before anything imports triton), so CI on CPU checks the kernels' arithmetic and
masking; their speed is a GPU benchmark (benchmarks/loss_bench.py). Skipped without triton.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not 1 (tests/conftest.py sets it)", allow_module_level=True)

from titan_contrastive.components.loss import clip_loss  # noqa: E402
from titan_contrastive.distributed_clip import StreamingClipStep  # noqa: E402
from titan_contrastive.kernels.streaming_triton import lse, softmax_pair_times  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def embeddings(n: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1).to(DEVICE, dtype)


@pytest.mark.parametrize("d", [64, 128, 256, 512, 768, 1024])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32-exact", "bf16"])
def test_kernels_match_dense_float64(d: int, dtype: torch.dtype, tol: float) -> None:
    m, n, scale = 37, 53, 14.285  # no multiple of any block
    q, k = embeddings(m, d, dtype, 0), embeddings(n, d, dtype, 1)
    s = scale * (q.double() @ k.double().T)
    exact = dtype == torch.float32
    assert rel(lse(q, k, scale, exact=exact), torch.logsumexp(s, 1)) <= tol
    q_shift, k_shift = torch.logsumexp(s, 1), torch.logsumexp(s, 0)
    want = ((s - q_shift[:, None]).exp() + (s - k_shift[None, :]).exp()) @ k.double()
    assert rel(softmax_pair_times(q, k, q_shift.float(), k_shift.float(), scale, exact=exact), want) <= tol


def test_every_output_element_is_written() -> None:
    q, k = embeddings(45, 96, torch.float32, 2), embeddings(70, 96, torch.float32, 3)
    out1 = torch.full((45,), float("nan"), device=DEVICE)
    out2 = torch.full((45, 96), float("nan"), device=DEVICE)
    lse(q, k, 10.0, exact=True, out=out1)
    softmax_pair_times(q, k, out1, lse(k, q, 10.0, exact=True), 10.0, exact=True, out=out2)
    assert torch.isfinite(out1).all() and torch.isfinite(out2).all()


class Towers(torch.nn.Module):
    """Two linear towers to d=64, normalized, and a learnable log temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.fx, self.fy = torch.nn.Linear(8, 64), torch.nn.Linear(5, 64)
        self.logit_scale = torch.nn.Parameter(torch.tensor([2.7]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return F.normalize(self.fx(x), dim=-1), F.normalize(self.fy(y), dim=-1), self.logit_scale.exp()


def test_streaming_step_with_the_kernel_equals_dense_loss_and_gradients() -> None:
    """The whole symmetric loss, learnable scale included, through StreamingClipStep(kernel="triton_exact")
    with uneven microbatches, against the dense float64 loss of the same model."""
    torch.manual_seed(0)
    model = Towers().to(DEVICE)
    reference = Towers().double()
    reference.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(50, 8, generator=g), torch.randn(50, 5, generator=g)
    loss = StreamingClipStep(stream_chunk_size=16, kernel="triton_exact")(
        lambda mb: model(x[mb].to(DEVICE), y[mb].to(DEVICE)), [slice(0, 20), slice(20, 37), slice(37, 50)])
    want = clip_loss(*reference(x.double(), y.double()))
    want.backward()
    assert abs(loss.item() - want.item()) <= 1e-5 * want.item()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert rel(p.grad.cpu(), q.grad) <= 1e-5, name


@pytest.mark.parametrize("bad, message", [
    (lambda q, k: (q.double(), k.double()), r"float64: use loss.kernel=pytorch"),
    (lambda q, k: (q, torch.cat([k, k], 1)[:, ::2]), r"need row-major contiguous embeddings"),
    (lambda q, k: (q[:, :32], k), r"same d"),
])
def test_bad_inputs(bad, message: str) -> None:
    q, k = embeddings(8, 64, torch.float32, 6), embeddings(8, 64, torch.float32, 7)
    with pytest.raises(ValueError, match=message):
        lse(*bad(q, k), 1.0)


def test_trainer_global_negatives_with_the_kernel(tmp_path) -> None:  # noqa: ANN001
    """`[loss] kernel = "triton_exact"` in the trainer: the same step as the PyTorch path (float32)."""
    from tests.test_trainer import assert_close, grads, make_trainer

    args = ["--training.dtype=float32", "--training.local_batch_size=6", "--training.global_batch_size=18", "--loss.negatives=global",
            "--loss.stream_chunk_size=5"]
    fused, plain = (make_trainer(str(tmp_path / k), *args, f"--loss.kernel={k}") for k in ("triton_exact", "pytorch"))
    fused.model.load_state_dict(plain.model.state_dict())
    micro = [fused.train_set.__getitems__(list(range(s, s + 6))) for s in (0, 6, 12)]
    got, want = fused.train_step(micro), plain.train_step(micro)
    assert abs(got["loss"] - want["loss"]) <= 1e-5 * want["loss"]
    assert_close(grads(fused.model), grads(plain.model), rel=1e-5)


def test_missing_triton_is_a_config_error(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    import sys

    from titan_contrastive.config import ConfigError
    from tests.test_trainer import make_trainer

    monkeypatch.setitem(sys.modules, "titan_contrastive.kernels.streaming_triton", None)  # import raises ImportError
    with pytest.raises(ConfigError, match=r"^loss.kernel=triton needs triton .*; pip install triton, or set loss.kernel=pytorch$"):
        make_trainer(str(tmp_path), "--loss.kernel=triton", "--loss.negatives=global")
