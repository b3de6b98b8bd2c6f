"""Resume semantics: what a resumed run takes from its checkpoint, and what from its config.

| comes from | what | a change since the checkpoint was saved |
|---|---|---|
| the checkpoint | model weights; optimizer moments and step counts; each data-parallel rank's data position and RNG streams; the train state (step, samples seen, skipped steps) | - |
| the config | learning rate and schedule (warmup, decay, min_lr_factor, training.steps: the lr is recomputed at the restored step); AdamW betas, eps, weight decay; max_norm; global batch size (accumulation steps); on_nonfinite and its limit; logging, eval, checkpoint interval and keep; timeouts; everything else not below | applied, and logged as `key: old -> new` |
| must agree | the model (family and architecture args); which parameters train (model.freeze, unlocked_layers: they decide which have optimizer state); the data-parallel degree and training.local_batch_size (the data position is counted in their batches) | a one-line error before anything is loaded |

Why a change is applied rather than refused: lowering the lr after a loss spike, extending
`training.steps`, or raising the global batch is how runs are steered, and it must take effect
(before, the restored scheduler silently kept the old peak). Why it is logged: a resumed run
whose config drifted from the one that wrote the checkpoint should never be a surprise.
The manifest of every checkpoint records the config (`"config"`) for this comparison; a
checkpoint written before that is resumed without it (and says so).
"""

from __future__ import annotations

import json
from typing import Any

NOT_COMPARED = {"job.config_file", "job.dump_folder", "job.description", "checkpoint.load_step", "memory.plan"}
MUST_AGREE = {
    "model.freeze": "the frozen parameters have no optimizer state",
    "model.unlocked_layers": "the frozen parameters have no optimizer state",
    "training.local_batch_size": "the data position is counted in local batches",
}


class IncompatibleResume(ValueError):
    """The config cannot continue this checkpoint; the message says why and what to do."""


def _flat(config: dict[str, Any]) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, fields in config.items() for key, value in fields.items()}


def _plain(value: Any) -> Any:
    """The value as the manifest's JSON holds it (tuples become lists), for comparison."""
    return json.loads(json.dumps(value))


def _differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    return [f"{key}: {saved.get(key)!r} -> {current.get(key)!r}" for key in sorted(set(saved) | set(current))
            if key not in NOT_COMPARED and _plain(saved.get(key)) != _plain(current.get(key))]


def config_changes(step: int, manifest: dict[str, Any], config: dict[str, Any] | None,
                   model: dict[str, Any] | None) -> list[str]:
    """The config changes since checkpoint `step` was saved, as `key: old -> new` (to apply and log).

    Raises IncompatibleResume for a different model or a change in MUST_AGREE.
    """
    fix = "resume with the saved value, or start a new run from these weights (checkpoint.folder=<new folder>, model.init_from=<this step's folder>)"
    saved_model = manifest.get("model")
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
