"""Resume semantics: what a resumed run takes from its checkpoint, and what from its config.

From the checkpoint: model weights; optimizer moments and step counts; each data-parallel rank's
data position and RNG streams (mapped onto another number of ranks: `reshard.py`); the train state (step,
samples seen, skipped steps).

From the config (a change since the save is applied, and logged as `key: old -> new`): learning
rate and schedule (warmup, decay, min_lr_factor, training.steps: the lr is recomputed at the
restored step); AdamW betas, eps, weight decay; max_norm; global batch size (accumulation steps);
on_nonfinite and its limit; model.patch_dropout and trust_remote_code (`TRAINING_ARGS`); logging, eval,
checkpoint interval and keep; timeouts; everything else not below.

Must agree (a change is a one-line error before anything is loaded): the model (family and
architecture args, LoRA's rank and target modules among them); which parameters train
(model.freeze, unlocked_layers: they decide which have optimizer state); optimizer.layer_decay and
static_query_lr (the optimizer's parameter groups). The data-parallel degree and the local batch may change: the
data position is mapped onto them (`reshard.py`).

Why a change is applied rather than refused: lowering the lr after a loss spike, extending
`training.steps`, or raising the global batch is how runs are steered, and it must take effect
(a restored scheduler would otherwise silently keep the old peak). Why it is logged: a resumed run
whose config drifted from the one that wrote the checkpoint should never be a surprise.
The manifest of every checkpoint records the config (`"config"`) for this comparison; a
checkpoint whose manifest lacks it is resumed without the comparison (and says so).

`model.init_from` is read only by a run that starts without a checkpoint: the weights it names
would be overwritten by the checkpoint's, and the architecture comes from the checkpoint's
manifest (`resumed_model_args`; the data and config still size it and must agree, as above).
So a requeued job whose staged init weights are gone still resumes, and an init_from changed
since the checkpoint is reported as not applied (`report_unread_init_from`) rather than as a change.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from titan_contrastive.config import ConfigError

logger = logging.getLogger("titan_contrastive")

NOT_COMPARED = {
    "job.config_file",
    "job.dump_folder",
    "job.description",
    "checkpoint.load_step",
    "memory.plan",
    "model.init_from",
}
MUST_AGREE = {
    "model.freeze": "the frozen parameters have no optimizer state",
    "model.unlocked_layers": "the frozen parameters have no optimizer state",
    "optimizer.layer_decay": "the optimizer's parameter groups are built from it",
    "optimizer.static_query_lr": "the optimizer's parameter groups are built from it",
}
TRAINING_ARGS = {"patch_dropout", "trust_remote_code", "attn_implementation"}
"""Model args that shape training or loading, not the weights: a change on resume is applied and logged as its
config key's change (`model.patch_dropout`: FLIP ends with unmasked tuning; `model.trust_remote_code`, which
a folder that ships its code needs either way), not refused as another architecture."""


class IncompatibleResume(ValueError):
    """The config cannot continue this checkpoint; the message says why and what to do."""


def _flat(config: dict[str, Any]) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, fields in config.items() for key, value in fields.items()}


def _plain(value: Any) -> Any:
    """The value as the manifest's JSON holds it (tuples become lists), for comparison."""
    return json.loads(json.dumps(value))


def _differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    return [
        f"{key}: {saved.get(key)!r} -> {current.get(key)!r}"
        for key in sorted(set(saved) | set(current))
        if key not in NOT_COMPARED and _plain(saved.get(key)) != _plain(current.get(key))
    ]


def _architecture(model: dict[str, Any] | None, saved: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """A manifest's model record without its `TRAINING_ARGS`, and with `saved` (the checkpoint's record) without
    the args that record lacks: fields added to the family since it was written, whose defaults keep the
    behaviour it was trained with."""
    if model is None or not isinstance(model.get("args"), dict):
        return model
    known = saved.get("args") if saved is not None and isinstance(saved.get("args"), dict) else model["args"]
    return {**model, "args": {k: v for k, v in model["args"].items() if k not in TRAINING_ARGS and k in known}}


def config_changes(
    step: int, manifest: dict[str, Any], config: dict[str, Any] | None, model: dict[str, Any] | None
) -> list[str]:
    """The config changes since checkpoint `step` was saved, as `key: old -> new` (to apply and log).

    Raises IncompatibleResume for a different model or a change in MUST_AGREE.
    """
    fix = (
        "resume with the saved value, or start a new run from these weights "
        "(checkpoint.folder=<new folder>, model.init_from=<this step's folder>)"
    )
    saved_model = _architecture(manifest.get("model"))
    model = _architecture(model, saved_model)
    if model is not None and saved_model is not None and _plain(saved_model) != _plain(model):
        if saved_model.get("family") != model.get("family"):
            what = f"model family {saved_model.get('family')!r}, the config builds {model.get('family')!r}"
        else:
            diff = _differences(saved_model.get("args", {}), model.get("args", {}))
            what = f"a different architecture ({'; '.join(diff[:4])}{' ...' if len(diff) > 4 else ''})"
        raise IncompatibleResume(f"checkpoint step-{step} holds {what}: the weights cannot load; {fix}")
    if config is None or "config" not in manifest:
        return []
    changes = _differences(_flat(manifest["config"]), _flat(config))
    for change in changes:
        key = change.split(":", 1)[0]
        if key in MUST_AGREE:
            raise IncompatibleResume(f"{change} since checkpoint step-{step}, but {MUST_AGREE[key]}; {fix}")
    return changes


def _manifest(folder: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("model"), dict) else None


def resumed_model_args(cfg: Any, spec: Any) -> tuple[Any, dict[str, Any]] | None:
    """With `model.init_from` and checkpointing: (model args, manifest) of the checkpoint the resume
    will load, `checkpoint.load_step` or the newest `step-N` with a readable manifest naming this
    family's model (CheckpointManager.load verifies it and falls back to an older one, of the same
    run and architecture). None otherwise, or when its manifest records no model: the run
    then reads `model.init_from`."""
    if not (cfg.model.init_from and cfg.checkpoint.enable):
        return None
    checkpoint_folder, load_step = Path(cfg.job.dump_folder) / cfg.checkpoint.folder, cfg.checkpoint.load_step
    if load_step >= 0:
        candidates = [load_step]
    else:
        found = (
            (re.fullmatch(r"step-(\d+)", p.name) for p in checkpoint_folder.iterdir())
            if checkpoint_folder.is_dir()
            else ()
        )
        candidates = sorted((int(m[1]) for m in found if m), reverse=True)
    for step in candidates:
        manifest = _manifest(checkpoint_folder / f"step-{step}")
        if manifest is None or manifest["model"].get("family") != spec.name:
            continue
        try:
            return dataclasses.replace(next(iter(spec.flavors.values())), **manifest["model"].get("args", {})), manifest
        except TypeError:  # fields this version does not know
            return None
    return None


def model_source(
    cfg: Any, spec: Any, resolve: Callable[[str, str, str], tuple[Any, Any]]
) -> tuple[Any, Any, dict[str, Any] | None]:
    """(model args, initial weights or None, manifest of the checkpoint to resume or None): the
    checkpoint's architecture when `resumed_model_args` finds one, else `resolve(name, flavor,
    init_from)` (`models.resolve_model_args`: the flavor's args, or init_from's args and weights)."""
    resumed = resumed_model_args(cfg, spec)
    if resumed is not None:
        return resumed[0], None, resumed[1]
    return (*resolve(cfg.model.name, cfg.model.flavor, cfg.model.init_from), None)


def report_unread_init_from(init_from: str, step: int | None, manifest: dict[str, Any] | None) -> None:
    """Log that `init_from` was left unread because checkpoint `step` was resumed (`manifest`: the
    one `model_source` read; None: init_from was read, nothing to say). ConfigError when no
    checkpoint loaded after all: the model would silently be a random init."""
    if manifest is None:
        return
    saved = manifest.get("config", {}).get("model", {}).get("init_from")
    if step is None:  # the checkpoint seen at start-up vanished before it could load
        raise ConfigError(
            f"model.init_from={init_from!r} was not read because a checkpoint was to be resumed, but it "
            "is gone (moved or removed during start-up); rerun to start from model.init_from"
        )
    changed = (
        f" (changed since step-{step}: {saved!r} -> {init_from!r}; not applied)"
        if saved is not None and saved != init_from
        else ""
    )
    logger.info(
        f"model.init_from={init_from!r} not read: resuming checkpoint step-{step}, whose weights replace it{changed}"
    )
