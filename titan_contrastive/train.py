"""The trainer: `python -m titan_contrastive.train --job.config_file F [--section.key=value ...]`.

Order of operations (everything that can fail on bad input runs before any compute):
1. parse and validate the config; join the process group (`[comm] init_timeout_seconds`); check
   that the dump and checkpoint folders are writable (components/preflight.py); seed;
2. resolve the model family/flavor and its loss, the DP layout and the accumulation steps;
3. load the train and eval datasets (missing data fails here), laid out as the family reads them;
4. build the model (args from the data and the config), then AC -> compile -> FSDP2/HSDP/DDP per
   block; optimizer, scheduler, the gradient step (`steps/`: the kind the family, `[loss]` and
   `[gradcache]` select); check that a checkpoint fits; restore the latest valid checkpoint if
   enabled (the config's hyperparameters win, changes are logged: checkpoint/resume.py); metrics;
   with `[memory] budget_gib`, plan the step's chunks by measuring probe steps;
5. loop: per step, the gradient step turns k microbatches into gradients and the loss (the
   data-parallel reduction in the last backward only), then unscale (fp16), clip the gradient
   norm, check for non-finite values, optimizer step, scheduler step; log every `log_freq`,
   evaluate every `eval.freq` and after the last step, checkpoint every `checkpoint.interval`
   and at the end. The loop does not know which kind of step it runs. After the first step
   collectives wait `[comm] train_timeout_seconds`. Exit codes: docs/checkpoints.md.
`main`: SIGTERM/SIGUSR1 stop the run after the current step with a checkpoint, exit code 5
(components/preemption.py); the run folder is locked from the preflight to exit (components/run_lock.py).
"""

from __future__ import annotations

import gc
import importlib
import logging
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from titan_contrastive import exit_codes, models
from titan_contrastive.checkpoint import TrainState, build_checkpointer
from titan_contrastive.checkpoint.resume import model_source, report_unread_init_from
from titan_contrastive.components.evaluate import EvalContext, describe_results, evaluate_sets
from titan_contrastive.components.lr_scheduler import build_lr_scheduler
from titan_contrastive.components.memory_planner import MemoryPlan, measured_first_step, plan_step, probe_batches
from titan_contrastive.components.metrics import MetricsProcessor
from titan_contrastive.components.nonfinite import NonFiniteGuard
from titan_contrastive.components.optimizer import build_optimizer
from titan_contrastive.components.precision import build_precision
from titan_contrastive.components.preemption import StopSignals, stop_message
from titan_contrastive.components.preflight import check_output_folders, checkpoint_bytes
from titan_contrastive.components.run_lock import RunLock
from titan_contrastive.config import JobConfig, parse_args
from titan_contrastive.config.manager import MAX_LOGIT_SCALE, check_contrastive_problem, log_config_warnings
from titan_contrastive.datasets import build_dataset
from titan_contrastive.datasets.build import build_data
from titan_contrastive.models.build import build_run_model, resolve_loss
from titan_contrastive.parallelisms import (
    ParallelDims,
    destroy_distributed,
    gradient_accumulation_steps,
    init_distributed,
    parallelize_model,
    set_collective_timeout,
)
from titan_contrastive.steps import StepContext, build_gradient_step

logger = logging.getLogger("titan_contrastive")


class Trainer:
    """Builds every component from a JobConfig and runs the training loop; `run_lock` and `stop`: see `main`."""

    def __init__(self, cfg: JobConfig, run_lock: RunLock | None = None, stop: StopSignals | None = None) -> None:
        self.cfg, self.stop, self.stopped_by = cfg, stop, None
        self.dist = init_distributed(cfg.training.device, cfg.comm.init_timeout_seconds)
        self.device = self.dist.device
        check_output_folders(cfg.job.dump_folder, cfg.checkpoint.folder if cfg.checkpoint.enable else None, log=self.dist.rank == 0)
        if run_lock is not None:
            run_lock.acquire(cfg.job.dump_folder, rank=self.dist.rank, distributed=self.dist.is_distributed)
        torch.manual_seed(cfg.training.seed)
        torch.use_deterministic_algorithms(cfg.training.deterministic)

        # 2. model family and its loss, DP layout, batch arithmetic: checked before data or compute
        if cfg.job.custom_import:
            importlib.import_module(cfg.job.custom_import)
        self.spec = models.get_model_spec(cfg.model.name)
        flavor_args, init_state, self.resumed = model_source(cfg, self.spec, models.resolve_model_args)  # a resume reads no init_from
        self.loss_name = resolve_loss(self.spec, cfg.loss.name)
        par = cfg.parallelism
        self.dims = ParallelDims.from_config(par.data_parallel_replicate_degree, par.data_parallel_shard_degree, self.dist.world_size)
        self.dp_degree = self.dims.dp_degree
        self.ga_steps = gradient_accumulation_steps(cfg.training.global_batch_size, cfg.training.local_batch_size, self.dp_degree)
        self.global_batch_size = cfg.training.local_batch_size * self.ga_steps * self.dp_degree
        check_contrastive_problem(cfg, self.dp_degree, self.global_batch_size, contrastive=self.spec.build_step is None)
        self.precision = build_precision(cfg.training, fsdp=self.dims.fsdp_enabled, device=self.device)

        # 3. data (every rank is a DP rank: the DP rank is the global rank), laid out for the family
        self.data = data = build_data(  # a pretrained family brings its own tokenizer (spec.build_tokenizer)
            cfg.data, cfg.eval, seed=cfg.training.seed, build_bundled=build_dataset,
            family_tokenizer=lambda: self.spec.build_tokenizer(flavor_args) if self.spec.build_tokenizer else None,
            prepare=lambda ds: self.spec.layout.prepare(ds, flavor_args, cfg.data.image_sizes, cfg.model.name),
            local_batch_size=cfg.training.local_batch_size, dp_rank=self.dist.rank, dp_degree=self.dp_degree, pin_memory=self.device.type == "cuda",
            global_batch_size=self.global_batch_size)
        self.train_set, self.eval_set, self.loader = data.train_set, data.eval_set, data.loader

        # 4. model -> AC -> compile -> data parallelism; optimizer after sharding (DTensor params); the step
        self.model_args, self.model = build_run_model(self.spec, cfg, flavor_args, self.train_set, data.context_length, init_state=init_state,
                                                      param_dtype=self.precision.param_dtype, device=self.device)
        self.mesh = self.dims.build_mesh(self.device.type)
        self.dp_model = parallelize_model(
            self.model, self.spec.blocks(self.model), self.dims, self.mesh, device=self.device,
            ac_mode=cfg.activation_checkpoint.mode, compile_backend=cfg.compile.backend if cfg.compile.enable else None,
            param_dtype=self.precision.fsdp_param_dtype, reduce_dtype=self.precision.reduce_dtype,
        )
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.step_context = StepContext.for_run(cfg, self.spec, self.model, self.dp_model, self.precision, device=self.device,
                                                distributed=self.dist.is_distributed, dp_degree=self.dp_degree, ga_steps=self.ga_steps)
        self.gradient_step = build_gradient_step(self.spec, self.step_context, cfg, self.loss_name)
        self.train_state = TrainState()
        self.nonfinite = NonFiniteGuard(cfg.training.on_nonfinite, cfg.training.max_consecutive_skips)
        self.checkpointer = build_checkpointer(cfg, self.model, self.optimizer, self.lr_scheduler, self.train_state, self.loader,
                                               device=self.device, rank=self.dist.rank, dp_degree=self.dp_degree, model_args=self.model_args)
        self._log_start()
        self.checkpointer.preflight(checkpoint_bytes(self.model))
        report_unread_init_from(cfg.model.init_from, self.checkpointer.load(), self.resumed)
        self.metrics = MetricsProcessor.for_run(cfg, self.model_args, device=self.device, rank=self.dist.rank,  # after the checks above:
                                                world_size=self.dist.world_size)  # a run that fails them writes nothing
        self.memory_plan = self._plan_memory() if cfg.memory.budget_gib else None  # before any real step

    @property
    def step(self) -> int:
        return self.train_state.step

    def _log_start(self) -> None:
        cfg = self.cfg
        logger.info(f"data: {self.data.describe()}")
        logger.info(f"model: {cfg.model.name}/{cfg.model.flavor}  params {self.model_args.num_params():,}  training FLOPs/sample "
                    f"{f'{flops:.3e}' if (flops := self.model_args.flops_per_sample()) else 'n/a'} (encoders; loss excluded)  device {self.device}")
        logger.info(f"parallelism: {self.dims.mode} (replicate {self.dims.dp_replicate} x shard {self.dims.dp_shard})  "
                    f"params {cfg.training.dtype}  compute {self.precision.compute_dtype}  AC {cfg.activation_checkpoint.mode}  "
                    f"compile {cfg.compile.backend if cfg.compile.enable else 'off'}")
        logger.info(f"batch: local {cfg.training.local_batch_size}  x  grad-accum steps {self.ga_steps}  x  dp degree {self.dp_degree}  "
                    f"=  global {self.global_batch_size};  {self.gradient_step.describe()}")
        log_config_warnings(cfg)

    def _plan_memory(self) -> MemoryPlan:
        """The step's knobs, planned on probe steps (the planner restores every state); the step is rebuilt with them."""
        batches = probe_batches(self.train_set, local_batch_size=self.cfg.training.local_batch_size, ga_steps=self.ga_steps,
                                dp_degree=self.dp_degree, rank=self.dist.rank)

        def probe(knobs: dict[str, int]) -> None:
            self.gradient_step = build_gradient_step(self.spec, self.step_context, self.cfg, self.loss_name, knobs)
            self.train_step(batches)

        scaler = self.precision.scaler
        plan = plan_step(self.gradient_step.knobs(), probe, budget_gib=self.cfg.memory.budget_gib, margin=self.cfg.memory.margin,
                         device=self.device, model=self.model, optimizer=self.optimizer,
                         stateful=[self.model, self.optimizer, self.lr_scheduler, self.train_state, *([scaler] if scaler else [])])
        self.gradient_step = build_gradient_step(self.spec, self.step_context, self.cfg, self.loss_name, plan.chunks)
        return plan

    def forward(self, batch: dict[str, torch.Tensor], **kwargs: Any) -> Any:
        """The model's forward, this run's dtype and autocast, via the FSDP root / unwrapped DDP module (eval; not the train step)."""
        with self.precision.autocast():
            return self.model(*self.step_context.inputs(batch), **kwargs)

    def _clip_grad_norm(self) -> torch.Tensor:
        """Total gradient norm over all ranks (FSDP/HSDP shards included), clipped to max_norm."""
        if self.precision.scaler is not None:
            self.precision.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.training.max_norm if self.cfg.training.max_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=True)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def train_step(self, microbatches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """zero_grad -> the gradient step over k microbatches -> unscale/clip -> finite check -> step -> schedule."""
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.lr_scheduler.get_last_lr()[0]
        loss = self.gradient_step(microbatches)
        grad_norm = self._clip_grad_norm().item()
        step = self.train_state.step + 1
        # fp16: the scaler skips steps with inf/nan gradients itself (and says so): only the loss is checked here
        skipped = self.nonfinite.check(step, loss, grad_norm if self.precision.scaler is None else 0.0, self.train_state.skipped_steps)
        if skipped is None:
            skipped = self.precision.optimizer_step(self.optimizer, f"step {step}: float16 gradients overflowed (grad_norm={grad_norm})")
        with warnings.catch_warnings():  # a skipped step advances the schedule on purpose
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            self.lr_scheduler.step()
        self.train_state.skipped_steps += int(skipped)
        if (scale := getattr(self.model, "logit_scale", None)) is not None and scale.requires_grad:  # learned only: a fixed one stays
            with torch.no_grad():
                scale.clamp_(0, MAX_LOGIT_SCALE)
        self.train_state.step = step
        self.train_state.samples_seen += self.global_batch_size
        return {"loss": loss, "lr": lr, "grad_norm": grad_norm, "skipped_steps": self.train_state.skipped_steps}

    def next_microbatches(self, data_iter: Iterator[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        start = time.perf_counter()
        batches = [next(data_iter) for _ in range(self.ga_steps)]
        self.metrics.data_time += time.perf_counter() - start
        return batches

    def evaluate(self) -> dict[str, float]:
        """The family's evaluation (`ModelSpec.evaluate`) on the held-out split and on `eval.zero_shot_path`."""
        cfg = self.cfg
        return evaluate_sets(self.spec.evaluate, lambda ds: EvalContext(
            self.model, self.forward, ds, self.loss_name, cfg.eval.batch_size, self.device, self.dist.rank, self.dist.world_size,
            Path(cfg.job.dump_folder), self.step), self.data.eval_sets)

    def _measured_step(self, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """The first step under a memory plan goes through the probe (peak against the plan)."""
        return measured_first_step(self.memory_plan, lambda: self.train_step(batches), device=self.device, model=self.model,
                                   optimizer=self.optimizer, record=self.metrics.record, step_number=self.step + 1)

    def _evaluate_and_log(self, last: bool) -> dict[str, float]:
        start = time.perf_counter()
        results = self.evaluate()
        self.metrics.record("eval", self.step, results)
        logger.info(f"{'final ' if last else ''}eval step {self.step} {describe_results(results, self.data.eval_sets)} ({time.perf_counter() - start:.1f}s)")
        return results

    def train(self) -> dict[str, Any]:
        """The loop; a run resumed at its last step only evaluates (how a finished run is re-evaluated)."""
        cfg = self.cfg
        evaluates = cfg.eval.enable and any(ds is not None for ds in self.data.eval_sets.values())
        if self.step >= cfg.training.steps:  # nothing left to train (the checkpoint is at the last step)
            return self._evaluate_and_log(last=True) if evaluates else {}
        data_iter, resumed_at = iter(self.loader), self.step
        self.metrics.reset()
        results: dict[str, Any] = {}
        while self.step < cfg.training.steps:
            batches = self.next_microbatches(data_iter)
            out = self._measured_step(batches) if self.memory_plan and not self.memory_plan.checked else self.train_step(batches)
            if self.step == resumed_at + 1:  # start-up's longer timeout ends after this process's first step
                set_collective_timeout(cfg.comm.train_timeout_seconds)
            self.metrics.samples += self.global_batch_size
            last = self.step == cfg.training.steps
            stop = self.stop.agreed() if self.stop else None  # every rank after every step: all stop after the same one
            if self.step % cfg.metrics.log_freq == 0 or last or stop:
                self.metrics.log_train(self.step, **out, **self.gradient_step.log_values(), **self.loader.bad_samples.values())
            if stop:  # save the step just done, no evaluation first (the grace period is short)
                self.stopped_by = stop
                logger.info(stop_message(stop, self.step, self.checkpointer.maybe_save(self.step, last_step=True,
                                                                                        protect_before=self.nonfinite.streak_start)))
                break
            side_work = evaluates and (last or (cfg.eval.freq and self.step % cfg.eval.freq == 0))
            results = self._evaluate_and_log(last) if side_work else results  # eval and checkpoint time stay out of samples/s
            if self.checkpointer.maybe_save(self.step, last_step=last, protect_before=self.nonfinite.streak_start) or side_work:
                self.metrics.reset()
        return results


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[titan_contrastive] %(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout)
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    trainer, finished, lock, stop = None, False, RunLock(), StopSignals().install()
    try:
        trainer = Trainer(parse_args(argv), run_lock=lock, stop=stop)
        if trainer.cfg.memory.plan:  # dry run: the plan is logged, nothing is trained
            finished = True
            return 0
        start = time.perf_counter()
        trainer.train()
        finished = True
        if trainer.stopped_by is not None:
            return exit_codes.STOPPED
        logger.info(f"training done in {time.perf_counter() - start:.1f}s")
    except BaseException as e:  # noqa: BLE001 - a known failure is one line and its code; anything else propagates
        hint = (lambda: trainer.checkpointer.resume_hint(trainer.nonfinite.streak_start)) if trainer else str
        if (code := exit_codes.report(e, hint)) is None:
            raise
        return code
    finally:
        if trainer is not None:
            trainer.metrics.close()
            del trainer  # release FSDP2's collective state before the process group goes
            gc.collect()
        lock.release()
        destroy_distributed(barrier=finished)
        stop.restore()  # a signal until here only set a flag: the process exits with this function's code
    return 0


if __name__ == "__main__":
    sys.exit(main())
