"""Gradient-sync traffic and held gradient memory under accumulation: FSDP2 per-microbatch
reduce-scatter vs `defer_grad_sync` (set_requires_gradient_sync), measured, not estimated.

    torchrun --standalone --nproc_per_node=2 -m benchmarks.grad_sync_traffic [--flavor debug] [--out benchmarks/results]
    torchrun --standalone --nproc_per_node=2 -m benchmarks.grad_sync_traffic --ga 1 2 --out /tmp/bench   # quick

Runs the trainer's own microbatch path (`AccumulateStep.microbatch`, FSDP2 built by
`parallelize_model`) for one optimizer step at several accumulation depths k, and counts, on
rank 0, every FSDP2 collective (torch.distributed.all_gather_single / reduce_scatter_single,
wrapped) with the bytes it moves, plus the gradient bytes a rank holds after each microbatch
(sharded `.grad` and FSDP2's unsharded accumulated gradients). The byte counts are properties of
the algorithm, not of the device, so a CPU/gloo run gives the numbers a GPU/NCCL run would (nothing
is timed: the harness gives rank 0's metadata and files). Writes `grad_sync_traffic.{json,csv,png}`
under `--out`.
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import harness
from titan_contrastive.config import parse_args
from titan_contrastive.train import Trainer

BYTES: collections.Counter[str] = collections.Counter()
CALLS: collections.Counter[str] = collections.Counter()


def _count(name: str) -> None:
    """Wrap `torch.distributed.<name>` (FSDP2 calls it through the module) to count calls and bytes."""
    original: Callable[..., Any] = getattr(dist, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        CALLS[name] += 1
        BYTES[name] += max(t.numel() * t.element_size() for t in tensors)  # the unsharded side
        return original(*args, **kwargs)

    setattr(dist, name, counted)


def held_grad_bytes(model: torch.nn.Module) -> int:
    """Gradient bytes this rank holds: sharded .grad plus FSDP2's unsharded accumulated grads."""
    total = 0
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        for fsdp_param in group.fsdp_params if group is not None else []:
            sharded = fsdp_param.sharded_param.grad  # a DTensor: count this rank's shard
            unsharded = getattr(fsdp_param, "_unsharded_param", None)  # held while sync is deferred
            grads = (None if sharded is None else sharded.to_local(), None if unsharded is None else unsharded.grad)
            for grad in grads:
                total += 0 if grad is None else grad.numel() * grad.element_size()
    return total


def measure(flavor: str, ga: int, defer: bool, dump: str) -> dict[str, Any]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = Trainer(
        parse_args(
            [
                f"--model.flavor={flavor}",
                "--training.local_batch_size=8",
                f"--training.global_batch_size={8 * ga * world}",
                f"--parallelism.defer_grad_sync={str(defer).lower()}",
                "--eval.enable=false",
                "--metrics.enable_tensorboard=false",
                f"--job.dump_folder={dump}",
            ]
        )
    )
    assert trainer.dims.mode == "fsdp" and trainer.ga_steps == ga
    microbatches = [trainer.train_set.__getitems__(list(range(i * 8, (i + 1) * 8))) for i in range(ga)]
    trainer.optimizer.zero_grad(set_to_none=True)
    BYTES.clear()
    CALLS.clear()
    held = []
    for i, batch in enumerate(microbatches):  # the body of Trainer.train_step, with a probe per microbatch
        trainer.gradient_step.microbatch(batch, is_last=i == ga - 1)
        held.append(held_grad_bytes(trainer.model))
    param_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())  # DTensor numel is global
    trainer.metrics.close()
    return {
        "flavor": flavor,
        "ga_steps": ga,
        "defer_grad_sync": defer,
        "world_size": world,
        "param_bytes": param_bytes,
        "reduce_scatter_calls": CALLS["reduce_scatter_single"],
        "reduce_scatter_bytes": BYTES["reduce_scatter_single"],
        "all_gather_calls": CALLS["all_gather_single"],
        "all_gather_bytes": BYTES["all_gather_single"],
        "max_held_grad_bytes_between_microbatches": max(held[:-1], default=held[-1]),
        "held_after_each_microbatch": held,
    }


def plot(rows: list[dict[str, Any]]):  # noqa: ANN201 - a matplotlib figure
    plt = harness.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for defer, style in ((False, "o-"), (True, "s--")):
        sel = [r for r in rows if r["defer_grad_sync"] == defer]
        ks = [r["ga_steps"] for r in sel]
        label = "defer_grad_sync" if defer else "reduce-scatter every microbatch"
        ax1.plot(ks, [r["reduce_scatter_bytes"] / r["param_bytes"] for r in sel], style, label=label)
        held = [r["max_held_grad_bytes_between_microbatches"] / r["param_bytes"] for r in sel]
        ax2.plot(ks, held, style, label=label)
    ax1.set(
        xlabel="accumulation steps k",
        ylabel="reduce-scatter bytes / parameter bytes",
        title="gradient traffic per step",
    )
    ax2.set(
        xlabel="accumulation steps k", ylabel="held gradient bytes / parameter bytes", title="gradient memory per rank"
    )
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"FSDP2, {rows[0]['world_size']} ranks, clip/{rows[0]['flavor']} (bytes are device-independent)")
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--ga", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    for name in ("all_gather_single", "reduce_scatter_single"):
        _count(name)
    rows = []
    with tempfile.TemporaryDirectory() as dump:
        for defer in (False, True):
            for ga in args.ga:
                rows.append(measure(args.flavor, ga, defer, dump))
    if int(os.environ.get("RANK", "0")) == 0:
        meta = harness.metadata(world_size=rows[0]["world_size"], backend=dist.get_backend())
        harness.write_results(args.out, "grad_sync_traffic", meta, rows=rows, figure=lambda: plot(rows))
        print(
            f"{'defer':>6} {'k':>3} {'RS calls':>9} {'RS bytes/params':>16} {'AG bytes/params':>16} "
            f"{'held grads/params':>18}"
        )
        for r in rows:
            p = r["param_bytes"]
            print(
                f"{str(r['defer_grad_sync']):>6} {r['ga_steps']:>3} {r['reduce_scatter_calls']:>9} "
                f"{r['reduce_scatter_bytes'] / p:>16.2f} {r['all_gather_bytes'] / p:>16.2f} "
                f"{r['max_held_grad_bytes_between_microbatches'] / p:>18.2f}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
