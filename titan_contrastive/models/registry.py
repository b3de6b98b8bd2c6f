"""Registry of model families, modelled on torchtitan's `TrainSpec`.

Why a registry: the trainer only knows `model.name` and `model.flavor` from the config. A
family describes itself once in a `ModelSpec` (how to build it, its size presets, which
submodules are the per-block units for FSDP / activation checkpointing / compile, and which
loss it trains with), so the trainer never imports a concrete model class.

Families register themselves when their package is imported; `titan_contrastive.models`
imports the built-in ones. A user family lives in the user's own package::

    # my_pkg/my_family.py
    from titan_contrastive.models import ModelSpec, register_model

    register_model(ModelSpec(name="my_family", flavors={"small": MyArgs(...)},
                             build_model=MyModel, blocks=lambda m: list(m.layers)))

and is loaded by setting `job.custom_import = "my_pkg.my_family"` in the config.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = [
    "ModelRegistryError",
    "ModelSpec",
    "get_flavor_args",
    "get_model_spec",
    "list_models",
    "register_model",
]


class ModelRegistryError(ValueError):
    """A model name or flavor that is not registered; the message lists the valid choices.

    A `ValueError` subclass so that config validation can catch it with other bad values.
    """


@dataclass(frozen=True)
class ModelSpec:
    """Everything the trainer needs to know about a model family."""

    name: str
    """Family name, selected with `model.name` in the config, e.g. "clip"."""
    flavors: Mapping[str, Any]
    """Flavor name -> model args (a frozen dataclass instance) passed to `build_model`."""
    build_model: Callable[[Any], nn.Module]
    """Builds the model from its args. The trainer calls it under the target device or
    under `torch.device("meta")` (then `to_empty` + `init_weights`), so it must not
    assume a device."""
    blocks: Callable[[nn.Module], list[nn.Module]]
    """Returns the submodules that are the units for per-block FSDP, activation
    checkpointing and compile (typically the residual blocks)."""
    default_loss: str = "clip"
    """Name of the loss the family trains with."""
    input_keys: tuple[str, ...] = ("image", "text")
    """The batch entries passed to `model(*inputs)`, in order (e.g. ("query", "doc")); the model
    returns (first tower's embeddings, second tower's embeddings, exp(logit_scale))."""
    build_tokenizer: Callable[[Any], Any] | None = None
    """For families with their own (pretrained) tokenizer: args -> tokenizer, handed to the
    datasets that tokenize with it. None: datasets use their own tokenizer."""
    image_layout: str = "batch"
    """How the family takes images: "batch" ([B, C, H, W], one size), "packed" (Qwen-VL-style
    `pixel_values` [total_patches, C·p·p] + `image_grid_thw` at the flavor's `patch_size`; chunks
    are cut on image boundaries with `grad_cache.split_vlm_inputs`) or "masked" (variable sizes
    zero-padded to [B, C, H, W] with a `mask` [B, 1, H, W] of real pixels). `data.image_sizes`
    mixes resolutions for "packed" and "masked"."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ModelRegistryError("ModelSpec.name must be a non-empty string")
        if not self.flavors:
            raise ModelRegistryError(f"ModelSpec {self.name!r} has no flavors; give at least one")
        if self.image_layout not in ("batch", "packed", "masked"):
            raise ModelRegistryError(f"ModelSpec {self.name!r}: image_layout={self.image_layout!r}; choose batch, packed or masked")


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec, *, overwrite: bool = False) -> None:
    """Make `spec` selectable by `model.name`.

    A duplicate name is an error unless `overwrite=True`, so two packages cannot silently
    shadow each other's family.
    """
    if spec.name in _REGISTRY and not overwrite:
        raise ModelRegistryError(
            f"model family {spec.name!r} is already registered; "
            "pick another name or pass overwrite=True to replace it"
        )
    _REGISTRY[spec.name] = spec


def list_models() -> list[str]:
    """Names of the registered families, sorted."""
    return sorted(_REGISTRY)


def get_model_spec(name: str) -> ModelSpec:
    """The spec registered under `name`; unknown names raise `ModelRegistryError`."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ModelRegistryError(
            f"model.name={name!r} is not a registered model family; valid: "
            f"{', '.join(list_models())} "
            "(register your own with titan_contrastive.models.register_model)"
        ) from None


def get_flavor_args(name: str, flavor: str) -> Any:
    """The args of flavor `flavor` of family `name`; unknown flavors raise `ModelRegistryError`."""
    spec = get_model_spec(name)
    try:
        return spec.flavors[flavor]
    except KeyError:
        raise ModelRegistryError(
            f"model.flavor={flavor!r} is not a flavor of {name!r}; valid: {', '.join(spec.flavors)}"
        ) from None
