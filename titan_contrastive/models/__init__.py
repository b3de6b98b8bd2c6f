"""Model families and their registry.

Importing this package registers the built-in families ("clip", "hf_clip", "bi_encoder", "lit", "qwen_vl",
"vlm", "vae", "static"). The trainer resolves `model.name` / `model.flavor` with `get_model_spec` / `get_flavor_args`.

To add a family from your own package, call `register_model` at import time of one of
your modules and point `job.custom_import` at it; its args implement `ModelArgs`::

    from titan_contrastive.models import ModelSpec, register_model

    register_model(ModelSpec(name="my_family", flavors={"small": MyArgs(...)},
                             build_model=MyModel, blocks=lambda m: list(m.layers)))
"""

from titan_contrastive.models.args import ModelArgs, configured
from titan_contrastive.models.registry import (
    ModelRegistryError,
    ModelSpec,
    StateDictAdapter,
    get_flavor_args,
    get_model_spec,
    list_models,
    register_model,
    resolve_model_args,
)

# Imported for their side effect: register the built-in families.
from titan_contrastive.models import bi_encoder, clip, hf_clip, lit, qwen_vl, static, vae, vlm  # noqa: E402,F401  isort: skip

__all__ = [
    "ModelArgs",
    "ModelRegistryError",
    "ModelSpec",
    "StateDictAdapter",
    "configured",
    "get_flavor_args",
    "get_model_spec",
    "list_models",
    "register_model",
    "resolve_model_args",
]
