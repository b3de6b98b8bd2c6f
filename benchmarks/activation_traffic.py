"""Bytes a bf16 step moves outside its GEMMs, counted, not timed: autocast against FSDP2 on one device.

`python -m benchmarks.activation_traffic [--flavor vit_b32] [--batches 4 8] [--predict 1024] [--out DIR]`:
one forward and backward of the clip family through the trainer's own gradient step (no optimizer), in
bf16 mixed precision two ways: autocast over float32 weights (what one device does by default) and FSDP2's
mixed precision over a group of one (`parallelism.fsdp_one_device`). A dispatch mode sees every aten op of
the step and adds the bytes of its tensor inputs and outputs (views move nothing and are left out), by
family: GEMMs and attention (compute-bound on a GPU), dtype casts, FSDP's copies and collectives, and the
rest (LayerNorm, GELU, residual adds, dropout, softmax over the loss: memory-bound on a GPU). Eager bytes
are what an uncompiled GPU step reads and writes through memory; a compiled one fuses some of them away.

CPU autocast keeps LayerNorm in its input's dtype where CUDA's runs it (and softmax, norms, exp, log,
sums) in float32 (torch.amp's "CUDA ops that can autocast to float32"); the count applies CUDA's rule to
the functions of that list the step calls, so that it counts what the GPU step moves.

Bytes are affine in the batch (weights' casts and copies per step, activations per sample): two batch
sizes give the per-sample and the fixed part of each family, extrapolated to `--predict` samples, where the
GPU profile of the vit_b32 step was taken. Counting does not depend on the machine (CPU here, bf16 both).
"""

from __future__ import annotations

import argparse
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks import harness

MODES = {"autocast": "false", "fsdp_one_device": "true"}
GEMM = ("mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "convolution", "scaled_dot_product", "_flash_attention")
FAMILIES = ("gemm_attention", "cast", "fsdp", "other")


def family(op: Any) -> str:
    """The family of an aten OpOverload (or another namespace's op)."""
    namespace, name = op.namespace, op._schema.name.split("::")[-1]
    if namespace in ("fsdp", "c10d", "_c10d_functional", "_dtensor"):
        return "fsdp"
    if name == "_to_copy":
        return "cast"
    if any(name == g or name.startswith(g) or name.startswith(f"_{g}") for g in GEMM):
        return "gemm_attention"
    return "other"


def cuda_float32_functions() -> set[Any]:
    """The functions of CUDA autocast's float32 list that the clip step and its losses call."""
    import torch
    import torch.nn.functional as F

    T = torch.Tensor
    return {
        *(F.layer_norm, F.group_norm, F.normalize, F.softmax, F.log_softmax, F.cross_entropy),
        *(torch.softmax, torch.log_softmax, torch.logsumexp, torch.exp, torch.log, torch.sum, torch.norm),
        *(T.softmax, T.log_softmax, T.logsumexp, T.exp, T.log, T.sum, T.norm, torch.linalg.vector_norm),
    }


def count_step(mode: str, flavor: str, batch: int, image_size: int) -> dict[str, float]:
    """{family: bytes} of one gradient step (forward and backward of `batch` pairs) in `mode`."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten, tree_map

    from titan_contrastive.config import parse_args
    from titan_contrastive.parallelisms import destroy_distributed
    from titan_contrastive.train import Trainer

    totals: dict[str, float] = defaultdict(float)
    upcast = cuda_float32_functions()

    class CudaAutocastRule(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if func in upcast and torch.is_autocast_enabled("cpu"):
                low = (torch.bfloat16, torch.float16)
                args, kwargs = tree_map(
                    lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype in low else t, (args, kwargs or {})
                )
            return func(*args, **(kwargs or {}))

    class Bytes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            if not func.is_view and func._schema.name not in ("aten::detach", "aten::alias"):
                tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
                totals[family(func)] += sum(t.numel() * t.element_size() for t in tensors)
            return out

    with tempfile.TemporaryDirectory() as dump:
        trainer = Trainer(
            parse_args(
                [
                    "--model.name=clip",
                    f"--model.flavor={flavor}",
                    "--data.dataset=emoji",
                    f"--data.image_size={image_size}",
                    "--eval.enable=false",
                    "--metrics.enable_tensorboard=false",
                    "--training.steps=2",
                    "--lr_scheduler.warmup_steps=0",
                    "--training.mixed_precision_param=bfloat16",
                    f"--parallelism.fsdp_one_device={MODES[mode]}",
                    f"--training.local_batch_size={batch}",
                    f"--training.global_batch_size={batch}",
                    f"--job.dump_folder={dump}",
                ]
            )
        )
        try:
            microbatches = [trainer.train_set.__getitems__(list(range(batch)))]
            trainer.train_step(microbatches)  # first-step work (optimizer state, lazy inits) out of the count
            trainer.optimizer.zero_grad(set_to_none=True)
            with CudaAutocastRule(), Bytes():
                trainer.gradient_step(microbatches)
        finally:
            trainer.metrics.close()
            del trainer
            destroy_distributed()
    return dict(totals)


def account(flavor: str, batches: list[int], image_size: int, predict: int) -> list[dict[str, Any]]:
    """Per mode and family: bytes at each batch, the per-sample and fixed parts, the extrapolation to `predict`."""
    small, large = batches
    rows = []
    for mode in MODES:
        counts = {b: count_step(mode, flavor, b, image_size) for b in batches}
        for fam in FAMILIES:
            at = {b: counts[b].get(fam, 0.0) for b in batches}
            per_sample = (at[large] - at[small]) / (large - small)
            fixed = at[small] - per_sample * small
            rows.append(
                {
                    "mode": mode,
                    "family": fam,
                    **{f"bytes_at_{b}": at[b] for b in batches},
                    "per_sample_bytes": per_sample,
                    "fixed_bytes": fixed,
                    f"predicted_gb_at_{predict}": (fixed + per_sample * predict) / 1e9,
                }
            )
    return rows


def _figure(rows: list[dict[str, Any]], meta: dict[str, Any]) -> Any:
    plt = harness.pyplot()
    key = f"predicted_gb_at_{meta['predict']}"
    fig, ax = plt.subplots(figsize=(7, 3.4))
    width = 0.38
    for i, mode in enumerate(MODES):
        values = [next(r[key] for r in rows if r["mode"] == mode and r["family"] == fam) for fam in FAMILIES]
        ax.bar([j + (i - 0.5) * width for j in range(len(FAMILIES))], values, width, label=mode)
    ax.set_xticks(range(len(FAMILIES)), FAMILIES)
    ax.set_ylabel("GB read + written (eager)")
    ax.set_title(f"clip/{meta['flavor']} bf16, one forward + backward of {meta['predict']} pairs (extrapolated)")
    ax.legend()
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.activation_traffic", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--flavor", default="vit_b32")
    parser.add_argument("--batches", type=int, nargs=2, default=[4, 8], help="two batch sizes (pairs)")
    parser.add_argument("--image-size", type=int, default=224, help="0: the dataset's own (emoji: 32 px)")
    parser.add_argument("--predict", type=int, default=1024, help="extrapolate to this batch")
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    rows = account(args.flavor, sorted(args.batches), args.image_size, args.predict)
    key = f"predicted_gb_at_{args.predict}"
    for row in rows:
        print(
            f"{row['mode']:16s} {row['family']:15s} {row['per_sample_bytes'] / 1e6:9.2f} MB/sample "
            f"{row['fixed_bytes'] / 1e6:9.1f} MB fixed  {row[key]:8.2f} GB at {args.predict}"
        )
    meta = harness.metadata(device="cpu", flavor=args.flavor, batches=args.batches, predict=args.predict)
    harness.write_results(args.out, "activation_traffic", meta, rows=rows, figure=lambda: _figure(rows, meta))


if __name__ == "__main__":
    main()
