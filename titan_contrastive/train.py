"""The trainer: `python -m titan_contrastive.train --job.config_file F [--section.key=value ...]`.

Order of operations (everything that can fail on bad input runs before any compute):
1. parse and validate the config; join the process group; seed;
2. resolve the model family/flavor, the loss mode, the DP layout and the accumulation steps;
3. load the train and eval datasets (missing data fails here);
4. build the model (args from the data), then AC -> compile -> FSDP2/HSDP/DDP per block;
   optimizer, scheduler, losses, metrics; restore the latest complete checkpoint if enabled;
5. loop: per step, k microbatches of forward+backward (gradient sync on the last one only for
   DDP, and for FSDP2 with `defer_grad_sync`), unscale (fp16), clip the gradient norm, check
   for non-finite values, optimizer step, scheduler step; log every `log_freq`, evaluate every
   `eval.freq` and after the last step, checkpoint every `checkpoint.interval` and at the end.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import logging
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.distributed.tensor import DTensor

from titan_contrastive import models
from titan_contrastive.components.checkpoint import CheckpointError, CheckpointManager, ModelState, OptimizerState, RNGState, TrainState
from titan_contrastive.components.evaluate import evaluate, evaluate_reconstruction
from titan_contrastive.components.loss import RescaleAccumulatedLoss, build_loss_fn
from titan_contrastive.components.lr_scheduler import build_lr_scheduler
from titan_contrastive.components.memory_planner import MemoryBudgetError, measured_first_step, plan_trainer
from titan_contrastive.components.metrics import MetricsProcessor, device_peak_tflops
from titan_contrastive.components.optimizer import build_optimizer
from titan_contrastive.components.precision import at_least_fp32, build_precision
from titan_contrastive.config import ConfigError, JobConfig, parse_args
from titan_contrastive.datasets import DataError, build_dataloader, build_dataset
from titan_contrastive.distributed import destroy_distributed, init_distributed
from titan_contrastive.distributed_clip import build_streaming_step
from titan_contrastive.grad_cache import GradCache, split_inputs, split_vlm_inputs
from titan_contrastive.parallelisms import ParallelDims, parallelize_model
from titan_contrastive.pixel_step import PixelStep, pixel_loss_options

logger = logging.getLogger("titan_contrastive")

MAX_LOGIT_SCALE = math.log(100.0)  # CLIP clamps the temperature at 1/100


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient norm with `training.on_nonfinite = "stop"`."""


def gradient_accumulation_steps(global_batch_size: int, local_batch_size: int, dp_degree: int) -> int:
    """global // (local x dp); -1 means one microbatch per step. Non-multiples are an error
    that names the three numbers and the nearest valid global batch sizes."""
    per_microstep = local_batch_size * dp_degree
    if global_batch_size == -1:
        return 1
    if global_batch_size % per_microstep != 0 or global_batch_size < per_microstep:
        below = max(per_microstep, global_batch_size // per_microstep * per_microstep)
        above = (global_batch_size // per_microstep + 1) * per_microstep
        raise ConfigError(
            f"training.global_batch_size={global_batch_size} is not a multiple of local_batch_size "
            f"({local_batch_size}) x dp_degree ({dp_degree}) = {per_microstep}; nearest valid global batch "
            f"sizes: {' or '.join(map(str, sorted({below, above})))}"
        )
    return global_batch_size // per_microstep


class Trainer:
    """Builds every component from a JobConfig and runs the training loop."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.dist = init_distributed(cfg.training.device)
        self.device = self.dist.device
        torch.manual_seed(cfg.training.seed)
        if cfg.training.deterministic:
            torch.use_deterministic_algorithms(True)

        # 2. model family, loss mode, DP layout, batch arithmetic: checked before data or compute
        if cfg.job.custom_import:
            importlib.import_module(cfg.job.custom_import)
        self.spec = models.get_model_spec(cfg.model.name)
        flavor_args = models.get_flavor_args(cfg.model.name, cfg.model.flavor)
        par = cfg.parallelism
        self.dims = ParallelDims.from_config(par.data_parallel_replicate_degree, par.data_parallel_shard_degree, self.dist.world_size)
        self.dp_degree = self.dims.dp_degree
        self.ga_steps = gradient_accumulation_steps(cfg.training.global_batch_size, cfg.training.local_batch_size, self.dp_degree)
        self.global_batch_size = cfg.training.local_batch_size * self.ga_steps * self.dp_degree
        self.precision = build_precision(cfg.training, fsdp=self.dims.fsdp_enabled, device=self.device)

        # 3. data (every rank is a DP rank: the DP rank is the global rank)
        data = cfg.data
        try:  # a pretrained family brings its tokenizer (an optional dependency: a clear error if missing)
            tokenizer = self.spec.build_tokenizer(flavor_args) if self.spec.build_tokenizer else None
        except ImportError as e:
            raise ConfigError(str(e)) from None
        common = dict(path=data.path, seed=cfg.training.seed, context_length=data.context_length, image_size=data.image_size,
                      tokenizer=tokenizer)
        self.train_set = build_dataset(data.dataset, "train", augment=data.augment, **common)
        self.eval_set = build_dataset(data.dataset, "test", augment=False, **common)
        layout = self.spec.image_layout
        for ds in (self.train_set, self.eval_set):
            if layout == "packed":  # Qwen-VL-style packed patches at the flavor's patch size
                ds.pack_patches(flavor_args.patch_size, data.image_sizes)
            elif layout == "masked":  # [-1, 1], zero-padded, with masks (the vae's pixel loss)
                ds.serve_masked(flavor_args.downsample, data.image_sizes)
            elif data.image_sizes:
                raise ConfigError(f"data.image_sizes={data.image_sizes}: mixed resolutions need a family that reads packed patches "
                                  f"or masks (model.name=vlm or vae); {cfg.model.name} takes one size: set data.image_size instead")
        self.split = split_vlm_inputs if layout == "packed" else split_inputs  # GradCache / re-forward chunks
        self.loader = build_dataloader(
            self.train_set, local_batch_size=cfg.training.local_batch_size, dp_rank=self.dist.rank,
            dp_world_size=self.dp_degree, seed=cfg.training.seed, num_workers=data.num_workers,
            pin_memory=self.device.type == "cuda",
        )

        # 4. model -> AC -> compile -> data parallelism; optimizer after sharding (DTensor params)
        try:
            self.model_args = flavor_args.update_from_data(
                image_shape=self.train_set.image_shape, vocab_size=self.train_set.tokenizer.vocab_size,
                context_length=data.context_length,
            )
        except ValueError as e:  # the flavor does not fit this dataset
            raise ConfigError(f"model.flavor={cfg.model.flavor!r} with data.dataset={data.dataset!r}: {e}") from None
        with self.device:
            self.model = self.spec.build_model(self.model_args).to(self.precision.param_dtype)
        self.mesh = self.dims.build_mesh(self.device.type)
        self.dp_model = parallelize_model(
            self.model, self.spec.blocks(self.model), self.dims, self.mesh, device=self.device,
            ac_mode=cfg.activation_checkpoint.mode, compile_backend=cfg.compile.backend if cfg.compile.enable else None,
            param_dtype=self.precision.fsdp_param_dtype, reduce_dtype=self.precision.reduce_dtype,
        )
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        dp_group = torch.distributed.group.WORLD if self.dist.is_distributed else None
        loss_name = cfg.loss.name or self.spec.default_loss
        if loss_name != self.spec.default_loss:
            raise ConfigError(f"loss.name={loss_name!r}: the {cfg.model.name} family trains with {self.spec.default_loss!r}; "
                              f"set loss.name={self.spec.default_loss} or leave it empty")
        self.pixel = loss_name == "pixel"  # the loss is computed inside the model (vae family)
        if self.pixel:
            self.model.pixel_loss_options = pixel_loss_options(cfg, fsdp=self.dims.fsdp_enabled, fp16_scaler=self.precision.scaler is not None)
            self.pixel_step = PixelStep(channels=self.train_set.image_shape[0], dp_degree=self.dp_degree, device=self.device,
                                        distributed=self.dist.is_distributed)
        else:
            self.loss_fn = RescaleAccumulatedLoss(build_loss_fn(loss_name, dp_group), self.ga_steps)
            self.eval_loss_fn = build_loss_fn(loss_name)  # local and never rescaled
        sizes = cfg.gradcache.chunk_sizes
        if cfg.gradcache.enabled and len(set(sizes)) > 1:
            raise ConfigError(f"gradcache.chunk_sizes={sizes}: the {cfg.model.name} family runs both towers in one forward; "
                              f"give one chunk size (e.g. --gradcache.chunk_sizes={min(sizes)})")
        self.chunk_size = sizes[0] if cfg.gradcache.enabled else None
        try:  # negatives=global: one exact problem over the global batch (seed 001); a missing triton fails here
            self.global_step = build_streaming_step(cfg.loss, group=dp_group, dp_degree=self.dp_degree,
                                                    compute_dtype=self.precision.compute_dtype)
        except ImportError as e:
            raise ConfigError(str(e)) from None
        self.metrics = MetricsProcessor(
            cfg.job.dump_folder, rank=self.dist.rank, enable_tensorboard=cfg.metrics.enable_tensorboard,
            device=self.device, flops_per_sample=self.model_args.flops_per_sample(),
            peak_tflops=device_peak_tflops(self.device, cfg.metrics.peak_tflops), world_size=self.dist.world_size,
        )
        self.train_state = TrainState()
        self._last_scale = torch.zeros(())  # exp(logit_scale) of the last microbatch, for the log
        self.checkpointer = CheckpointManager(
            cfg.checkpoint, dump_folder=cfg.job.dump_folder,
            states={"model": ModelState(self.model), "optimizer": OptimizerState(self.model, self.optimizer),
                    "lr_scheduler": self.lr_scheduler, "train_state": self.train_state},
            per_rank_states={"dataloader": self.loader, "rng": RNGState(self.device)},
            rank=self.dist.rank, dp_rank=self.dist.rank, dp_degree=self.dp_degree,
        )
        self._log_start()
        self.checkpointer.load()
        if cfg.memory.plan and not cfg.memory.budget_gib:
            raise ConfigError("memory.plan=true needs memory.budget_gib > 0 (the per-device budget to plan for)")
        self.memory_plan = plan_trainer(self) if cfg.memory.budget_gib else None  # before any real step

    @property
    def step(self) -> int:
        return self.train_state.step

    def _log_start(self) -> None:
        cfg, ds = self.cfg, self.train_set
        logger.info(f"data: {ds.name} train {len(ds)} samples ({'full set' if ds.full else 'bundled subset'}, {ds.source}), eval {len(self.eval_set)}")
        logger.info(
            f"model: {cfg.model.name}/{cfg.model.flavor}  params {self.model_args.num_params():,}  "
            f"training FLOPs/sample {f'{flops:.3e}' if (flops := self.model_args.flops_per_sample()) else 'n/a'} (encoders; loss excluded)  device {self.device}"
        )
        logger.info(
            f"parallelism: {self.dims.mode} (replicate {self.dims.dp_replicate} x shard {self.dims.dp_shard})  "
            f"params {cfg.training.dtype}  compute {self.precision.compute_dtype}  AC {cfg.activation_checkpoint.mode}  "
            f"compile {cfg.compile.backend if cfg.compile.enable else 'off'}"
        )
        if self.pixel:
            px = cfg.pixel_loss
            negatives = (f"pixel loss: masked {px.loss_type} mean over the global batch, decoder mode {px.mode}, chunks of "
                         f"{'adaptive size' if px.adaptive else px.chunk_size}")
        elif self.global_step is not None:
            negatives = (f"negatives per contrastive problem: {self.global_batch_size} (loss.negatives=global: one exact problem over the global batch, "
                         f"streamed in blocks of {cfg.loss.stream_chunk_size} rows; the {self.ga_steps} microbatches are re-forward chunks)")
        else:
            negatives = f"negatives per contrastive problem: {cfg.training.local_batch_size * self.dp_degree} (loss.negatives=microbatch: accumulation adds no negatives)"
        if self.chunk_size:
            negatives += f"; GradCache: forwards in chunks of {self.chunk_size} samples"
        logger.info(
            f"batch: local {cfg.training.local_batch_size}  x  grad-accum steps {self.ga_steps}  x  dp degree {self.dp_degree}  "
            f"=  global {self.global_batch_size};  {negatives}"
        )

    def _inputs(self, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The family's model inputs (`spec.input_keys`) from a batch, on the device (float ones in the param dtype)."""
        inputs = [batch[key].to(self.device, non_blocking=True) for key in self.spec.input_keys]  # then cast on the device
        return [x.to(self.precision.param_dtype) if x.is_floating_point() else x for x in inputs]

    def forward(self, batch: dict[str, torch.Tensor], **kwargs: Any) -> Any:
        """The model's forward with this run's dtype and autocast, through the FSDP root / the
        unwrapped DDP module (evaluation; the train step calls the DP wrapper)."""
        with self.precision.autocast():
            return self.model(*self._inputs(batch), **kwargs)

    def _grad_sync(self, is_last: bool) -> contextlib.AbstractContextManager:
        """Gradient reduction only after the last microbatch: always for DDP (no_sync), for
        FSDP2 only with `defer_grad_sync` (otherwise it reduce-scatters every microbatch)."""
        if self.dims.ddp_enabled and not is_last:
            return self.dp_model.no_sync()
        if self.dims.fsdp_enabled and self.cfg.parallelism.defer_grad_sync:
            self.model.set_requires_gradient_sync(is_last)
        return contextlib.nullcontext()

    def encode(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The DP-wrapped model on one microbatch under autocast; outputs in >= float32."""
        with self.precision.autocast():
            image_emb, text_emb, scale = self.dp_model(*self._inputs(batch))
        self._last_scale = scale.detach()
        return at_least_fp32(image_emb), at_least_fp32(text_emb), at_least_fp32(scale)

    def _packed(self, **batch: torch.Tensor) -> torch.Tensor:
        """GradCache's view of the model: one [B, 2d+1] representation (both towers, scale)."""
        image_emb, text_emb, scale = self.encode(batch)
        return torch.cat([image_emb, text_emb, scale.reshape(1, 1).expand(len(image_emb), 1)], dim=1)

    def _packed_loss(self, rep: torch.Tensor) -> torch.Tensor:
        dim = (rep.shape[1] - 1) // 2
        return self.loss_fn(rep[:, :dim], rep[:, dim : 2 * dim], rep[0, 2 * dim])

    def gradcache_step(self, microbatches: list[dict[str, torch.Tensor]]) -> float:
        """negatives=microbatch with GradCache: each microbatch (with all DP ranks') is one
        problem, forwarded in chunks; gradients sync on the last chunk of the last microbatch."""
        total = 0.0
        for i, mb in enumerate(microbatches):
            is_last = i == len(microbatches) - 1
            cache = GradCache([self._packed], self.chunk_size, self._packed_loss, split_input_fn=self.split, fp16=self.precision.scaler is not None,
                              scaler=self.precision.scaler, sync_context=lambda _m, sync, last=is_last: self._grad_sync(sync and last))
            total += cache.cache_step(mb, no_sync_except_last=True).item()
        return total

    def _pixel_forward(self, batch: dict[str, torch.Tensor], backward_scale: float) -> torch.Tensor:
        with self.precision.autocast():
            return self.dp_model(*self._inputs(batch), backward_scale=backward_scale)[0]

    def backward(self, loss: torch.Tensor) -> None:
        (self.precision.scaler.scale(loss) if self.precision.scaler else loss).backward()

    def forward_backward_step(self, batch: dict[str, torch.Tensor], is_last: bool = True) -> torch.Tensor:
        """One microbatch (loss.negatives=microbatch): forward, rescaled loss, backward into .grad."""
        with self._grad_sync(is_last):
            loss = self.loss_fn(*self.encode(batch))
            self.backward(loss)
        return loss.detach()

    def _clip_grad_norm(self) -> torch.Tensor:
        """Total gradient norm over all ranks (FSDP/HSDP shards included), clipped to max_norm."""
        if self.precision.scaler is not None:
            self.precision.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.training.max_norm if self.cfg.training.max_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=True)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def train_step(self, microbatches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """zero_grad -> k x forward_backward -> unscale/clip -> finite check -> step -> schedule."""
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.lr_scheduler.get_last_lr()[0]
        if self.pixel:
            loss = self.pixel_step(self._pixel_forward, microbatches, grad_sync=self._grad_sync, backward=self.backward)
        elif self.global_step is not None:  # one problem over all microbatches of all ranks
            chunks = [c for mb in microbatches for c in self.split(mb, self.chunk_size)] if self.chunk_size else microbatches
            loss = self.global_step(self.encode, chunks, grad_sync=self._grad_sync, backward=self.backward).item()
        elif self.chunk_size:
            loss = self.gradcache_step(microbatches)
        else:
            losses = [self.forward_backward_step(mb, is_last=i == len(microbatches) - 1) for i, mb in enumerate(microbatches)]
            loss = torch.stack(losses).sum().item()  # each is already / k: the sum is the mean
        grad_norm = self._clip_grad_norm().item()
        step = self.train_state.step + 1
        skipped = False
        scaler = self.precision.scaler
        if not math.isfinite(loss) or (scaler is None and not math.isfinite(grad_norm)):
            skipped = self._on_nonfinite(step, loss, grad_norm)
        elif scaler is not None:  # fp16: the scaler skips steps with inf/nan gradients itself
            before = scaler.get_scale()
            scaler.step(self.optimizer)
            scaler.update()
            if scaler.get_scale() < before:
                skipped = True
                logger.warning(f"step {step}: float16 gradients overflowed (grad_norm={grad_norm}); optimizer step skipped, loss scale {before:g} -> {scaler.get_scale():g}")
        else:
            self.optimizer.step()
        with warnings.catch_warnings():  # a skipped step advances the schedule on purpose
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            self.lr_scheduler.step()
        if skipped:
            self.train_state.skipped_steps += 1
        if hasattr(self.model, "logit_scale"):
            with torch.no_grad():
                self.model.logit_scale.clamp_(0, MAX_LOGIT_SCALE)
        self.train_state.step = step
        self.train_state.samples_seen += self.global_batch_size
        return {"loss": loss, "lr": lr, "grad_norm": grad_norm, "skipped_steps": self.train_state.skipped_steps}

    def _on_nonfinite(self, step: int, loss: float, grad_norm: float) -> bool:
        """Stop with the step and values, or skip the optimizer step (logged and counted)."""
        if self.cfg.training.on_nonfinite == "stop":
            raise NonFiniteError(
                f"step {step}: non-finite loss={loss} grad_norm={grad_norm}; lower optimizer.lr, check the data, "
                "or set training.on_nonfinite=skip to skip such steps"
            )
        logger.warning(f"step {step}: non-finite loss={loss} grad_norm={grad_norm}; optimizer step skipped ({self.train_state.skipped_steps + 1} so far)")
        return True

    def next_microbatches(self, data_iter: Iterator[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        start = time.perf_counter()
        batches = [next(data_iter) for _ in range(self.ga_steps)]
        self.metrics.data_time += time.perf_counter() - start
        return batches

    def evaluate(self) -> dict[str, float]:
        if self.pixel:  # masked MSE / PSNR of reconstructions, PNG grid in the dump folder
            reconstruct = functools.partial(self.forward, reconstruct=True)
            return evaluate_reconstruction(self.model, reconstruct, self.eval_set, batch_size=self.cfg.eval.batch_size,
                                           device=self.device, rank=self.dist.rank, world_size=self.dist.world_size,
                                           grid_path=Path(self.cfg.job.dump_folder) / f"reconstructions_step{self.step}.png")
        return evaluate(
            self.model, self.forward, self.eval_set, self.eval_loss_fn, batch_size=self.cfg.eval.batch_size,
            device=self.device, rank=self.dist.rank, world_size=self.dist.world_size,
        )

    def train(self) -> dict[str, Any]:
        cfg = self.cfg
        data_iter = iter(self.loader)
        self.metrics.reset()
        results: dict[str, Any] = {}
        while self.step < cfg.training.steps:
            batches = self.next_microbatches(data_iter)
            out = measured_first_step(self, batches) if self.memory_plan and not self.memory_plan.checked else self.train_step(batches)
            self.metrics.samples += self.global_batch_size
            last = self.step == cfg.training.steps
            if self.step % cfg.metrics.log_freq == 0 or last:
                self.metrics.log_train(self.step, **out, **({} if self.pixel else {"logit_scale": self._last_scale.item()}))
            side_work = False  # eval and checkpoint time stays out of samples/s
            if cfg.eval.enable and (last or (cfg.eval.freq and self.step % cfg.eval.freq == 0)):
                start = time.perf_counter()
                results = self.evaluate()
                self.metrics.record("eval", self.step, results)
                shown = "  ".join(f"{k} {v:.4f}" for k, v in results.items() if k != "num_samples")
                logger.info(f"{'final ' if last else ''}eval step {self.step} on {int(results['num_samples'])} {self.eval_set.name} test samples: {shown} ({time.perf_counter() - start:.1f}s)")
                side_work = True
            if self.checkpointer.maybe_save(self.step, last_step=last) or side_work:
                self.metrics.reset()
        return results


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[titan_contrastive] %(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout)
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    trainer, finished = None, False
    try:
        trainer = Trainer(parse_args(argv))
        if trainer.cfg.memory.plan:  # dry run: the plan is logged, nothing is trained
            finished = True
            return 0
        start = time.perf_counter()
        trainer.train()
        logger.info(f"training done in {time.perf_counter() - start:.1f}s")
        finished = True
    except (ConfigError, DataError, CheckpointError, models.ModelRegistryError, MemoryBudgetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    finally:
        if trainer is not None:
            trainer.metrics.close()
            del trainer  # release FSDP2's collective state before the process group goes
            gc.collect()
        destroy_distributed(barrier=finished)
    return 0


if __name__ == "__main__":
    sys.exit(main())
