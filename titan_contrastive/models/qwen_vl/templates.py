"""A qwen_vl side's template (`{image}` where its image goes, `{text}` its text): each kind's default (`TEMPLATES`), the
check that a template fits its side's kind (`check_template`), and the template of a side in a mode other than the
run's (`side_template`, for `[data] retrieval_modes`)."""

from __future__ import annotations

from typing import Any

from titan_contrastive.config import ConfigError
from titan_contrastive.datasets.retrieval import side_kinds
from titan_contrastive.models.qwen_vl.processor import IMAGE

__all__ = ["TEMPLATES", "check_template", "side_template"]

TEMPLATES = {"text": "{text}", "image": IMAGE, "multi": IMAGE + " {text}"}
"""A side's default template by its kind (`retrieval.side_kinds`)."""


def check_template(side: str, kind: str, template: str, mode: str, key: str = "") -> None:
    """An image or multi side's template has `{image}`, a text side's has none: else one ConfigError
    naming `key` (default: `model.{side}_prompt`)."""
    key = f"{key or f'model.{side}_prompt'}={template!r}"
    if kind != "text" and IMAGE not in template:
        raise ConfigError(
            f"{key}: the {kind} side's template needs {IMAGE} where the image goes (retrieval_mode={mode}), "
            f"e.g. '{IMAGE} Summarize above image in one word:'" + (" or '{image} {text}'" if kind == "multi" else "")
        )
    if kind == "text" and IMAGE in template:
        raise ConfigError(
            f"{key}: the {side} side is text in retrieval_mode={mode}; remove {IMAGE} from it (e.g. '{{text}}') "
            "or choose a mode whose " + ("queries" if side == "query" else "documents") + " are images"
        )


def side_template(args: Any, side: str, mode: str) -> str:
    """`side`'s template for rows of `mode`: the run's own (`args.{side}_template`) where the side is of the kind it has
    in `args.mode`, else that kind's default (`TEMPLATES`)."""
    kind = side_kinds(mode)[side]
    return getattr(args, f"{side}_template") if kind == side_kinds(args.mode)[side] else TEMPLATES[kind]
