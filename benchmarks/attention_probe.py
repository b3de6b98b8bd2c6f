"""One layer's self-attention at a CLIP flavor's shapes through each `scaled_dot_product_attention` backend.

    python -m benchmarks.attention_probe --out DIR               # CUDA: vit_b32, batch 1,024, bf16
    python -m benchmarks.attention_probe --device cpu --batch 4 --dtype float32 --out /tmp/bench   # CPU

The H100 profile of the vit_b32 step (docs/performance.md, "Where the GPU time goes") spent 14 ms of
the compiled 142 ms step in cuDNN's flash attention kernels, for under 1 TFLOP of work: the towers'
sequences (50 image tokens, 77 text tokens) are shorter than one flash tile. This probe asks what the
other kernels give at those shapes. For each tower of `--flavor` (its heads, head dim, token count;
the text tower causal) it builds q, k, v as `models/transformer.Attention` does (views of one
[B, T, 3, H, D] projection) and runs one attention forward and backward under each backend that
`torch.nn.attention.sdpa_kernel` can force (math, flash, efficient, cudnn) and under PyTorch's own
choice (auto). Each variant is first checked against float64 math on the same inputs (the output and
the input gradient, max error relative to the reference's largest value); one that the device or
dtype does not support is a row saying so. Then all of a tower's variants are timed side by side
(`harness.round_robin`, medians), and `step_ms` scales one layer to the tower's layers. Writes
attention_probe_{cuda,cpu}.{json,csv,png}. Nothing here changes the trainer: a backend worth choosing
moves into the model after a GPU run shows it (benchmarks/NOTES.md).
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks import harness
from titan_contrastive.models.clip.args import clip_flavors

BACKENDS: dict[str, SDPBackend | None] = {
    "auto": None,
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


def towers(flavor: str, context: int) -> list[dict[str, Any]]:
    """Each tower's attention shape: tokens, heads, head dim, causal, layers."""
    args = clip_flavors[flavor]
    image_tokens = (args.image_size // args.patch_size) ** 2 + 1  # patches and the class token
    return [
        {"tower": "image", "tokens": image_tokens, "heads": args.vision_heads, "width": args.vision_width}
        | {"causal": False, "layers": args.vision_layers},
        {"tower": "text", "tokens": context or args.context_length, "heads": args.text_heads}
        | {"width": args.text_width, "causal": True, "layers": args.text_layers},
    ]


def attention(qkv: torch.Tensor, heads: int, causal: bool, backend: SDPBackend | None) -> torch.Tensor:
    """Attention of a [B, T, 3 * width] projection, split as `Attention.forward` splits it."""
    b, t, w3 = qkv.shape
    q, k, v = (z.transpose(1, 2) for z in qkv.view(b, t, 3, heads, w3 // 3 // heads).unbind(2))
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def forward_backward(qkv: torch.Tensor, grad: torch.Tensor, shape: dict[str, Any], backend: SDPBackend | None):  # noqa: ANN201
    """Output and the input's gradient of one attention call."""
    qkv = qkv.detach().requires_grad_(True)
    out = attention(qkv, shape["heads"], shape["causal"], backend)
    out.backward(grad)
    return out.detach(), qkv.grad


def check(
    qkv: torch.Tensor, grad: torch.Tensor, shape: dict[str, Any], backend: SDPBackend | None, reference: tuple
) -> dict[str, Any]:
    """The variant against `reference` (float64 math's output and gradient): max |error| over the
    reference's largest |value|; or why it does not run."""
    try:
        out, dqkv = forward_backward(qkv, grad, shape, backend)
    except RuntimeError as exc:  # "No available kernel" and the like: this device or dtype lacks it
        return {"status": "unsupported", "detail": harness.reason(exc)[:300]}
    ref_out, ref_grad = reference
    return {
        "status": "ok",
        "out_error": ((out.double() - ref_out).abs().max() / ref_out.abs().max()).item(),
        "grad_error": ((dqkv.double() - ref_grad).abs().max() / ref_grad.abs().max()).item(),
    }


def plot(rows: list[dict[str, Any]], title: str) -> Any:
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.4))
    names = list(BACKENDS)
    width = 0.8 / 2
    for i, tower in enumerate(("image", "text")):
        ms = [
            next((r.get("step_ms", 0.0) for r in rows if r["tower"] == tower and r["backend"] == n), 0.0) for n in names
        ]
        bars = ax.bar([k + i * width for k in range(len(names))], ms, width, label=f"{tower} tower")
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks([k + width / 2 for k in range(len(names))], names)
    ax.set_ylabel("ms per step (forward + backward, all layers)")
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=8)
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="vit_b32", choices=sorted(clip_flavors))
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--context", type=int, default=0, help="text tokens (0: the flavor's context length)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    meta = harness.metadata(device, benchmark_args={k: v for k, v in vars(args).items() if k != "out"})
    gen = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    for shape in towers(args.flavor, args.context):
        b, t, w = args.batch, shape["tokens"], shape["width"]
        qkv = torch.randn(b, t, 3 * w, generator=gen).to(device, dtype)
        grad = torch.randn(b, t, shape["heads"], w // shape["heads"], generator=gen).transpose(1, 2).to(device, dtype)
        # QK^T and PV forward, twice that backward (no recompute counted); half of it under a causal mask
        flops = 3 * 4 * b * t * t * w / (2 if shape["causal"] else 1)
        reference = forward_backward(qkv.double(), grad.double(), shape, SDPBackend.MATH)
        checked = {name: check(qkv, grad, shape, backend, reference) for name, backend in BACKENDS.items()}
        del reference
        runnable = {
            n: functools.partial(forward_backward, qkv, grad, shape, BACKENDS[n])
            for n, c in checked.items()
            if c["status"] == "ok"
        }
        timed = harness.round_robin(runnable, args.repeats, warmup=3, device=device, rss=False, tolerate=True)
        for name, result in checked.items():
            row = {**{k: shape[k] for k in ("tower", "tokens", "heads", "causal", "layers")}, "batch": b}
            row |= {"head_dim": w // shape["heads"], "backend": name, **result}
            if name in timed and timed[name].times_s:
                ms = harness.summary(timed[name].times_s)["median"] * 1e3
                row |= {"ms": ms, "step_ms": ms * shape["layers"], "tflops": flops / ms / 1e9}
            rows.append(row)
            print({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items() if k != "detail"}, flush=True)
    title = (
        f"attention per backend, {args.flavor} batch {args.batch} {args.dtype} ({meta['device']}, {meta['date'][:10]})"
    )
    name = f"attention_probe_{'cuda' if device.type == 'cuda' else 'cpu'}"
    note = {"flops": "12·B·T²·width: QK^T and PV forward, twice that backward; half under a causal mask"}
    harness.write_results(args.out, name, meta, note, rows=rows, figure=lambda: plot(rows, title))


if __name__ == "__main__":
    main()
