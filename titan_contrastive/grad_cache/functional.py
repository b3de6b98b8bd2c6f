"""The functional form of GradCache: decorate the function that computes a representation.

    @cached
    def encode(model, batch, *, normalize=True):
        return model(**batch).pooler_output

    reps, closures = zip(*(encode(model, chunk, normalize=True) for chunk in chunks))  # no graph
    loss = loss_fn(torch.cat(reps), ...)     # reps are leaves that require grad
    loss.backward()                          # fills rep.grad: the gradient cache
    for rep, closure in zip(reps, closures):
        closure(rep)                         # replays the RNG, re-runs encode with a graph, backprops

For training loops that do not fit `GradCache.cache_step` (custom chunking, several losses,
representations used in more than one place). Positional and keyword arguments both pass through.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import Tensor

from . import engine
from .inputs import GradCacheError


def cached(func: Callable[..., Tensor]) -> Callable[..., tuple[Tensor, Callable[[Tensor], None]]]:
    """`func(*args, **kwargs) -> rep` becomes `(rep leaf without graph, backward closure)`."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> tuple[Tensor, Callable[[Tensor], None]]:
        def call(_: Any) -> Tensor:
            return func(*args, **kwargs)

        (rep,), states = engine.forward_no_grad(call, [None])
        if not isinstance(rep, Tensor):
            raise GradCacheError(
                f"@cached function {func.__name__} returned {type(rep).__name__}; "
                "it must return the representation Tensor"
            )
        leaf = rep.detach().requires_grad_()

        def backward(used: Tensor) -> None:
            """Backprop `used.grad` (the cache filled by the loss) through a replayed forward."""
            if used.grad is None:
                raise GradCacheError(
                    f"no gradient on the representation from {func.__name__}: "
                    "call loss.backward() first, on the tensor it returned"
                )
            engine.forward_backward(call, [None], states, lambda i, outputs: [used.grad])

        return leaf, backward

    return wrapper
