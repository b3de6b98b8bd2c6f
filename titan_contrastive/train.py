"""The trainer: `python -m titan_contrastive.train --job.config_file F [--section.key=value ...]`.

It builds every component once from the config, everything that can fail on bad input first, then
runs the loop; it knows neither the step kind nor the model family. The order of operations and the
exit codes: docs/design.md#the-trainer.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from titan_contrastive import exit_codes, failures, models
from titan_contrastive.checkpoint import TrainState, build_checkpointer
from titan_contrastive.checkpoint.resume import model_source, report_unread_init_from
from titan_contrastive.components.early_stopping import EarlyStopping
from titan_contrastive.components.evaluate import (
    EvalContext,
    check_embedding_dims,
    describe_results,
    eval_mode,
    evaluate_sets,
)
from titan_contrastive.components.lr_scheduler import advance, build_lr_scheduler
from titan_contrastive.components.memory_planner import MemoryPlan, measured_first_step, plan_step, probe_batches
from titan_contrastive.components.metrics import MetricsProcessor, log_run_start
from titan_contrastive.components.nonfinite import NonFiniteGuard
from titan_contrastive.components.optimizer import build_optimizer, clip_grad_norm
from titan_contrastive.components.precision import build_precision
from titan_contrastive.components.preemption import StopSignals, stop_message
from titan_contrastive.components.preflight import check_output_folders, checkpoint_bytes
from titan_contrastive.components.profiling import StepProfiler
from titan_contrastive.components.run_lock import RunLock
from titan_contrastive.components.text_evals import TextEvals
from titan_contrastive.config import JobConfig, parse_args, run_steps
from titan_contrastive.config.manager import check_contrastive_problem, log_config_warnings
from titan_contrastive.datasets import build_dataset
from titan_contrastive.datasets.build import build_data
from titan_contrastive.models.build import build_run_model, clamp_logit_scale, run_objectives
from titan_contrastive.parallelisms import (
    ParallelDims,
    destroy_distributed,
    gradient_accumulation_steps,
    host_group,
    init_distributed,
    parallelize_model,
    set_collective_timeout,
)
from titan_contrastive.steps import StepContext, build_gradient_step

logger = logging.getLogger("titan_contrastive")


class Trainer:
    """Builds every component from a JobConfig and runs the training loop; `run_lock` and `stop`: see `main`."""

    def __init__(self, cfg: JobConfig, run_lock: RunLock | None = None, stop: StopSignals | None = None) -> None:
        # 1. the process group, writable output folders, the run lock, seeds
        self.cfg, self.stop, self.stopped_by = cfg, stop, None
        self.dist = dist = init_distributed(
            cfg.training.device, cfg.comm.init_timeout_seconds, one_device_group=cfg.parallelism.fsdp_one_device
        )
        self.device = device = dist.device
        self.profiler = StepProfiler.for_run(cfg, dist.rank, device)  # a memory snapshot on CPU: refused here
        check_output_folders(cfg.job.dump_folder, cfg.checkpoint, dist.rank == 0)
        if run_lock is not None:
            run_lock.acquire(cfg.job.dump_folder, rank=dist.rank, distributed=dist.is_distributed)
        torch.manual_seed(cfg.training.seed)
        torch.use_deterministic_algorithms(cfg.training.deterministic)

        # 2. model family and its loss, DP layout, batch arithmetic: checked before data or compute
        if cfg.job.custom_import:
            importlib.import_module(cfg.job.custom_import)
        self.spec = spec = models.get_model_spec(cfg.model.name)
        flavor_args, init_state, self.resumed = model_source(cfg, spec, models.resolve_model_args)
        flavor_args = models.configured(flavor_args, cfg, spec)  # before the family's tokenizer reads them
        self.objective, self.eval_objective = run_objectives(spec, cfg, flavor_args)
        self.dims = dims = ParallelDims.for_run(cfg.parallelism, dist.world_size)
        self.dp_degree = dp = dims.dp_degree
        self.ga_steps = gradient_accumulation_steps(cfg.training.global_batch_size, cfg.training.local_batch_size, dp)
        self.global_batch_size = cfg.training.local_batch_size * self.ga_steps * dp
        check_contrastive_problem(cfg, dp, self.global_batch_size, contrastive=spec.build_step is None)
        self.precision = precision = build_precision(cfg.training, fsdp=dims.fsdp_enabled, device=device)

        # 3. data (every rank a DP rank: the DP rank is the global rank), laid out for the family (its own tokenizer)
        self.data = data = build_data(
            cfg,
            family_tokenizer=lambda: spec.build_tokenizer(flavor_args) if spec.build_tokenizer else None,
            prepare=lambda ds: spec.layout.prepare(ds, flavor_args, cfg.data.image_sizes, cfg.model.name),
            build_bundled=build_dataset,
            dp_rank=dist.rank,
            dp_degree=dp,
            pin_memory=device.type == "cuda",
            global_batch_size=self.global_batch_size,
            pixels_on_device=device.type == "cuda" and cfg.data.pixels_on_device,
            host_group=host_group,  # the ranks share the tokenization of text pairs
        )
        self.train_set, self.eval_set, self.loader = data.train_set, data.eval_set, data.loader
        self.profiler.last_step, self.eval_due = run_steps(cfg, data.loader.steps_per_epoch, self.ga_steps)
        self.text_evals = TextEvals.from_config(cfg.eval, self.forward, self.train_set.tokenizer, flavor_args)

        # 4. model -> AC -> compile -> data parallelism; optimizer after sharding (DTensor params); the step
        dtype = precision.param_dtype
        self.model_args, self.model, guide = build_run_model(spec, cfg, flavor_args, data, init_state, dtype, device)
        self.objective, self.eval_objective = run_objectives(spec, cfg, flavor_args, guide, data.frozen)  # its own tau
        model, self.mesh = self.model, dims.build_mesh(device.type)
        self.dp_model = parallelize_model(model, spec.blocks(model), dims, self.mesh, cfg, precision, device)
        self.optimizer = build_optimizer(model, cfg.optimizer, spec.towers)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.step_context = StepContext.for_run(
            cfg, spec, model, self.dp_model, precision, dist, dp, self.ga_steps, data.device_transforms, guide
        )
        self.gradient_step = build_gradient_step(spec, self.step_context, cfg, self.objective)
        self.train_state = TrainState()
        self.nonfinite = NonFiniteGuard(cfg.training.on_nonfinite, cfg.training.max_consecutive_skips)
        self.patience = EarlyStopping.for_run(cfg)  # [eval] patience: its count is checkpointed
        states = (model, self.optimizer, self.lr_scheduler, self.train_state, self.loader, self.patience)
        self.checkpointer = build_checkpointer(cfg, *states, dp, self.ga_steps, dist=dist, model_args=self.model_args)
        log_run_start(cfg, data, self.model_args, dist, dims, precision, self.ga_steps, self.gradient_step)
        log_config_warnings(cfg)
        self.checkpointer.preflight(checkpoint_bytes(model))
        report_unread_init_from(cfg.model.init_from, self.checkpointer.load(), self.resumed)
        if self.objective is not None:  # Matryoshka prefixes and eval cuts that the embeddings are too short for
            dims = {"loss.matryoshka_dims": cfg.loss.matryoshka_dims, "eval.dims": cfg.eval.dims}
            check_embedding_dims(self.model, self.forward, self.eval_set or self.train_set, dims, self.objective)
        self.metrics = MetricsProcessor.for_run(cfg, self.model_args, dist, resumed=self.step > 0)  # after the checks
        self.memory_plan = self._plan_memory() if cfg.memory.budget_gib else None  # before any real step

    @property
    def step(self) -> int:
        return self.train_state.step

    def _plan_memory(self) -> MemoryPlan:
        """The step's knobs planned on probe steps (the planner restores every state); the step rebuilt with them."""
        cfg, rank = self.cfg, self.dist.rank
        build = functools.partial(build_gradient_step, self.spec, self.step_context, cfg, self.objective)
        batches = probe_batches(self.train_set, cfg.training.local_batch_size, self.ga_steps, self.dp_degree, rank)

        def probe(knobs: dict[str, int]) -> None:
            self.gradient_step = build(knobs)
            self.train_step(batches)

        states = [self.model, self.optimizer, self.lr_scheduler, self.train_state, self.precision.scaler]
        plan = plan_step(self.gradient_step.knobs(), probe, cfg.memory, self.device, self.model, self.optimizer, states)
        self.gradient_step = build(plan.chunks)
        return plan

    def forward(self, batch: dict[str, torch.Tensor], **kwargs: Any) -> Any:
        """The model's forward in this run's dtype and autocast (evaluation: held-out hard negatives stay out)."""
        with self.precision.autocast():
            return self.model(*self.step_context.inputs(batch, negatives=False), **kwargs)

    def train_step(self, microbatches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """zero_grad -> the gradient step over k microbatches -> unscale/clip -> finite check -> step -> schedule."""
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.lr_scheduler.get_last_lr()[0]
        self.step_context.step = self.train_state.step
        loss = self.gradient_step(microbatches)
        grad_norm = clip_grad_norm(self.model, self.cfg.training.max_norm, self.optimizer, self.precision.scaler)
        step = self.train_state.step + 1
        # fp16: the scaler skips steps with inf/nan gradients itself (and says so): only the loss is checked here
        skipped = self.nonfinite.check(
            step, loss, grad_norm if self.precision.scaler is None else 0.0, self.train_state.skipped_steps
        )
        self.checkpointer.wait_for_staging()  # a background save's copy of the state is complete before it changes
        if skipped is None:
            skipped = self.precision.optimizer_step(
                self.optimizer, f"step {step}: float16 gradients overflowed (grad_norm={grad_norm})"
            )
        advance(self.lr_scheduler)  # a skipped step advances the schedule too
        clamp_logit_scale(self.model)
        self.train_state.advance(self.global_batch_size, skipped)
        return {"loss": loss, "lr": lr, "grad_norm": grad_norm, "skipped_steps": self.train_state.skipped_steps}

    def next_microbatches(self, data_iter: Iterator[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        start, batches = time.perf_counter(), [next(data_iter) for _ in range(self.ga_steps)]  # in this order
        self.metrics.data_time += time.perf_counter() - start
        return batches

    def evaluate(self) -> dict[str, float]:
        """The family's evaluation (`ModelSpec.evaluate`) on the held-out split and on `eval.zero_shot_path`."""
        cfg, dist = self.cfg, self.dist
        run = (cfg.eval.batch_size, self.device, dist.rank, dist.world_size, Path(cfg.job.dump_folder), self.step)
        contexts = functools.partial(EvalContext, self.model, self.forward, layers=tuple(cfg.loss.adaptive_layers))
        objective, dims = self.eval_objective, tuple(cfg.eval.dims or cfg.loss.matryoshka_dims)
        results = evaluate_sets(self.spec.evaluate, lambda ds: contexts(ds, objective, *run, dims), self.data.eval_sets)
        if self.text_evals:
            with eval_mode(self.model):  # a text-pair model's query length (qwen_vl's templates hold theirs)
                length, sizes = getattr(self.model_args, "query_length", 0), {"batch_size": run[0], "dims": dims}
                results.update(self.text_evals(length, **sizes, rank=run[2], world_size=run[3], model=self.model))
        return results

    def _evaluate_and_log(self, last: bool) -> dict[str, float]:
        start = time.perf_counter()
        results = self.evaluate()
        self.metrics.record("eval", self.step, results)
        described, seconds = describe_results(results, self.data.eval_sets), time.perf_counter() - start
        logger.info(f"{'final ' if last else ''}eval step {self.step} {described} ({seconds:.1f}s)")
        return results

    def _step(self, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """A train step; the first one under a memory plan is measured against the plan (its peak is logged)."""
        if self.memory_plan is None or self.memory_plan.checked:
            return self.train_step(batches)
        return measured_first_step(
            self.memory_plan,
            lambda: self.train_step(batches),
            device=self.device,
            model=self.model,
            optimizer=self.optimizer,
            record=self.metrics.record,
            step_number=self.step + 1,
        )

    def train(self) -> dict[str, Any]:
        """The loop; a run resumed at its last step, or where it stopped early, only evaluates again."""
        cfg = self.cfg
        held_out = [s for s in self.data.eval_sets.values() if s is not None]
        evaluates = cfg.eval.enable and bool(self.text_evals or held_out)
        if self.step >= cfg.training.steps or (self.patience and self.patience.stopped):  # nothing left to train
            return self._evaluate_and_log(last=True) if evaluates else {}
        data_iter, resumed_at, results = iter(self.loader), self.step, {}
        self.metrics.reset()
        with self.profiler.loop(first_step=self.step + 1):
            while self.step < cfg.training.steps:
                out = self._step(self.next_microbatches(data_iter))
                if self.step == resumed_at + 1:  # start-up's longer timeout ends after this process's first step
                    set_collective_timeout(cfg.comm.train_timeout_seconds)
                self.metrics.add_step(self.global_batch_size, out["loss"], self.loader.step_source)
                last = self.step == cfg.training.steps
                stop = self.stop.agreed() if self.stop else None  # every rank: all stop after the same step
                protect = self.nonfinite.streak_start  # pruning spares the last checkpoint before skipped steps began
                if self.step % cfg.metrics.log_freq == 0 or last or stop:
                    self.metrics.log_train(
                        self.step, **out, **self.gradient_step.log_values(), **self.loader.bad_samples.values()
                    )
                if stop:  # save the step just done, no evaluation first (the grace period is short)
                    self.stopped_by = stop
                    saved = self.checkpointer.maybe_save(self.step, last_step=True, protect_before=protect)
                    logger.info(stop_message(stop, self.step, saved))
                    break
                side_work = evaluates and (last or self.eval_due(self.step))
                results = self._evaluate_and_log(last) if side_work else results
                scored = results if side_work else None  # recorded in this step's checkpoint ([checkpoint] keep_best)
                early = bool(scored and self.patience and self.patience.update(self.step, scored))  # logs, saves last
                saved = self.checkpointer.maybe_save(
                    self.step, last_step=last or early, protect_before=protect, evaluation=scored
                )
                if early:
                    break
                if saved or side_work:  # eval and checkpoint time stay out of samples/s
                    self.metrics.reset()
                self.profiler.step()  # a traced step: its data, its step, its logging, evaluation, checkpoint
        self.loader.end_workers()  # no worker outlives the loop (a further train() starts new ones where they were)
        return results


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="[titan_contrastive] %(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout
    )
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
        if (code := failures.report(e, hint)) is None:
            raise
        return code
    finally:
        if trainer is not None:
            trainer.metrics.close()
            del trainer  # destroy_distributed frees FSDP2's collective state before the process group goes
        lock.release()
        destroy_distributed(barrier=finished)
        stop.restore()  # a signal until here only set a flag: the process exits with this function's code
    return 0


if __name__ == "__main__":
    sys.exit(main())
