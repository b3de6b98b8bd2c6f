"""Training metrics: console log line, TensorBoard and `metrics.jsonl`, written by rank 0.

Throughput is reported in samples (image-text pairs) per second, not tokens: a contrastive
step's cost is set by the number of pairs. MFU is reported when the device's peak FLOP/s
is known (configured, or looked up for common GPUs).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import resource
import time
from typing import Any

import torch

from titan_contrastive.atomic_write import write_text_atomically
from titan_contrastive.models.registry import flavor_name

logger = logging.getLogger("titan_contrastive")

# Dense bf16 tensor-core peak per GPU, TFLOP/s (vendor data sheets, SXM parts).
_KNOWN_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def device_peak_tflops(device: torch.device, configured: float) -> float:
    """Peak TFLOP/s for MFU: the configured value, a known GPU's, or 0 (unknown; no MFU)."""
    if configured > 0:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in _KNOWN_PEAK_TFLOPS.items():
            if key in name:
                return value
    return 0.0


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak, or the peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def strict_json(record: dict[str, Any]) -> dict[str, Any]:
    """metrics.jsonl is strict JSON: a non-finite number is written as the string "nan", "inf" or
    "-inf" (bare NaN / Infinity are not JSON, and strict parsers reject the line)."""
    return {k: (str(v).lower() if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


class MetricsProcessor:
    """Collects timings between log steps and writes one record per log/eval event."""

    def __init__(
        self,
        dump_folder: str,
        *,
        rank: int,
        enable_tensorboard: bool,
        device: torch.device,
        flops_per_sample: int,
        peak_tflops: float,
        world_size: int,
        wandb_config: dict[str, Any] | None = None,
        resumed: bool = False,
    ) -> None:
        """`wandb_config`: the run's config, to log to Weights & Biases under; None = no W&B run.
        `resumed`: the run continues from a checkpoint, so it continues the dump folder's W&B run."""
        self.rank = rank
        self.device = device
        self.flops_per_sample = flops_per_sample
        self.peak_flops = peak_tflops * 1e12 * world_size
        self.writer = None
        self.jsonl = None
        self.wandb: Any = None
        if rank == 0:
            os.makedirs(dump_folder, exist_ok=True)
            self.jsonl = open(os.path.join(dump_folder, "metrics.jsonl"), "a", encoding="utf-8")
            if enable_tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(os.path.join(dump_folder, "tb"))
            if wandb_config is not None:
                self.wandb = _start_wandb(dump_folder, wandb_config, resumed)
        self.reset()

    @classmethod
    def for_run(cls, cfg: Any, model_args: Any, dist: Any, *, resumed: bool) -> MetricsProcessor:
        """The run's metrics (`cfg`: the JobConfig; `dist`: this process's parallelisms.DistInfo): in
        `job.dump_folder`, MFU against the model's FLOPs per sample and the device's (or
        `metrics.peak_tflops`) peak; `resumed`: the run continues from a checkpoint."""
        device, rank, world_size = dist.device, dist.rank, dist.world_size
        return cls(
            cfg.job.dump_folder,
            rank=rank,
            enable_tensorboard=cfg.metrics.enable_tensorboard,
            device=device,
            flops_per_sample=model_args.flops_per_sample(),
            peak_tflops=device_peak_tflops(device, cfg.metrics.peak_tflops),
            world_size=world_size,
            wandb_config=dataclasses.asdict(cfg) if cfg.metrics.enable_wandb else None,
            resumed=resumed,
        )

    def reset(self) -> None:
        """Start a new measurement window (called after every log line)."""
        self.window_start = time.perf_counter()
        self.data_time = 0.0
        self.samples = 0
        self.source_losses: dict[str, list[float]] = {}

    def add_step(self, samples: int, loss: float, source: str | None = None) -> None:
        """One optimizer step of `samples` samples; with `source` (each step one source's), its loss is
        averaged into that source's `loss/<source>` at the next log line."""
        self.samples += samples
        if source is not None:
            self.source_losses.setdefault(source, []).append(loss)

    def record(self, kind: str, step: int, values: dict[str, Any]) -> None:
        """Write one record to TensorBoard and W&B (`{kind}/{name}`) and metrics.jsonl (rank 0 only)."""
        if self.rank != 0:
            return
        if self.writer is not None:
            for name, value in values.items():
                if isinstance(value, (int, float)):
                    self.writer.add_scalar(f"{kind}/{name}", value, step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log({f"{kind}/{k}": v for k, v in values.items() if isinstance(v, (int, float))}, step=step)
        assert self.jsonl is not None
        self.jsonl.write(json.dumps(strict_json({"kind": kind, "step": step, **values}), allow_nan=False) + "\n")
        self.jsonl.flush()

    @torch.profiler.record_function("MetricsProcessor.log_train")  # a named span in [profiling] traces
    def log_train(self, step: int, *, loss: float, lr: float, grad_norm: float, **extra: Any) -> dict[str, Any]:
        """Summarise the window since the last log: samples/s, MFU, memory, data share."""
        elapsed = max(time.perf_counter() - self.window_start, 1e-9)
        values: dict[str, Any] = {
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "samples_per_s": self.samples / elapsed,
            "peak_memory_gib": peak_memory_gib(self.device),
            "data_share": self.data_time / elapsed,
            **{f"loss/{name}": sum(losses) / len(losses) for name, losses in self.source_losses.items()},
            **extra,
        }
        if self.device.type == "cuda":  # what the caching allocator holds (fragmentation included)
            values["peak_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        if self.peak_flops > 0 and self.flops_per_sample > 0:  # 0: FLOPs not modelled (vae)
            values["mfu"] = self.samples * self.flops_per_sample / elapsed / self.peak_flops
        self.record("train", step, values)
        mfu = f"  mfu {values['mfu']:.1%}" if "mfu" in values else ""
        logger.info(
            f"step {step:5d}  loss {loss:.4f}  lr {lr:.2e}  grad_norm {grad_norm:.3f}  "
            f"samples/s {values['samples_per_s']:.0f}{mfu}  peak_mem {values['peak_memory_gib']:.2f} GiB  "
            f"data {values['data_share']:.0%}"
            + ("  loss by source " if self.source_losses else "")
            + ", ".join(f"{name} {values[f'loss/{name}']:.4f}" for name in sorted(self.source_losses))
        )
        self.reset()
        return values

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        if self.jsonl is not None:
            self.jsonl.close()


def log_run_start(
    cfg: Any, data: Any, model_args: Any, dist: Any, dims: Any, precision: Any, ga_steps: int, step: Any
) -> None:
    """The run's first log lines: data, model size and FLOPs, parallel layout and dtypes, the batch
    arithmetic and the gradient step. Each object describes itself (`data.describe()`,
    `step.describe()`); `dist` is this process's parallelisms.DistInfo."""
    flops, device = model_args.flops_per_sample(), dist.device
    global_batch_size = cfg.training.local_batch_size * ga_steps * dims.dp_degree
    logger.info(f"data: {data.describe()}")
    logger.info(
        f"model: {cfg.model.name}/{flavor_name(cfg.model.name, cfg.model.flavor)}  "
        f"params {model_args.num_params():,}  training FLOPs/sample "
        f"{f'{flops:.3e}' if flops else 'n/a'} (encoders; loss excluded)  device {device}"
    )
    logger.info(
        f"parallelism: {dims.mode} (replicate {dims.dp_replicate} x shard {dims.dp_shard})  "
        f"params {cfg.training.dtype}  compute {precision.compute_dtype}  AC {cfg.activation_checkpoint.mode}  "
        f"compile {cfg.compile.backend if cfg.compile.enable else 'off'}"
    )
    logger.info(
        f"batch: local {cfg.training.local_batch_size}  x  grad-accum steps {ga_steps}  x  dp degree {dims.dp_degree}  "
        f"=  global {global_batch_size};  {step.describe()}"
    )


WANDB_ID_FILE = "run_id"
"""`{dump_folder}/wandb/run_id`: the id of the dump folder's W&B run, which a resumed run continues."""


def _start_wandb(dump_folder: str, config: dict[str, Any], resumed: bool) -> Any:
    """The W&B run: `$WANDB_RUN_ID` when set (the client's own variable), else on a resumed run the
    dump folder's last one, else a new one, whose id is kept for the next resume."""
    import wandb  # the `wandb` extra; its absence is a config error (config/manager.py)

    id_file = os.path.join(dump_folder, "wandb", WANDB_ID_FILE)
    run_id = os.environ.get("WANDB_RUN_ID")
    if not run_id and resumed and os.path.isfile(id_file):
        with open(id_file, encoding="utf-8") as f:
            run_id = f.read().strip() or None
    project = os.environ.get("WANDB_PROJECT", "titan_contrastive")
    run = wandb.init(project=project, dir=dump_folder, config=config, id=run_id, resume="allow" if run_id else None)
    os.makedirs(os.path.dirname(id_file), exist_ok=True)
    write_text_atomically(id_file, run.id + "\n")
    return run
