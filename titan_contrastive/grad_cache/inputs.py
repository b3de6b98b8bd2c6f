"""Calling a model on a chunk and finding the representation in what it returns; GradCache's error.

GradCache is model-agnostic, so it meets inputs and outputs of every shape: a chunk is a Tensor,
a Mapping (a dict or a tokenizer's BatchEncoding) or a list/tuple (`model_call` spreads it into
the call), and an output is a Tensor, a tuple or an output object (`get_rep`). Cutting inputs
into chunks is the batching layer's (`titan_contrastive.batching`).

`GradCacheError` is the batching layer's `BatchError` under GradCache's name, one type: a bad
argument to GradCache and an input its chunking cannot cut are caught by the same `except`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from ..batching.inputs import BatchError

__all__ = ["GradCacheError", "get_rep", "model_call"]

GradCacheError = BatchError


def model_call(model: Callable[..., Any], chunk: Any, **kwargs: Any) -> Any:
    """dict -> model(**chunk); list/tuple -> model(*chunk); anything else -> model(chunk); `kwargs`
    (the re-forward's `replay`) go along as keyword arguments."""
    if isinstance(chunk, Mapping):
        return model(**chunk, **kwargs)
    if isinstance(chunk, (list, tuple)):
        return model(*chunk, **kwargs)
    return model(chunk, **kwargs)


def get_rep(output: Any, rep_attribute: str = "pooler_output") -> Tensor:
    """The representation in a model output: a Tensor itself, the first element of a tuple/list,
    or the `rep_attribute` of an output object (transformers' ModelOutput, a dataclass)."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    value = output.get(rep_attribute) if isinstance(output, Mapping) else getattr(output, rep_attribute, None)
    if isinstance(value, Tensor):
        return value
    fields = (
        list(output.keys())
        if isinstance(output, Mapping)
        else [a for a in vars(output)]
        if hasattr(output, "__dict__")
        else []
    )
    raise GradCacheError(
        f"cannot find a representation in the model output of type {type(output).__name__} (fields: {fields}); "
        f"return a Tensor, set rep_attribute to the field that holds it (now {rep_attribute!r}), or pass get_rep_fn"
    )
