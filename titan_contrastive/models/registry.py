"""Registry of model families, modelled on torchtitan's `TrainSpec`.

Why a registry: the trainer only knows `model.name` and `model.flavor` from the config. A
family describes itself once in a `ModelSpec` (how to build it, its size presets, which
submodules are the per-block units for FSDP / activation checkpointing / compile, which loss it
trains with, how its data is laid out, a step kind of its own if it needs one, how it is
evaluated), so the trainer never imports a concrete model class and never branches on a family.

Families register themselves when their package is imported; `titan_contrastive.models`
imports the built-in ones. A user family lives in the user's own package::

    # my_pkg/my_family.py
    from titan_contrastive.models import ModelSpec, register_model

    register_model(ModelSpec(name="my_family", flavors={"small": MyArgs(...)},
                             build_model=MyModel, blocks=lambda m: list(m.layers)))

and is loaded by setting `job.custom_import = "my_pkg.my_family"` in the config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from titan_contrastive.components.evaluate import EvalContext, evaluate_contrastive
from titan_contrastive.datasets.layouts import IMAGES, DataLayout
from titan_contrastive.models.args import ModelArgs, missing_methods

__all__ = [
    "ModelRegistryError",
    "ModelSpec",
    "StateDictAdapter",
    "family_of",
    "folder_guide",
    "get_flavor_args",
    "get_model_spec",
    "list_models",
    "register_model",
    "resolve_model_args",
]


class ModelRegistryError(ValueError):
    """A model name or flavor that is not registered; the message lists the valid choices.

    A `ValueError` subclass so that config validation can catch it with other bad values.
    """


def _claims_nothing(path: Path) -> bool:
    return False


@dataclass(frozen=True)
class StateDictAdapter:
    """How a family's weights go to and from other libraries' formats (torchtitan's
    `state_dict_adapter`): what `[model] init_from` reads and what `python -m
    titan_contrastive.export --to FORMAT` writes. The default reads and writes nothing."""

    read: Callable[[str], tuple[Any, dict[str, Any]]] | None = None
    """path -> (args, state dict in the family's layout), what `[model] init_from` starts from (clip:
    Hugging Face CLIP folders, open_clip checkpoints and our step folders). None: none."""
    claims: Callable[[Path], bool] = _claims_nothing
    """Whether a path that is not one of our step folders is a checkpoint in a format `read` takes;
    export picks the family of such a source by it (ours name theirs in the manifest)."""
    fit: Callable[[dict[str, Any], Any], dict[str, Any]] | None = None
    """(what `read` gave, the args the run sized) -> the weights to load (clip: the position table resized to
    the data's image size). None: loaded as read."""
    writes: Mapping[str, Callable[[str, Path, str], None]] = dataclasses.field(default_factory=dict)
    """Export format -> `write(src, folder, tower)`: writes `src` (a step folder of the family or a
    path it claims) into `folder` and loads it back to check it (`models.export_check`)."""


@dataclass(frozen=True)
class ModelSpec:
    """Everything the trainer needs to know about a model family."""

    name: str
    """Family name, selected with `model.name` in the config, e.g. "clip"."""
    flavors: Mapping[str, ModelArgs]
    """Flavor name -> model args (a frozen dataclass instance with the `ModelArgs` methods) passed to `build_model`."""
    build_model: Callable[[Any], nn.Module]
    """Builds the model from its args. The trainer calls it under the target device or
    under `torch.device("meta")` (then `to_empty` + `init_weights`), so it must not
    assume a device."""
    blocks: Callable[[nn.Module], list[nn.Module]]
    """Returns the submodules that are the units for per-block FSDP, activation
    checkpointing and compile (typically the residual blocks)."""
    learns_bias: bool = False
    """Whether the family's model learns a logit bias for objectives with one (`losses`: the
    sigmoid loss; its args read it through `update_from_config`). A family without trains the
    objectives without a bias only."""
    own_loss: str = ""
    """The name of the loss the family's own step (`build_step`) computes instead of an objective
    (the vae's "pixel"): `[loss] name` is then empty or this, and the step gets no objective."""
    input_keys: tuple[str, ...] = ("image", "text")
    """The batch entries passed to `model(*inputs)`, in order (e.g. ("query", "doc")); the model
    returns (first tower's embeddings, second tower's embeddings, exp(logit_scale)[, logit_bias])."""
    build_tokenizer: Callable[[Any], Any] | None = None
    """For families with their own (pretrained) tokenizer: args -> tokenizer, handed to the
    datasets that tokenize with it. None: datasets use their own tokenizer."""
    layout: DataLayout = IMAGES
    """How the family takes images (`datasets.layouts`): prepares the datasets (e.g. packed
    patches at the flavor's patch size, masked mixed-size images) and cuts batches into chunks."""
    build_step: Callable[..., Any] | None = None
    """A step kind of the family's own (`steps.StepBuilder`, e.g. the vae's pixel step); None:
    the contrastive kind `[loss] negatives` and `[gradcache]` select (`steps.build_gradient_step`)."""
    evaluate: Callable[[EvalContext], dict[str, float]] = evaluate_contrastive
    """Evaluation on the held-out split: zero-shot / retrieval (default) or the vae's reconstructions."""
    towers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Tower name -> parameter-name prefix, for `[model] freeze` (clip: image -> "visual.")."""
    state_dict_adapter: StateDictAdapter = StateDictAdapter()
    """Import (`[model] init_from`) and export formats of the family's weights."""
    read_guide: Callable[[Any, str], tuple[Any, dict[str, Any] | None]] | None = None
    """(the run's args, a folder or checkpoint `path`) -> (the args of a frozen guide or teacher from it that reads the
    run's inputs, the weights to load into its build or None where the build reads its folder): what `[loss]
    guide_model` / `teacher_model` build (`models.build.build_guide`); a ConfigError or ValueError (one line) for one
    that cannot read them. None: the family takes none."""
    guide_temperature: bool = False
    """Whether the family's guides keep their own trained `logit_scale` (a CLIP's or SigLIP's; not one the run's config
    starts), whose temperature `[loss] distill_temperature = 0` takes (`models.build.own_temperature`)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ModelRegistryError("ModelSpec.name must be a non-empty string")
        if not self.flavors:
            raise ModelRegistryError(f"ModelSpec {self.name!r} has no flavors; give at least one")
        for flavor, args in self.flavors.items():
            if missing := missing_methods(args):
                raise ModelRegistryError(
                    f"ModelSpec {self.name!r} flavor {flavor!r}: its args ({type(args).__name__}) lack "
                    f"{', '.join(missing)}; implement titan_contrastive.models.ModelArgs"
                )


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec, *, overwrite: bool = False) -> None:
    """Make `spec` selectable by `model.name`.

    A duplicate name is an error unless `overwrite=True`, so two packages cannot silently
    shadow each other's family.
    """
    if spec.name in _REGISTRY and not overwrite:
        raise ModelRegistryError(
            f"model family {spec.name!r} is already registered; pick another name or pass overwrite=True to replace it"
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


def folder_guide(args: Any, path: str) -> tuple[Any, None]:
    """`ModelSpec.read_guide` of a family whose args give a guide built from its folder, `args.as_guide(path)`."""
    return args.as_guide(path), None


def family_of(args: Any) -> ModelSpec:
    """The registered family whose flavors are `args`' type: what builds a frozen guide of another family than the
    run's (a static model's bi_encoder teacher, `build.build_guide`)."""
    for spec in _REGISTRY.values():
        if any(type(flavor) is type(args) for flavor in spec.flavors.values()):
            return spec
    raise ModelRegistryError(f"no registered model family takes {type(args).__name__}; register its family first")


def resolve_model_args(name: str, flavor: str, init_from: str = "") -> tuple[Any, dict[str, Any] | None]:
    """(args, initial weights or None): the checkpoint's architecture and weights with
    `init_from` (the flavor is then not used), else the flavor's args."""
    if not init_from:
        return get_flavor_args(name, flavor), None
    spec = get_model_spec(name)
    if spec.state_dict_adapter.read is None:
        raise ModelRegistryError(
            f"model.init_from={init_from!r}: the {name} family reads no checkpoints; leave it empty"
        )
    try:
        return spec.state_dict_adapter.read(init_from)
    except (OSError, ValueError) as e:
        raise ModelRegistryError(f"model.init_from={init_from!r}: {e}") from None


def flavor_name(name: str, flavor: str) -> str:
    """`flavor`, or where it is empty the first flavor family `name` registers."""
    return flavor or next(iter(get_model_spec(name).flavors))


def get_flavor_args(name: str, flavor: str) -> Any:
    """The args of flavor `flavor` of family `name` (empty: its first); unknown flavors raise
    `ModelRegistryError`."""
    spec = get_model_spec(name)
    try:
        return spec.flavors[flavor_name(name, flavor)]
    except KeyError:
        raise ModelRegistryError(
            f"model.flavor={flavor!r} is not a flavor of {name!r}; valid: {', '.join(spec.flavors)}"
        ) from None
