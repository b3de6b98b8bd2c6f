"""Cutting a model input into chunks of samples, whatever its shape.

An input may be a Tensor, a Mapping (a dict or a tokenizer's BatchEncoding), a list or tuple of
those. Every tensor in an input must share the batch dimension (dim 0); a disagreement is an
error that names the keys and sizes, because splitting such an input on dim 0 would silently pair
the wrong rows. Non-tensor values (flags, strings) are passed unchanged to every chunk. Packed VLM
inputs whose pixel tensor is not batch-major are split by `vlm.split_vlm_inputs` instead.
`take_chunks` cuts a permutation of the samples (token chunks, `tokens.token_chunks`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

__all__ = ["BatchError", "batch_size", "split_inputs", "take_chunks"]


class BatchError(ValueError):
    """A batch that cannot be cut as asked: the message says what was given and what is expected."""


def _tensors(model_input: Any, prefix: str = "input") -> dict[str, Tensor]:
    """Every tensor inside `model_input`, by a readable path (for batch-size checks and errors)."""
    if isinstance(model_input, Tensor):
        return {prefix: model_input}
    if isinstance(model_input, Mapping):
        return {k: v for key, value in model_input.items() for k, v in _tensors(value, f"{prefix}[{key!r}]").items()}
    if isinstance(model_input, (list, tuple)):
        return {k: v for i, value in enumerate(model_input) for k, v in _tensors(value, f"{prefix}[{i}]").items()}
    return {}


def batch_size(model_input: Any, what: str = "input") -> int:
    """The shared dim-0 size of every tensor in `model_input`; an error when they disagree."""
    tensors = _tensors(model_input, what)
    if not tensors:
        raise BatchError(
            f"{what} holds no tensor (got {type(model_input).__name__}); "
            "pass a Tensor, a dict or a list/tuple of tensors"
        )
    sizes = {name: (t.shape[0] if t.dim() else None) for name, t in tensors.items()}
    if len(set(sizes.values())) != 1 or None in sizes.values():
        shown = ", ".join(f"{name}: {size}" for name, size in sizes.items())
        raise BatchError(
            f"{what}: tensors disagree on the batch dimension ({shown}); every tensor needs the same dim-0 size"
        )
    return next(iter(sizes.values()))


def _slice(model_input: Any, start: int, stop: int) -> Any:
    if isinstance(model_input, Tensor):
        return model_input[start:stop]
    if isinstance(model_input, Mapping):
        return {key: _slice(value, start, stop) for key, value in model_input.items()}
    if isinstance(model_input, (list, tuple)):
        return type(model_input)(_slice(value, start, stop) for value in model_input)
    return model_input


def _take(model_input: Any, rows: Tensor) -> Any:
    if isinstance(model_input, Tensor):
        return model_input.index_select(0, rows.to(model_input.device))
    if isinstance(model_input, Mapping):
        return {key: _take(value, rows) for key, value in model_input.items()}
    if isinstance(model_input, (list, tuple)):
        return type(model_input)(_take(value, rows) for value in model_input)
    return model_input


def take_chunks(model_input: Any, order: Tensor, sizes: list[int], what: str = "input") -> list[Any]:
    """Chunks of the samples `order[0:sizes[0]]`, then the next `sizes[1]`, ... (a permutation of
    the batch cut into chunks of the given sizes)."""
    n = batch_size(model_input, what)
    if sorted(order.tolist()) != list(range(n)) or sum(sizes) != n:
        raise BatchError(f"{what}: an order of {len(order)} samples in chunks of {sum(sizes)} for a batch of {n}")
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return [_take(model_input, order[a:b]) for a, b in zip(bounds, bounds[1:])]


def split_inputs(model_input: Any, chunk_size: int, what: str = "input") -> list[Any]:
    """`model_input` cut into consecutive chunks of `chunk_size` samples (the last may be smaller)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise BatchError(f"chunk size {chunk_size!r} for {what}: must be an integer >= 1")
    n = batch_size(model_input, what)
    return [_slice(model_input, start, min(start + chunk_size, n)) for start in range(0, n, chunk_size)]
