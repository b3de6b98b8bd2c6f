"""LoRA adapters on a Hugging Face model, through peft (`pip install -e '.[hf]'`).

`add_lora` injects peft's LoRA layers in place (`peft.inject_adapter_in_model`: no wrapper class,
so the model's forward, its `_no_split_modules` layers for FSDP2 and activation checkpointing and
its parameter names stay what they were, with `.lora_A.default` / `.lora_B.default` added): only
the adapters train, so only they have gradients and optimizer state, and a checkpoint holds only
what trains (`checkpoint.stateful.ModelState`, the frozen base comes back from the model folder).
Target modules default to peft's own choice for the architecture (BERT: query, value; Llama and
Qwen: q_proj, v_proj); `['all-linear']` is peft's every linear layer but an output head.
`modules_to_save` (peft's name and matching: module names ending with one of them) train in full
beside the adapters, e.g. the word embeddings; they must not nest, as peft's own save and load of
nested ones fails. LoRA dropout is an `nn.Dropout` like any other: a
GradCache re-forward replays its draws. `use_rslora` (alpha / sqrt(r)) and `use_dora` (a trained
magnitude per output row beside A and B, `.lora_magnitude_vector.default`) are peft's own options,
passed through; the magnitudes are set from the loaded weights when the adapters are injected.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from titan_contrastive.config import ConfigError

__all__ = ["LoraFields", "add_lora", "default_targets", "lora_config"]


@dataclass(frozen=True)
class LoraFields:
    """The `[lora]` settings a Hugging Face family's model args carry (its args subclass this)."""

    lora_rank: int = 0
    """`[lora] rank` when `[lora] enable`, else 0: no adapters, every weight trains."""
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ()
    """The adapted modules: `[lora] target_modules`, or the family's default."""
    lora_modules_to_save: tuple[str, ...] = ()
    """`[lora] modules_to_save`: modules trained in full beside the adapters."""
    lora_rslora: bool = False
    """`[lora] use_rslora`: the adapters scaled by alpha / sqrt(rank)."""
    lora_dora: bool = False
    """`[lora] use_dora`: weight-decomposed adapters (a trained magnitude per output row)."""

    @staticmethod
    def from_config(lora: Any, default_targets: Callable[[], tuple[str, ...]]) -> dict[str, Any]:
        """The fields' values from `[lora]` (`cfg.lora`), for `dataclasses.replace`; `default_targets()` is asked
        only when LoRA is on and `target_modules` is empty."""
        on = lora.enable
        return {
            "lora_rank": lora.rank if on else 0,
            "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout,
            "lora_targets": (tuple(lora.target_modules) or default_targets()) if on else (),
            "lora_modules_to_save": tuple(lora.modules_to_save) if on else (),
            "lora_rslora": lora.use_rslora and on,
            "lora_dora": lora.use_dora and on,
        }


def default_targets(model_type: str) -> tuple[str, ...]:
    """peft's LoRA target modules for a transformers `model_type`; ConfigError when it has none."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    if model_type not in DEFAULTS:
        raise ConfigError(
            f"lora.target_modules is empty and peft has no default for model type {model_type!r}; name the "
            "linear layers to adapt, e.g. lora.target_modules=['q_proj','v_proj'], or all of them: ['all-linear']"
        )
    return tuple(DEFAULTS[model_type])


def lora_config(fields: LoraFields) -> Any:
    """peft's `LoraConfig` of the `[lora]` settings in `fields`."""
    from peft import LoraConfig

    targets = tuple(fields.lora_targets)
    return LoraConfig(
        r=fields.lora_rank,
        lora_alpha=fields.lora_alpha,
        lora_dropout=fields.lora_dropout,
        target_modules="all-linear" if targets == ("all-linear",) else list(targets),  # peft's own key word
        modules_to_save=list(fields.lora_modules_to_save) or None,
        use_rslora=fields.lora_rslora,
        use_dora=fields.lora_dora,
    )


def _modules_to_save(model: nn.Module, names: Sequence[str]) -> list[nn.Module]:
    """The modules whose names end with one of `names` (peft's rule); ConfigError for a name that
    matches none, or matches modules inside one another."""
    found: dict[str, nn.Module] = {}
    for wanted in names:
        matched = {n: m for n, m in model.named_modules() if n and n.endswith(wanted)}
        if not matched:
            leaves = [n for n, m in model.named_modules() if n and not list(m.children())][:4]
            raise ConfigError(
                f"lora.modules_to_save={list(names)}: no module's name ends with {wanted!r}; name modules of the "
                f"model, e.g. {', '.join(leaves)}"
            )
        found.update(matched)
    nested = sorted(n for n in found for o in found if n != o and n.startswith(f"{o}."))
    if nested:
        raise ConfigError(
            f"lora.modules_to_save={list(names)} selects {nested[0]!r} inside another selected module; name the "
            "innermost modules to train (e.g. 'word_embeddings' rather than 'embeddings'): peft cannot save nested ones"
        )
    return list(found.values())


def add_lora(model: nn.Module, fields: LoraFields) -> nn.Module:
    """`model` with LoRA adapters of `fields.lora_rank` on the modules named `fields.lora_targets` (peft's
    matching: exact names or name suffixes) and `fields.lora_modules_to_save` trained in full, everything else
    frozen; ConfigError when no module matches."""
    from peft import inject_adapter_in_model

    full = _modules_to_save(model, fields.lora_modules_to_save)
    config = lora_config(fields)
    config.modules_to_save = None  # trained in place below, not wrapped
    try:
        model = inject_adapter_in_model(config, model)
    except ValueError as e:  # no target module found
        raise ConfigError(
            f"lora.target_modules={list(fields.lora_targets)}: {' '.join(str(e).split())[:200]}"
        ) from None
    for module in full:
        module.requires_grad_(True)
    return model
