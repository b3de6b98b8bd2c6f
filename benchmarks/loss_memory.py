"""The streamed loss's memory, counted (not timed): what is alive at its peak, and what that is at 64K.

    python -m benchmarks.loss_memory                   # the fused kernels (Triton's interpreter on CPU), bf16
    python -m benchmarks.loss_memory --kernel pytorch  # the PyTorch path

One `StreamingClipStep` call, the loss benchmark's (`loss_bench.py`: one microbatch, fixed
temperature, the embeddings' gradients), on a problem `--shrink` times smaller than the target in
both N and d, with every size the step chooses shrunk alike: the fused path's W panel
(`losses.fused.FUSED_PANEL`), `losses.base.row_dots`' row block and the PyTorch path's row chunk
(the config's `loss.stream_chunk_size`). Every buffer is then shrink^2 times smaller than at the
target (N x d, panel^2, chunk x N alike), so the peak's buffers times shrink^2 ([N] vectors: times
shrink) are the target's. Every tensor an operator returns is tracked by storage, as
`components.memory_probe.PeakMemory` does on CPU; at the peak, the live set is kept with the
operator and the package call site that made each tensor, in units of N x d elements of the input
dtype (bf16). On 2026-11-26 the count before that day's changes gave 16.0 units = 1,024 MiB at N =
64K, d = 512: the H100's measured 1,024 MiB (2026-11-24). `--encode copy` makes the encode return
copies of the inputs, as the loss benchmark did until 2026-11-26; the default returns the inputs
themselves. Writes `loss_memory[_pytorch][_copy].{json,csv,png}` under `--out`.
"""

from __future__ import annotations

import argparse
import os
import traceback
import weakref
from pathlib import Path
from typing import Any

from benchmarks import harness


def live_set_at_peak(call: Any) -> tuple[int, list[tuple[int, str]]]:  # noqa: ANN401
    """(peak bytes, [(bytes, elements, "op shape dtype < call sites")] alive at the peak) of `call()`."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    live: dict[int, list[Any]] = {}  # storage pointer -> [bytes, live tensor objects, description]
    state = {"now": 0, "peak": 0, "at_peak": []}

    def release(key: int) -> None:
        entry = live.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                state["now"] -= entry[0]
                del live[key]

    class Trace(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if not isinstance(t, torch.Tensor) or (key := t.untyped_storage().data_ptr()) == 0:
                    continue
                if key not in live:
                    sites = [
                        f"{f.name}:{f.lineno}"
                        for f in traceback.extract_stack()[:-1]
                        if "titan_contrastive" in f.filename
                    ]
                    what = f"{func.__name__} {list(t.shape)} {str(t.dtype).removeprefix('torch.')} < "
                    live[key] = [t.untyped_storage().nbytes(), 0, what + " < ".join(reversed(sites[-3:])), t.numel()]
                    state["now"] += live[key][0]
                    if state["now"] > state["peak"]:
                        state["peak"], state["at_peak"] = state["now"], [(e[0], e[3], e[2]) for e in live.values()]
                live[key][1] += 1
                weakref.finalize(t, release, key)
            return out

    with Trace():
        call()
    return state["peak"], sorted(state["at_peak"], reverse=True)


def count(kernel: str, target_n: int, target_d: int, shrink: int, encode: str) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import titan_contrastive.losses.base as base
    import titan_contrastive.losses.fused as fused
    from titan_contrastive.config.job_config import Loss
    from titan_contrastive.distributed_clip import StreamingClipStep

    if any(x % shrink for x in (target_n, target_d, fused.FUSED_PANEL, base.ROW_BLOCK, Loss.stream_chunk_size)):
        raise SystemExit(f"--shrink {shrink} must divide N, d, the panel, the row block and the chunk")
    n, d, dtype = target_n // shrink, target_d // shrink, torch.bfloat16
    panel, block, chunk = fused.FUSED_PANEL // shrink, base.ROW_BLOCK // shrink, Loss.stream_chunk_size // shrink
    grads = fused.fused_embedding_grads
    fused.fused_embedding_grads = lambda *a, **k: grads(*a, **{**k, "panel": panel})
    row_dots = base.row_dots.__defaults__
    base.row_dots.__defaults__ = (block,)
    try:
        gen = torch.Generator().manual_seed(0)
        zx = F.normalize(torch.randn(n, d, generator=gen), dim=-1).to(dtype).requires_grad_()
        zy = F.normalize(torch.randn(n, d, generator=gen), dim=-1).to(dtype).requires_grad_()
        step = StreamingClipStep(stream_chunk_size=chunk, fixed_scale=1 / 0.07, kernel=kernel)

        def encode_fn(_: Any) -> tuple[Any, ...]:  # noqa: ANN401
            return (zx * 1, zy * 1, None) if encode == "copy" else (zx, zy, None)

        step(encode_fn, [None])  # the first call checks the normalization
        zx.grad = zy.grad = None
        _, at_peak = live_set_at_peak(lambda: step(encode_fn, [None]))
    finally:
        fused.fused_embedding_grads, base.row_dots.__defaults__ = grads, row_dots
    unit = n * d * dtype.itemsize
    # views of the inputs (the identity encode's outputs, detached) are no new memory
    at_peak = [(b, numel, w) for b, numel, w in at_peak if not (w.startswith("detach") and b == unit)]
    peak = sum(b for b, _, _ in at_peak)

    def grown(size: int, numel: int) -> int:  # at the target: [N] vectors grow by shrink, the rest by shrink^2
        return size * (shrink if numel <= n else shrink**2)

    target = sum(grown(b, numel) for b, numel, _ in at_peak)
    return {
        "kernel": kernel,
        "encode": encode,
        "n": n,
        "d": d,
        "panel": panel,
        "row_block": block,
        "chunk": chunk,
        "peak_units": peak / unit,
        "target_n": target_n,
        "target_d": target_d,
        "target_mib": target / 2**20,
        "target_units": target / (unit * shrink**2),
        "at_peak": [
            {"units": b / unit, "target_units": grown(b, numel) / (unit * shrink**2), "tensor": w}
            for b, numel, w in at_peak
        ],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default="triton", choices=["triton", "pytorch"])
    parser.add_argument("--encode", default="inputs", choices=["inputs", "copy"])
    parser.add_argument("--shrink", type=int, default=64, help="N and d of the counted problem: the target's / this")
    parser.add_argument("--target-n", type=int, default=65536)
    parser.add_argument("--target-d", type=int, default=512)
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    if args.kernel == "triton":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' module is imported
    row = count(args.kernel, args.target_n, args.target_d, args.shrink, args.encode)
    print(
        f"{args.kernel} path, encode {args.encode}: at the peak {row['target_units']:.2f} x N d (bf16) "
        f"= {row['target_mib']:.0f} MiB at N = {args.target_n}, d = {args.target_d}"
    )
    for item in row["at_peak"]:
        if item["target_units"] >= 0.01:
            print(f"  {item['target_units']:5.2f}  {item['tensor']}")
    name = (
        "loss_memory"
        + ("" if args.kernel == "triton" else f"_{args.kernel}")
        + ("" if args.encode == "inputs" else f"_{args.encode}")
    )
    fields = [k for k in row if k != "at_peak"]
    harness.write_results(args.out, name, harness.metadata(), rows=[row], fields=fields, figure=lambda: plot(row))


def plot(row: dict[str, Any]):  # noqa: ANN201 - a matplotlib figure
    import matplotlib.pyplot as plt

    items = [i for i in row["at_peak"] if i["target_units"] >= 0.01]
    fig, ax = plt.subplots(figsize=(10, 0.4 * len(items) + 1.5))
    ax.barh(range(len(items)), [i["target_units"] for i in items])
    ax.set_yticks(range(len(items)), [i["tensor"][:90] for i in items], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("units of N x d (bf16)")
    ax.set_title(
        f"{row['kernel']} path, encode {row['encode']}: {row['target_units']:.2f} units at the peak = "
        f"{row['target_mib']:.0f} MiB at N = {row['target_n']}, d = {row['target_d']}",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
