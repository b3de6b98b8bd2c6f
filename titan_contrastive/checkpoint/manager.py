"""Atomic, validated, resumable checkpoints with torch.distributed.checkpoint (DCP).

Layout: `{dump_folder}/{checkpoint.folder}/step-{N}/`, one DCP directory per checkpoint plus a
`manifest.json` ({"step", "dp_degree", "world_size", "files": {relative path: {"bytes", "sha256"}},
"model": {"family", "args"}}, the architecture `models.weights.read_ours` rebuilds the model from,
and "config", the run's config, which a resume compares with its own: `resume.py`).

A save is atomic: DCP writes into `step-N.tmp`, then (after a barrier) rank 0 writes the manifest, fsyncs
it and renames the folder to `step-N` (`writer.py`, which also finishes a save in the background under an
`async_mode`). A crash mid-save therefore leaves only a `.tmp` folder, which loading reports, ignores and
removes. Loading goes through `reader.py`, as every reader of a checkpoint does: the checkpoint is first
checked against its manifest (every file present with its size, then its SHA-256), so a truncated,
half-deleted or corrupted-in-place one (flipped bytes, same size) is reported with the file's name and
skipped in favour of the previous valid one (or is an error when asked for by `checkpoint.load_step`);
then it is read without running code from it (allowlisting unpicklers; the trust model is in
`reader.py`). Manifests that record sizes only (no checksums) are still read, with a warning.

Global states (model, optimizer, LR scheduler, train state) are saved once: DCP deduplicates replicated
entries and shards DTensors, so FSDP2 runs reshard on load to another world size. Per-rank states (data
loader position, RNG) differ between data-parallel ranks, so each is stored under `{name}/dp_rank_{r}`,
pickled into one bytes object: its nested structure (the StatefulDataLoader's state has None-or-dict
fields) then need not match the structure of a fresh object at load time, which DCP would otherwise
require. The bytes are unpickled with an allowlist of the globals such a state names
(`reader.unpickle_state`), never with `pickle.loads`. A run on another data-parallel degree maps them onto its
ranks (`reshard.py`): the data continues in the order the saving run would have taken it.

A `load_step` older than the newest checkpoint is a rewind: the newer checkpoints are moved aside
(not deleted) into `abandoned-<time>-<random>/`, so the next auto-resume continues the new history rather
than the abandoned one. Pruning (`keep_latest_k`) spares the newest checkpoint written before a
run of skipped non-finite steps began (`protect_before`), so a run stuck on non-finite steps does
not prune its last good state away, nor the best checkpoint by `keep_best` (`best.py`: a save at an
evaluated step records the evaluation in its manifest, `"eval"`). Saving needs room: `preflight`
fails before step 1 when the folder cannot hold one checkpoint of the estimated size, and a save
that runs out of space says "no space left on device" with the folder and removes its partial files.

Fault injection (for tests): with the environment variable `TITAN_CONTRASTIVE_FAULT` set to
`kill_during_save@<step>`, rank 0 sends itself SIGKILL during the save of that step, after DCP
has written the files into `step-<step>.tmp` and before the manifest and the rename: exactly
the state a crash mid-save leaves behind.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import signal
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful

from titan_contrastive.checkpoint import reader
from titan_contrastive.checkpoint.best import BestCheckpoint
from titan_contrastive.checkpoint.best import scores as eval_scores
from titan_contrastive.checkpoint.reader import MANIFEST, CheckpointError
from titan_contrastive.checkpoint.reshard import reshard_for
from titan_contrastive.checkpoint.resume import IncompatibleResume, config_changes
from titan_contrastive.checkpoint.writer import (
    BackgroundSave,
    PickledState,
    failing_as,
    fsync_dir,
    install,
    out_of_space,
    reused_stager,
    stager_survives_reuse,
    write_manifest,
    written,
)
from titan_contrastive.components.preflight import format_bytes, free_bytes

__all__ = ["CheckpointError", "CheckpointManager", "FAULT_ENV", "MANIFEST"]

logger = logging.getLogger("titan_contrastive")

FAULT_ENV = "TITAN_CONTRASTIVE_FAULT"
_STEP_DIR = re.compile(r"step-(\d+)")
_TMP_DIR = re.compile(r"step-(\d+)\.tmp")
T = TypeVar("T")
OPTIONAL_STATES = ("early_stopping",)
"""States a checkpoint may lack (one saved before they were kept, or by a run without them): theirs start fresh."""
# one process saves with no_dist=True on purpose (and a background save warns in its own thread)
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class CheckpointConfig(Protocol):
    """The `[checkpoint]` config section (see `config.job_config.Checkpoint`)."""

    enable: bool
    folder: str
    interval: int
    keep_latest_k: int
    keep_best: str
    load_step: int
    async_mode: str


class CheckpointManager:
    """Saves and restores `states` (global) and `per_rank_states` (per data-parallel rank).

    Collective under torch.distributed: every rank calls `maybe_save`/`save`/`load` at the same
    step. Rank 0 alone touches the folder structure (manifest, rename, pruning, cleanup, choice of
    the checkpoint to load) and shares the outcome, so all ranks load the same checkpoint and
    raise the same error rather than some of them waiting forever in a collective.
    Assumes a filesystem shared by all ranks, as DCP's FileSystemWriter does.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        *,
        dump_folder: str,
        states: dict[str, Stateful],
        per_rank_states: dict[str, Stateful],
        rank: int,
        dp_rank: int,
        dp_degree: int,
        model_info: dict[str, Any] | None = None,
        run_config: dict[str, Any] | None = None,
        due: Callable[[int], bool] | None = None,
    ) -> None:
        self.cfg = cfg
        self.due = due or (lambda step: step % cfg.interval == 0)  # the steps saved on (`config.epochs.every`)
        self.model_info = model_info  # {"family", "args"}: what `models.weights.read_ours` rebuilds the model from
        self.run_config = run_config  # {section: {key: value}}: what a resume compares its config with
        self.folder = Path(dump_folder) / cfg.folder
        self.best = BestCheckpoint(cfg.keep_best) if cfg.keep_best else None
        self.states = states
        self.per_rank_states = per_rank_states
        self.rank = rank
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.background = cfg.enable and cfg.async_mode != "disabled"
        self._pending = BackgroundSave()
        self._staging: str | None = None  # what the pinned mode's copy in flight saves
        self._pinned = self.background and cfg.async_mode == "async_with_pinned_mem"
        self._stager: DefaultStager | None = None  # made at the first pinned save, once the step used the device
        self._stager_per_save = self._pinned and not stager_survives_reuse()  # torch 2.11 (`writer.py`)
        # the background saves' collectives (DCP's, the barrier, the outcome) on a group of their own
        self._save_group = dist.new_group(backend="gloo") if self.background and self._distributed() else None

    # ------------------------------------------------------------------ public API

    def preflight(self, estimated_bytes: int) -> None:
        """Before step 1: fail when the folder cannot hold one checkpoint of about `estimated_bytes`,
        warn when it cannot hold the `keep_latest_k` + 1 that exist during a save (rank 0 logs)."""
        if not self.cfg.enable:
            return
        free = free_bytes(self.folder)
        if free < estimated_bytes:
            raise CheckpointError(
                f"checkpoint.folder={self.folder}: {format_bytes(free)} free, a checkpoint of this run needs about "
                f"{format_bytes(estimated_bytes)}; free space there or set checkpoint.folder (or job.dump_folder) "
                "elsewhere"
            )
        kept = self.cfg.keep_latest_k + 1 if self.cfg.keep_latest_k else 0
        if self.rank == 0:
            logger.info(
                f"checkpoints: about {format_bytes(estimated_bytes)} each in {self.folder} ({format_bytes(free)} free)"
            )
            if kept and free < kept * estimated_bytes:
                logger.warning(
                    f"checkpoint.folder={self.folder}: {format_bytes(free)} free holds fewer than the {kept} "
                    "checkpoints "
                    f"that exist during a save with keep_latest_k={self.cfg.keep_latest_k}; a later save may run out "
                    "of space"
                )

    @torch.profiler.record_function("CheckpointManager.maybe_save")  # a named span in [profiling] traces
    def maybe_save(
        self,
        step: int,
        *,
        last_step: bool = False,
        protect_before: int | None = None,
        evaluation: dict[str, Any] | None = None,
    ) -> bool:
        """Save when enabled and `step` is due (`due`: on `interval`) or the last one; return whether it saved.
        `evaluation`: the results of the evaluation at this step, if it was evaluated. With an
        `async_mode` an interval's save finishes in the background, the last one does not."""
        if not self.cfg.enable or not (last_step or self.due(step)):
            return False
        self.save(step, protect_before=protect_before, evaluation=evaluation, background=not last_step)
        return True

    def save(
        self,
        step: int,
        *,
        protect_before: int | None = None,
        evaluation: dict[str, Any] | None = None,
        background: bool = False,
    ) -> None:
        """Write checkpoint `step-{step}` atomically (collective), its manifest recording `evaluation`'s
        numbers under `keep_best`; then prune to `keep_latest_k`, sparing the newest checkpoint older than
        step `protect_before` when given and the best (see module doc). `background` (with an
        `async_mode`): return once the state is copied to host memory (`async_with_pinned_mem`: once the
        copy started; `wait_for_staging` before the state changes); the rest follows in a thread
        (`writer.py`), and the next save (or `wait`) raises its error."""
        self.wait()  # an earlier background save is complete (or raises) before this one starts
        scores = None if evaluation is None else self.best.scores(evaluation) if self.best else eval_scores(evaluation)
        start = time.perf_counter()
        tmp, final = self.folder / f"step-{step}.tmp", self.folder / f"step-{step}"
        self._on_rank0(lambda: self._prepare(tmp), f"preparing {tmp}")
        what = f"saving checkpoint step-{step} ({tmp})"
        complete = functools.partial(self._complete, step, tmp, final, protect_before, scores, start)
        if not (background and self.background):
            self._write(step, tmp, lambda: self._dcp(dcp.save, tmp, what))
            complete()
            return
        if self._pinned and (self._stager is None or self._stager_per_save):
            if self._stager is not None:  # torch 2.11: the save before is written (the wait above)
                self._stager.close()
            self._stager = reused_stager()
        if self._stager is not None and torch.cuda.is_available():
            torch.cuda.synchronize()  # the stager's stream copies the state once the step's kernels wrote it
        save = functools.partial(dcp.async_save, process_group=self._save_group, async_stager=self._stager)
        future = self._write(step, tmp, lambda: self._dcp(save, tmp, what))  # copied, or its copy started
        if isinstance(future, AsyncSaveResponse):  # the pinned mode: the copy goes on beside the next step
            self._staging, future = what, future.upload_completion
        if self.rank == 0:
            copied, seconds = "copy started" if self._staging else "copied", time.perf_counter() - start
            logger.info(f"checkpoint step-{step}: state {copied} in {seconds:.2f}s, writing it")

        def in_background(group: dist.ProcessGroup | None = self._save_group) -> None:
            self._write(step, tmp, functools.partial(written, future, what), group)
            complete(group)

        self._pending.start(in_background)

    def wait_for_staging(self) -> None:
        """Block until the pinned mode's host copy of a background save is complete: the training loop calls
        this before the state changes (the optimizer step); the copy's error is raised as a CheckpointError."""
        if self._staging is not None and self._stager is not None:
            what, self._staging = self._staging, None
            with failing_as(what):  # the stager's own future: `staging_completion` reports a copy that
                self._stager.synchronize_staging()  # failed before `async_save` returned as a success

    def wait(self) -> None:
        """Block until a background save is complete; raise its error (CheckpointError) if it failed."""
        self.wait_for_staging()
        self._pending.wait()

    def load(self) -> int | None:
        """Restore `checkpoint.load_step`, or the latest valid checkpoint when it is -1.

        Returns the step restored; None when disabled or when the folder holds no complete
        checkpoint. Raises CheckpointError for a missing or corrupt `load_step`, when every
        complete checkpoint is corrupt, for per-rank states that cannot be mapped onto this data-parallel degree
        (`reshard.py`), and when DCP fails or the checkpoint holds more than plain data (`reader.py`)."""
        if not self.cfg.enable:
            return None
        chosen = self._on_rank0(self._choose, f"choosing a checkpoint in {self.folder}")
        if chosen is None:
            if self.rank == 0:
                logger.info(f"no checkpoint in {self.folder}; starting from scratch")
            return None
        step, manifest, changes = chosen
        path = self.folder / f"step-{step}"
        reshard = reshard_for(self.per_rank_states, manifest, self.dp_degree, step, self.run_config)
        reader.load(
            self._dcp_state() if reshard is None else {**self.states, **reshard.dcp_state()},
            path,
            manifest,
            what=f"loading checkpoint step-{step} ({path})",
            distributed=self._distributed(),
            optional=OPTIONAL_STATES,
        )
        if reshard is not None:
            reshard.apply(self.dp_rank)
        if self.rank == 0:
            logger.info(f"resumed from checkpoint step-{step} ({path})")
            if "config" not in manifest:
                logger.info(f"checkpoint step-{step} predates config records: config changes since it cannot be listed")
            for change in changes:
                logger.info(f"resume: config changed since step-{step}, applied: {change}")
        return step

    def resume_hint(self, before_step: int | None) -> str:
        """'; that is checkpoint step-N (...)': the newest checkpoint older than `before_step`, if any."""
        older = [s for s in self.available_steps() if before_step is not None and s < before_step]
        return (
            f"; that is checkpoint step-{older[-1]} (--checkpoint.load_step={older[-1]})"
            if self.cfg.enable and older
            else ""
        )

    def available_steps(self) -> list[int]:
        """Steps of the complete (renamed) checkpoints, sorted; `load` still validates them."""
        return sorted(int(m[1]) for m in self._entries(_STEP_DIR))

    def _write(self, step: int, tmp: Path, write: Callable[[], T], group: dist.ProcessGroup | None = None) -> T:
        """`write()` (the DCP files into `tmp`); when it fails, `tmp` is removed and a full disk is named
        as such. `group`: the collectives' group."""
        try:
            return write()
        except CheckpointError as exc:  # nothing half-written stays behind; a full disk is named as such
            full = out_of_space(exc, self.folder)
            self._on_rank0(lambda: shutil.rmtree(tmp, ignore_errors=True), f"removing {tmp}", group)
            if full:
                raise CheckpointError(
                    f"saving checkpoint step-{step} failed: no space left on device in {self.folder} "
                    f"({format_bytes(free_bytes(self.folder))} free after removing the partial save); free space, "
                    "lower checkpoint.keep_latest_k or set checkpoint.folder elsewhere, then resume from the last "
                    "checkpoint"
                ) from exc
            raise

    def _complete(
        self,
        step: int,
        tmp: Path,
        final: Path,
        protect_before: int | None,
        scores: dict[str, float] | None,
        start: float,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """After every rank's files are in `tmp` (a barrier): rank 0's manifest, rename and pruning."""
        if self.rank == 0 and os.environ.get(FAULT_ENV, "") == f"kill_during_save@{step}":
            os.kill(os.getpid(), signal.SIGKILL)
        self._barrier(group)  # every rank's files are in tmp before rank 0 lists them
        # the broadcast of the outcome is the closing barrier: no rank moves on before the rename
        self._on_rank0(
            lambda: self._finalize(step, tmp, final, protect_before, scores), f"finalizing checkpoint {final}", group
        )
        if self.rank == 0:
            logger.info(f"saved checkpoint step-{step} to {final} in {time.perf_counter() - start:.2f}s")

    # ------------------------------------------------------------------ rank 0 work

    def _prepare(self, tmp: Path) -> None:
        if tmp.exists():  # left over from an interrupted save of this step
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)

    def _finalize(
        self, step: int, tmp: Path, final: Path, protect_before: int | None, scores: dict[str, float] | None
    ) -> None:
        record = {
            "step": step,
            "dp_degree": self.dp_degree,
            "world_size": dist.get_world_size() if self._distributed() else 1,
            **({"model": self.model_info} if self.model_info else {}),
            **({"config": self.run_config} if self.run_config else {}),
            **({"eval": scores} if scores is not None else {}),
        }
        write_manifest(tmp, record)
        install(tmp, final)
        best = self._write_best()
        if self.cfg.keep_latest_k > 0:
            steps = self.available_steps()
            spared = max((s for s in steps if protect_before is not None and s < protect_before), default=None)
            for old in steps[: -self.cfg.keep_latest_k]:
                if old == spared:
                    logger.info(
                        f"keeping checkpoint step-{old} beyond keep_latest_k: the last one before the non-finite steps"
                    )
                elif best is not None and old == best[0]:
                    logger.info(f"keeping checkpoint step-{old} beyond keep_latest_k: the best by {self.best.metric}")
                else:
                    shutil.rmtree(self.folder / f"step-{old}", ignore_errors=True)

    def _write_best(self) -> tuple[int, float] | None:
        """The best checkpoint by `keep_best` among those present, named in `best.json` (None when off)."""
        if self.best is None:
            return None
        best = self.best.best(self.folder, self.available_steps())
        self.best.write(self.folder, best)
        if best is not None:
            logger.info(f"best checkpoint by {self.best.metric}: step-{best[0]} ({best[1]:.6g})")
        return best

    def _compatible(self, step: int, manifest: dict[str, Any]) -> list[str]:
        """The config changes to apply since `step` (`resume.py`); CheckpointError when the run
        cannot continue it (per-rank states it cannot map onto its ranks, another model or trainable set)."""
        reshard_for(self.per_rank_states, manifest, self.dp_degree, step, self.run_config)  # refused here
        try:
            return config_changes(step, manifest, self.run_config, self.model_info)
        except IncompatibleResume as exc:
            raise CheckpointError(str(exc)) from None

    def _choose(self) -> tuple[int, dict[str, Any], list[str]] | None:
        """(step, manifest, config changes) of the checkpoint to load, or None; warns about what it
        skips; a `load_step` rewind moves the newer checkpoints aside once the run can continue it."""
        for match in self._entries(_TMP_DIR):
            path = self.folder / match[0]
            logger.warning(f"incomplete checkpoint {path} (interrupted save) ignored and removed")
            shutil.rmtree(path, ignore_errors=True)
        steps = self.available_steps()
        wanted = self.cfg.load_step
        if wanted >= 0:
            if wanted not in steps:
                raise CheckpointError(
                    f"checkpoint.load_step={wanted} not found in {self.folder}; available steps: {steps}"
                )
            manifest, problem = self._validate(wanted)
            if manifest is None:
                raise CheckpointError(
                    f"checkpoint step-{wanted} ({self.folder / f'step-{wanted}'}) is corrupt: {problem}"
                )
            changes = self._compatible(wanted, manifest)
            self._set_aside([s for s in steps if s > wanted], wanted)
            return wanted, manifest, changes
        problems = []
        for step in reversed(steps):
            manifest, problem = self._validate(step)
            if manifest is not None:
                return step, manifest, self._compatible(step, manifest)
            logger.warning(f"checkpoint step-{step} ({self.folder / f'step-{step}'}) is corrupt: {problem}; skipped")
            problems.append(f"step-{step}: {problem}")
        if problems:  # resuming was expected; silently starting over would later prune these
            raise CheckpointError(
                f"no valid checkpoint in {self.folder} ({'; '.join(problems)}); repair or move them, "
                "or start a new run (set checkpoint.folder to a new folder)"
            )
        return None

    def _set_aside(self, newer: list[int], wanted: int) -> None:
        """Move the checkpoints after a rewind target into `abandoned-<time>/` (kept, never loaded)."""
        if not newer:
            return
        aside = Path(tempfile.mkdtemp(prefix=f"abandoned-{time.strftime('%Y%m%d-%H%M%S')}-", dir=self.folder))
        for step in newer:
            os.replace(self.folder / f"step-{step}", aside / f"step-{step}")
        fsync_dir(self.folder)
        self._write_best()  # best.json names a checkpoint still in the folder
        logger.warning(
            f"checkpoint.load_step={wanted} rewinds the run: the newer checkpoints "
            f"{', '.join(f'step-{s}' for s in newer)} were moved to {aside} (not deleted), so later "
            "resumes continue from here; move them back to return to that history"
        )

    def _validate(self, step: int) -> tuple[dict[str, Any] | None, str]:
        """(manifest, "") for a checkpoint that matches its manifest, else (None, what is wrong)."""
        return reader.validate(self.folder / f"step-{step}", step)

    # ------------------------------------------------------------------ helpers

    def _entries(self, pattern: re.Pattern[str]) -> list[re.Match[str]]:
        if not self.folder.is_dir():
            return []
        return [m for p in self.folder.iterdir() if p.is_dir() and (m := pattern.fullmatch(p.name))]

    def _dcp_state(self) -> dict[str, Stateful]:
        state = dict(self.states)
        for name, stateful in self.per_rank_states.items():
            key = f"{name}/dp_rank_{self.dp_rank}"
            state[key] = PickledState(stateful, f"{key}.pickle")
        return state

    def _dcp(self, fn: Callable[..., T], path: Path, what: str) -> T:
        """dcp.save or dcp.async_save of the state into `path`, failing as `failing_as` says."""
        with failing_as(what):
            return fn(self._dcp_state(), checkpoint_id=str(path), no_dist=not self._distributed())

    @staticmethod
    def _distributed() -> bool:
        return dist.is_available() and dist.is_initialized()

    def _barrier(self, group: dist.ProcessGroup | None = None) -> None:
        if self._distributed():
            dist.barrier(group=group)

    def _on_rank0(self, fn: Callable[[], T], what: str, group: dist.ProcessGroup | None = None) -> T:
        """Run `fn` on rank 0 and give its result, or its error as a CheckpointError, to every rank."""
        result: Any = None
        error: str | None = None
        cause: BaseException | None = None
        if self.rank == 0:
            try:
                result = fn()
            except Exception as exc:  # shared, or the other ranks would wait forever in the broadcast
                cause = exc
                error = str(exc) if isinstance(exc, CheckpointError) else f"{what} failed: {type(exc).__name__}: {exc}"
        if self._distributed():
            box = [(result, error)]
            dist.broadcast_object_list(box, src=0, group=group)
            result, error = box[0]
        if error is not None:
            raise CheckpointError(error) from cause
        return result
