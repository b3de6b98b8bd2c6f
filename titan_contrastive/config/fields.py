"""Field constructors of the config sections: a default and an optional range check, which `manager.py`
reports in one line naming key, value and fix."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field
from typing import Any

__all__ = ["non_negative", "opt", "positive"]


def opt(default: Any, check: Callable[[Any], bool] | None = None, expect: str = "") -> Any:
    """A field with an optional range check; `expect` says what is valid, for error messages."""
    metadata = {"check": (check, expect)} if check is not None else {}
    if isinstance(default, list):  # mutable: each config gets its own copy
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def positive(default: int) -> Any:
    return opt(default, lambda v: v >= 1, "an integer >= 1")


def non_negative(default: float) -> Any:
    return opt(default, lambda v: v >= 0, "a number >= 0")
