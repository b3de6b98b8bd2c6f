"""LoRA adapters on a Hugging Face model, through peft (`pip install -e '.[hf]'`).

`add_lora` injects peft's LoRA layers in place (`peft.inject_adapter_in_model`: no wrapper class,
so the model's forward, its `_no_split_modules` layers for FSDP2 and activation checkpointing and
its parameter names stay what they were, with `.lora_A.default` / `.lora_B.default` added): only
the adapters train, so only they have gradients and optimizer state, and a checkpoint holds only
what trains (`checkpoint.stateful.ModelState`, the frozen base comes back from the model folder).
Target modules default to peft's own choice for the architecture (BERT: query, value; Llama and
Qwen: q_proj, v_proj). LoRA dropout is an `nn.Dropout` like any other: a GradCache re-forward
replays its draws.
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


def lora_config(rank: int, alpha: float, dropout: float, targets: Sequence[str]) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets))


def add_lora(model: nn.Module, rank: int, alpha: float, dropout: float, targets: Sequence[str]) -> nn.Module:
    """`model` with LoRA adapters of `rank` on the modules named `targets` (peft's matching: exact
    names or name suffixes), everything else frozen; ConfigError when no module matches."""
    from peft import inject_adapter_in_model

    try:
        model = inject_adapter_in_model(lora_config(rank, alpha, dropout, targets), model)
    except ValueError as e:  # no target module found
        raise ConfigError(f"lora.target_modules={list(targets)}: {' '.join(str(e).split())[:200]}") from None
    return model
