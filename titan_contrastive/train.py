"""The trainer: `python -m titan_contrastive.train --job.config_file F [--section.key=value ...]`.

Order of operations (everything that can fail on bad input runs before any compute):
1. parse and validate the config; join the process group; seed;
2. resolve the model family/flavor, the loss mode and the gradient-accumulation steps;
3. load the train and eval datasets (missing data fails here);
4. build the model (args updated from the data), wrap in DDP, build optimizer/scheduler/loss;
5. loop: per step, k microbatches of forward+backward (DDP syncs only on the last), clip the
   gradient norm, optimizer step, scheduler step; log every `log_freq`, evaluate every
   `eval.freq` and after the last step.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import sys
import time
from typing import Any, Iterator

import torch
from torch import nn

from titan_contrastive import models
from titan_contrastive.components.evaluate import evaluate
from titan_contrastive.components.loss import RescaleAccumulatedLoss, build_loss_fn
from titan_contrastive.components.lr_scheduler import build_lr_scheduler
from titan_contrastive.components.metrics import MetricsProcessor, device_peak_tflops
from titan_contrastive.components.optimizer import build_optimizer
from titan_contrastive.config import ConfigError, JobConfig, parse_args
from titan_contrastive.datasets import DataError, build_dataloader, build_dataset
from titan_contrastive.distributed import apply_ddp, destroy_distributed, init_distributed

logger = logging.getLogger("titan_contrastive")

MAX_LOGIT_SCALE = math.log(100.0)  # CLIP clamps the temperature at 1/100


def gradient_accumulation_steps(global_batch_size: int, local_batch_size: int, dp_degree: int) -> int:
    """global // (local x dp); -1 means one microbatch per step. Non-multiples are an error
    that names the three numbers and the nearest valid global batch sizes."""
    per_microstep = local_batch_size * dp_degree
    if global_batch_size == -1:
        return 1
    if global_batch_size % per_microstep != 0 or global_batch_size < per_microstep:
        below = max(per_microstep, global_batch_size // per_microstep * per_microstep)
        above = (global_batch_size // per_microstep + 1) * per_microstep
        nearest = sorted({below, above})
        raise ConfigError(
            f"training.global_batch_size={global_batch_size} is not a multiple of local_batch_size "
            f"({local_batch_size}) x dp_degree ({dp_degree}) = {per_microstep}; nearest valid global batch "
            f"sizes: {' or '.join(map(str, nearest))}"
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

        # 2. model family, loss mode, batch arithmetic: all checked before data or compute
        if cfg.job.custom_import:
            importlib.import_module(cfg.job.custom_import)
        self.spec = models.get_model_spec(cfg.model.name)
        flavor_args = models.get_flavor_args(cfg.model.name, cfg.model.flavor)
        if cfg.loss.negatives == "global":
            raise ConfigError(
                "loss.negatives='global' is not available yet (it needs the streaming loss and GradCache); "
                "use loss.negatives='microbatch' - see README 'Microbatch vs global negatives'"
            )
        replicate = cfg.parallelism.data_parallel_replicate_degree
        if replicate not in (-1, self.dist.world_size):
            raise ConfigError(
                f"parallelism.data_parallel_replicate_degree={replicate} does not match WORLD_SIZE={self.dist.world_size}; "
                f"use -1 or {self.dist.world_size}"
            )
        self.dp_degree = self.dist.world_size
        self.ga_steps = gradient_accumulation_steps(cfg.training.global_batch_size, cfg.training.local_batch_size, self.dp_degree)
        self.global_batch_size = cfg.training.local_batch_size * self.ga_steps * self.dp_degree

        # 3. data
        data = cfg.data
        common = dict(path=data.path, seed=cfg.training.seed, context_length=data.context_length)
        self.train_set = build_dataset(data.dataset, "train", augment=data.augment, **common)
        self.eval_set = build_dataset(data.dataset, "test", augment=False, **common)
        self.loader = build_dataloader(
            self.train_set, local_batch_size=cfg.training.local_batch_size, dp_rank=self.dist.rank,
            dp_world_size=self.dp_degree, seed=cfg.training.seed, num_workers=data.num_workers,
        )

        # 4. model, optimizer, schedule, losses
        try:
            self.model_args = flavor_args.update_from_data(
                image_shape=self.train_set.image_shape,
                vocab_size=self.train_set.tokenizer.vocab_size,
                context_length=data.context_length,
            )
        except ValueError as e:  # the flavor does not fit this dataset
            raise ConfigError(f"model.flavor={cfg.model.flavor!r} with data.dataset={data.dataset!r}: {e}") from None
        self.dtype = getattr(torch, cfg.training.dtype)
        with self.device:
            self.model = self.spec.build_model(self.model_args).to(self.dtype)
        self.dp_model = apply_ddp(self.model, self.dist)
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        dp_group = torch.distributed.group.WORLD if self.dist.is_distributed else None
        self.loss_fn = RescaleAccumulatedLoss(build_loss_fn(cfg.loss.name, dp_group), self.ga_steps)
        self.eval_loss_fn = build_loss_fn(cfg.loss.name)  # local and never rescaled
        self.metrics = MetricsProcessor(
            cfg.job.dump_folder, rank=self.dist.rank, enable_tensorboard=cfg.metrics.enable_tensorboard,
            device=self.device, flops_per_sample=self.model_args.flops_per_sample(),
            peak_tflops=device_peak_tflops(self.device, cfg.metrics.peak_tflops), world_size=self.dist.world_size,
        )
        self.step = 0
        self._log_start()

    def _log_start(self) -> None:
        cfg, ds = self.cfg, self.train_set
        logger.info(f"data: {ds.name} train {len(ds)} samples ({'full set' if ds.full else 'bundled subset'}, {ds.source}), eval {len(self.eval_set)}")
        logger.info(
            f"model: {cfg.model.name}/{cfg.model.flavor}  params {self.model_args.num_params():,}  "
            f"training FLOPs/sample {self.model_args.flops_per_sample():.3e} (encoders; loss excluded)  device {self.device}"
        )
        logger.info(
            f"batch: local {cfg.training.local_batch_size}  x  grad-accum steps {self.ga_steps}  x  dp degree {self.dp_degree}  "
            f"=  global {self.global_batch_size};  negatives per contrastive problem: "
            f"{cfg.training.local_batch_size * self.dp_degree} (loss.negatives=microbatch: accumulation adds no negatives)"
        )

    def _microbatch_context(self, is_last: bool) -> contextlib.AbstractContextManager:
        """DDP all-reduces gradients only after the last microbatch of a step."""
        if self.dist.is_distributed and not is_last:
            return self.dp_model.no_sync()
        return contextlib.nullcontext()

    def forward_backward_step(self, batch: dict[str, torch.Tensor], is_last: bool = True) -> torch.Tensor:
        """One microbatch: forward, rescaled loss, backward (grads accumulate in .grad)."""
        with self._microbatch_context(is_last):
            images = batch["image"].to(self.device, self.dtype)
            image_emb, text_emb = self.dp_model(images, batch["text"].to(self.device))
            loss = self.loss_fn(image_emb, text_emb, self.model.logit_scale.exp())
            del image_emb, text_emb
            loss.backward()
        return loss.detach()

    def train_step(self, microbatches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """zero_grad -> k x forward_backward -> clip -> optimizer step -> scheduler step."""
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.lr_scheduler.get_last_lr()[0]
        losses = [self.forward_backward_step(mb, is_last=i == len(microbatches) - 1) for i, mb in enumerate(microbatches)]
        max_norm = self.cfg.training.max_norm if self.cfg.training.max_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=True)
        self.optimizer.step()
        self.lr_scheduler.step()
        with torch.no_grad():
            self.model.logit_scale.clamp_(0, MAX_LOGIT_SCALE)
        # each loss is already divided by k: their sum is the mean microbatch loss
        return {"loss": torch.stack(losses).sum().item(), "lr": lr, "grad_norm": grad_norm.item()}

    def next_microbatches(self, data_iter: Iterator[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        start = time.perf_counter()
        batches = [next(data_iter) for _ in range(self.ga_steps)]
        self.metrics.data_time += time.perf_counter() - start
        return batches

    def evaluate(self) -> dict[str, float]:
        return evaluate(
            self.model, self.eval_set, self.eval_loss_fn, batch_size=self.cfg.eval.batch_size,
            device=self.device, rank=self.dist.rank, world_size=self.dist.world_size,
        )

    def train(self) -> dict[str, Any]:
        cfg = self.cfg
        data_iter = iter(self.loader)
        self.metrics.reset()
        results: dict[str, Any] = {}
        while self.step < cfg.training.steps:
            microbatches = self.next_microbatches(data_iter)
            out = self.train_step(microbatches)
            self.step += 1
            self.metrics.samples += self.global_batch_size
            if self.step % cfg.metrics.log_freq == 0 or self.step == cfg.training.steps:
                self.metrics.log_train(self.step, **out, logit_scale=self.model.logit_scale.exp().item())
            last = self.step == cfg.training.steps
            if last or (cfg.eval.freq and self.step % cfg.eval.freq == 0):
                start = time.perf_counter()
                results = self.evaluate()
                self.metrics.record("eval", self.step, results)
                shown = "  ".join(f"{k} {v:.4f}" for k, v in results.items() if k != "num_samples")
                logger.info(f"{'final ' if last else ''}eval step {self.step} on {int(results['num_samples'])} {self.eval_set.name} test samples: {shown} ({time.perf_counter() - start:.1f}s)")
                self.metrics.reset()
        return results


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[titan_contrastive] %(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout)
    trainer = None
    try:
        trainer = Trainer(parse_args(argv))
        start = time.perf_counter()
        trainer.train()
        logger.info(f"training done in {time.perf_counter() - start:.1f}s")
    except (ConfigError, DataError, models.ModelRegistryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if trainer is not None:
            trainer.metrics.close()
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
