"""LoRA adapters on a Hugging Face model, through peft (`pip install -e '.[hf]'`).

`add_lora` injects peft's LoRA layers in place (`peft.inject_adapter_in_model`: no wrapper class,
so the model's forward, its `_no_split_modules` layers for FSDP2 and activation checkpointing and
its parameter names stay what they were, with `.lora_A.default` / `.lora_B.default` added): only
the adapters train, so only they have gradients and optimizer state, and a checkpoint holds only
what trains (`checkpoint.stateful.ModelState`, the frozen base comes back from the model folder).
Target modules default to peft's own choice for the architecture (BERT: query, value; Llama and
Qwen: q_proj, v_proj). `modules_to_save` (peft's name and matching: module names ending with one
of them) train in full beside the adapters, e.g. the word embeddings; they must not nest, as
peft's own save and load of nested ones fails. LoRA dropout is an `nn.Dropout` like any other: a
GradCache re-forward replays its draws.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from titan_contrastive.config import ConfigError

__all__ = ["add_lora", "default_targets", "lora_config"]


def default_targets(model_type: str) -> tuple[str, ...]:
    """peft's LoRA target modules for a transformers `model_type`; ConfigError when it has none."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    if model_type not in DEFAULTS:
        raise ConfigError(
            f"lora.target_modules is empty and peft has no default for model type {model_type!r}; name the "
            "linear layers to adapt, e.g. lora.target_modules=['q_proj','v_proj']"
        )
    return tuple(DEFAULTS[model_type])


def lora_config(
    rank: int, alpha: float, dropout: float, targets: Sequence[str], modules_to_save: Sequence[str] = ()
) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(targets),
        modules_to_save=list(modules_to_save) or None,
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


def add_lora(
    model: nn.Module,
    rank: int,
    alpha: float,
    dropout: float,
    targets: Sequence[str],
    modules_to_save: Sequence[str] = (),
) -> nn.Module:
    """`model` with LoRA adapters of `rank` on the modules named `targets` (peft's matching: exact
    names or name suffixes) and `modules_to_save` trained in full, everything else frozen;
    ConfigError when no module matches."""
    from peft import inject_adapter_in_model

    full = _modules_to_save(model, modules_to_save)
    try:
        model = inject_adapter_in_model(lora_config(rank, alpha, dropout, targets), model)
    except ValueError as e:  # no target module found
        raise ConfigError(f"lora.target_modules={list(targets)}: {' '.join(str(e).split())[:200]}") from None
    for module in full:
        module.requires_grad_(True)
    return model
