"""Our exact global-negatives step vs open_clip's `accum_freq` step: same model, same batch, one GPU.

    python -m benchmarks.openclip_compare                          # H100: global batch 1K .. 64K
    python -m benchmarks.openclip_compare --global-batch 512 1024 --micro 128 --steps 2   # quick
    /tmp/peers_venv/bin/python -m benchmarks.openclip_compare --device cpu --global-batch 16 --micro 8 \\
        --steps 1 --out /tmp/bench                                 # CPU smoke of the wiring (peers venv)

Both sides train CLIP ViT-B/32 (open_clip's `ViT-B-32` config with the text vocabulary of our
byte tokenizer, which sizes our embedding table: the parameter counts are checked equal), float32
weights with bf16 autocast, AdamW, no activation checkpointing, no compile, one process, on the
same microbatches of real data (the bundled emoji images upsampled to 224 px, 77 tokens; 8
distinct microbatches staged once on the GPU in bf16 and cycled), so neither pays for
host-to-device copies inside the step and the peaks are the steps' own.

- ours: `Trainer.train_step` with `loss.negatives = "global"` and `loss.kernel = "auto"`: per
  microbatch a no-grad forward, the exact streaming loss over the whole global batch, then a
  re-forward with the cached embedding gradients (seed 001 / GradCache).
- open_clip: `open_clip_train.train.train_one_epoch` with `accum_freq = global / micro` from the
  PyPI package (never vendored): a no-grad forward per microbatch, then per microbatch a
  re-forward and the dense loss over the whole global batch (it recomputes the N x N logits
  once per accumulation step).

Per global batch: the median step time over `--steps` steps after one warm-up step (harness.round_robin
with one variant: the two sides cannot share the device while each one's peak is measured, so they
run one after the other), samples/s, MFU (the model's FLOPs per sample, like the trainer's metric)
and the peak allocated memory (CPU smoke runs: the peak RSS during a step). A point that runs out of
memory is recorded as OOM. Writes openclip_compare[_<--tag>].{json,csv,png} under
`--out`. Needs CUDA and `open-clip-torch` (the device image has torchvision and timm;
`benchmarks/gpu_session.sh wheels` fetches the rest).
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import tempfile
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from titan_contrastive.components.metrics import device_peak_tflops
from titan_contrastive.config import parse_args
from titan_contrastive.train import Trainer

REPO = harness.REPO


def build_ours(micro: int, device: str, dump: str) -> Trainer:
    return Trainer(
        parse_args(
            [
                "--job.config_file",
                str(REPO / "train_configs/debug.toml"),
                f"--job.dump_folder={dump}",
                "--model.flavor=vit_b32",
                "--data.dataset=emoji",
                "--data.image_size=224",
                "--data.context_length=77",
                "--data.num_workers=0",
                f"--training.device={device}",
                "--training.mixed_precision_param=bfloat16",
                "--training.max_norm=0",
                f"--training.local_batch_size={micro}",
                # one microbatch for the trainer's bookkeeping: the bundled emoji set holds fewer samples than
                # a 2K-64K batch, which the trainer refuses; `run_ours` gives the step all global / micro
                # microbatches, which is all a global-negatives step reads
                f"--training.global_batch_size={micro}",
                "--loss.negatives=global",
                "--eval.enable=false",
                "--metrics.enable_tensorboard=false",
                "--checkpoint.enable=false",
            ]
        )
    )


DISTINCT = 8  # microbatches of real samples staged on the device; a global batch cycles through them


def stage(trainer: Trainer, count: int, micro: int) -> list[dict[str, torch.Tensor]]:
    """`count` microbatches on the device (floats in bf16): DISTINCT real ones, repeated. The values
    do not change the work, and staging 64K distinct 224 px images would take minutes and
    ~20 GB of device memory on both sides; this way the peaks are the training step's."""
    n = len(trainer.train_set)
    staged = []
    for i in range(min(count, DISTINCT)):
        batch = trainer.train_set.__getitems__([(i * micro + j) % n for j in range(micro)])
        staged.append(
            {
                k: v.to(trainer.device, torch.bfloat16) if v.is_floating_point() else v.to(trainer.device)
                for k, v in batch.items()
            }
        )
    return [staged[i % len(staged)] for i in range(count)]


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed(run_step: Callable[[], None], steps: int, device: torch.device) -> dict[str, Any]:
    """One warm-up step, then `steps` timed ones (harness.round_robin, one variant); OOM is a result.
    Peak: CUDA allocated (CPU smoke runs: the process's peak RSS during a step)."""
    cuda = device.type == "cuda"
    m = harness.round_robin({"step": run_step}, steps, warmup=1, device=device, rss=not cuda)["step"]
    if not m.ok:
        return {"status": m.status}
    peak = m.cuda_peak_bytes if cuda else m.peak_rss_mib * 2**20
    return {
        "status": "ok",
        "step_s": m.median_s,
        "min_s": min(m.times_s),
        "max_s": max(m.times_s),
        "times_s": m.times_s,
        "peak_gib": peak / 2**30,
    }


def run_ours(
    global_batch: int, micro: int, steps: int, device: torch.device
) -> tuple[dict[str, Any], list, Any, float]:
    with tempfile.TemporaryDirectory() as dump:
        trainer = build_ours(micro, str(device), dump)
        args = trainer.model_args
        microbatches = stage(trainer, global_batch // micro, micro)
        # a partial, not a closure: the `del` below must drop the last references to both
        result = timed(functools.partial(trainer.train_step, microbatches), steps, device)
        flops = trainer.model_args.flops_per_sample()
        inputs = [[mb[k] for k in trainer.spec.input_keys] for mb in microbatches]
        del trainer, microbatches
    release(device)  # our model and optimizer must not sit in open_clip's peak
    return result, inputs, args, flops


class _Loader:
    """What train_one_epoch iterates: `accum` microbatches per step, `steps` steps."""

    def __init__(self, inputs: list, steps: int) -> None:
        self.inputs, self.steps = inputs, steps
        self.num_batches = len(inputs) * steps
        self.num_samples = sum(len(x[0]) for x in inputs) * steps

    def __iter__(self):  # noqa: ANN204
        for _ in range(self.steps):
            yield from ((images, texts) for images, texts in self.inputs)


def _open_clip_step(
    train_one_epoch: Callable[..., Any], model: Any, loss: Any, optimizer: Any, args: Any, inputs: list
) -> None:
    """One open_clip training step: train_one_epoch over one step's `accum` microbatches."""
    data = {"train": types.SimpleNamespace(dataloader=_Loader(inputs, 1), set_epoch=lambda epoch: None)}
    train_one_epoch(model, data, loss, 0, optimizer, None, None, None, args)


def run_open_clip(inputs: list, ours: Any, micro: int, steps: int, device: torch.device) -> tuple[dict[str, Any], int]:
    import open_clip
    from open_clip_train.train import train_one_epoch

    # ViT-B-32 with the text vocabulary of our data's tokenizer (ours sizes its embedding from the data)
    text = {
        "context_length": ours.context_length,
        "vocab_size": ours.vocab_size,
        "width": ours.text_width,
        "heads": ours.text_heads,
        "layers": ours.text_layers,
    }
    model = open_clip.create_model(
        "ViT-B-32", pretrained=None, precision="fp32", device=device, text_cfg=text, output_dict=True
    )
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    args = types.SimpleNamespace(
        device=str(device),
        precision="amp_bf16",
        distill=False,
        accum_freq=len(inputs),
        skip_scheduler=True,
        horovod=False,
        grad_clip_norm=None,
        log_every_n_steps=10**9,
        world_size=1,
        batch_size=micro,
        wandb=False,
        rank=0,
        local_rank=0,
    )
    loss = open_clip.ClipLoss()
    # a partial, not a closure: the `del` below must drop the last references to the model and optimizer
    one_step = functools.partial(_open_clip_step, train_one_epoch, model, loss, optimizer, args, inputs)
    result = timed(one_step, steps, device)
    del model, optimizer, one_step
    release(device)
    return result, params


def plot(rows: list[dict[str, Any]], device: str):  # noqa: ANN201 - a matplotlib figure
    plt = harness.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for impl in ("ours", "open_clip"):
        sel = [r for r in rows if r["impl"] == impl and r["status"] == "ok"]
        ax1.plot([r["global_batch"] for r in sel], [r["samples_per_s"] for r in sel], "o-", label=impl)
        ax2.plot([r["global_batch"] for r in sel], [r["peak_gib"] for r in sel], "o-", label=impl)
    ax1.set(xscale="log", xlabel="global batch", ylabel="samples/s (median)", title="throughput")
    ax2.set(xscale="log", xlabel="global batch", ylabel="GiB", title="peak allocated")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.suptitle(f"CLIP ViT-B/32, bf16 autocast, exact global negatives vs open_clip accum_freq, {device}")
    return fig


FIELDS = ["impl", "global_batch", "micro", "status", "step_s", "min_s", "max_s", "samples_per_s", "mfu", "peak_gib"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch", type=int, nargs="+", default=[1024, 4096, 16384, 32768, 65536])
    parser.add_argument("--micro", type=int, default=256, help="microbatch (accumulation chunk) for both")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="for MFU; 0 = the trainer's table for this GPU")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke run of the wiring (tiny batches)")
    parser.add_argument("--tag", default="", help="suffix of the result files' name")
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    stem = "openclip_compare" + (f"_{args.tag}" if args.tag else "")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "openclip_compare needs a CUDA GPU (ViT-B/32 at 224 px); run it through the device tool, "
            "or --device cpu for a smoke run"
        )
    logging.getLogger().setLevel(logging.WARNING)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (smoke run)"
    peak = device_peak_tflops(device, args.peak_tflops)
    meta = harness.metadata(device)
    payload = {"device": name, "peak_tflops": peak, "config": vars(args)}
    rows = []
    for global_batch in args.global_batch:
        if global_batch % args.micro:
            raise SystemExit(f"--global-batch {global_batch} is not a multiple of --micro {args.micro}")
        ours, inputs, model_args, flops = run_ours(global_batch, args.micro, args.steps, device)
        ours_params = model_args.num_params()
        theirs, their_params = run_open_clip(inputs, model_args, args.micro, args.steps, device)
        if ours_params != their_params:
            raise SystemExit(f"parameter counts differ: ours {ours_params:,} vs open_clip {their_params:,}")
        del inputs
        release(device)
        for impl, result in (("ours", ours), ("open_clip", theirs)):
            row = {"impl": impl, "global_batch": global_batch, "micro": args.micro, "params": ours_params, **result}
            if result["status"] == "ok":
                row["samples_per_s"] = global_batch / result["step_s"]
                row["mfu"] = row["samples_per_s"] * flops / (peak * 1e12) if peak else None
            rows.append(row)
            shown = (
                f"{row['samples_per_s']:9.0f} samples/s  MFU {row['mfu'] or 0:5.1%}  peak {row['peak_gib']:6.1f} GiB"
                if result["status"] == "ok"
                else result["status"]
            )
            print(f"B={global_batch:>6} {impl:>9}: {shown}", flush=True)
        if ours["status"] == theirs["status"] == "ok":
            print(
                f"B={global_batch:>6}  ours / open_clip: {theirs['step_s'] / ours['step_s']:.2f}x samples/s, "
                f"{ours['peak_gib'] / theirs['peak_gib']:.2f}x peak memory",
                flush=True,
            )
        # after every batch size: a run stopped at a time limit keeps what it measured
        harness.write_results(args.out, stem, meta, payload, rows=rows, fields=FIELDS)
    harness.write_results(args.out, stem, meta, payload, rows=rows, fields=FIELDS, figure=lambda: plot(rows, name))


if __name__ == "__main__":
    main()
