"""Locked towers and partial tuning: `[model] freeze` and `unlocked_layers` (LiT, open_clip's --lock-*).

`freeze` entries are tower names of the family (`ModelSpec.towers`: clip `image`, `text`;
bi_encoder `query`, `doc`) or fnmatch patterns over parameter names (`text.transformer.blocks.*`).
`unlocked_layers = N` leaves the last N residual blocks of each frozen tower trainable, with what
follows them (final norm, projection), as open_clip's `--lock-image-unlocked-groups`.

Order of operations (the trainer calls this after the weights are loaded, before data parallelism
and the optimizer): match -> `requires_grad = False` -> a tower with nothing left to train is
marked `frozen` and kept in eval mode (a locked tower gives fixed features: no dropout) -> one log
line saying what trains. The optimizer's parameter groups skip frozen parameters, so they get
neither gradients nor optimizer state. The family's forward calls a locked tower through
`locked_forward`: without a graph (no saved activations: the LiT saving), and inside a
cached-gradient re-forward (GradCache, global negatives) not at all, reusing pass 1's output, so
it runs once per sample under every step kind. The re-forward hands the model pass 1's outputs
as its `replay` argument (`grad_cache.engine.Replay`, through the step's `StepContext.encode`),
and the forward passes them on to `locked_forward`. Pinning it to eval mode is what makes that reuse
exact: it draws no random numbers, so skipping it leaves the other tower's dropout replay intact.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from titan_contrastive.components.tower_layers import tower_depth, tower_layer
from titan_contrastive.config import ConfigError

logger = logging.getLogger("titan_contrastive")


def _tower_module(model: nn.Module, prefix: str) -> nn.Module:
    return model.get_submodule(prefix.rstrip("."))


def _unlocked(name: str, prefix: str, depth: int, unlocked_layers: int) -> bool:
    """Whether a frozen tower's parameter stays trainable: in its last `unlocked_layers` blocks or after them
    (never what comes before the blocks)."""
    layer = tower_layer(name, prefix, depth)
    return unlocked_layers > 0 and layer > max(depth - unlocked_layers, 0)


def locked_forward(
    tower: nn.Module, index: int, run: Callable[[], Tensor], replay: Sequence[Tensor | None] | None = None
) -> Tensor:
    """`run()` (the tower's forward); for a locked tower (`tower.frozen`) without a graph, and inside
    a cached-gradient re-forward `replay[index]` instead: `replay` is the model's argument of that
    name (pass 1's outputs of the chunk, None outside a re-forward), `index` the place of this
    tower's output among the model's."""
    if not getattr(tower, "frozen", False):
        return run()
    cached = None if replay is None else replay[index]
    if cached is not None:
        return cached
    with torch.no_grad():
        return run()


def _pin_eval(module: nn.Module) -> None:
    """Keep `module` in eval mode whatever `model.train()` asks (its parent calls `module.train(mode)`)."""
    module.eval()
    module.train = lambda mode=True: nn.Module.train(module, False)  # type: ignore[method-assign]


def apply_freeze(model: nn.Module, freeze: Sequence[str], unlocked_layers: int, towers: Mapping[str, str]) -> str:
    """Freeze what `freeze` names (see the module docstring); returns the summary it logs."""
    params = dict(model.named_parameters())
    names = list(params)
    frozen: set[str] = set()
    for entry in freeze:
        if entry in towers:
            prefix = towers[entry]
            depth = tower_depth(names, prefix)
            matched = [n for n in names if n.startswith(prefix) and not _unlocked(n, prefix, depth, unlocked_layers)]
        else:
            matched = fnmatch.filter(names, entry)
        if not matched:
            known = ", ".join(towers) or "none"
            raise ConfigError(
                f"model.freeze entry {entry!r} matches no parameter; use a tower name ({known}) or a pattern "
                f"over parameter names such as {names[0]!r}"
            )
        frozen.update(matched)
    for name in frozen:
        params[name].requires_grad_(False)
    locked = []
    for tower, prefix in towers.items():
        module = _tower_module(model, prefix)
        module.frozen = not any(p.requires_grad for p in module.parameters())
        if module.frozen:
            _pin_eval(module)
            locked.append(tower)
    trainable = sum(p.numel() for p in params.values() if p.requires_grad)
    total = sum(p.numel() for p in params.values())
    summary = (
        f"trains {trainable:,} of {total:,} parameters"
        + (f"; frozen: {len(frozen)} tensors" if frozen else "")
        + (f"; locked towers (run without a graph): {', '.join(locked)}" if locked else "")
    )
    if freeze:
        logger.info(f"freeze: {summary}")
    return summary
