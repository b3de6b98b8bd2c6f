"""Retrieval batches: one collated dict -> (query, positive, negative) model inputs (seed 000, section 10).

A retrieval collator emits one flat dict for query, positive and negative sides. The prefixed
keys (`query_*`, `pos_*`, `neg_*`) are authoritative; the legacy un-prefixed aliases
(`input_ids`, `attention_mask` for the query text; `pixel_values`, `image_grid_thw` for the
image side) are the fallback. Lookups use `is None`, never `or`: a multi-element Tensor has no
truth value. The sides then go to GradCache as separate model inputs (hard negatives third).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from titan_contrastive.batching import IMAGE_FIELDS, BatchError

__all__ = ["MODES", "SIDES", "side_kinds", "unpack_batch"]

TEXT_FIELDS = ("input_ids", "attention_mask")

# retrieval mode -> (query kind, positive kind); negatives are of the positive's kind
MODES: dict[str, tuple[str, str]] = {
    "t2i": ("text", "image"),
    "i2i": ("image", "image"),
    "t2t": ("text", "text"),
    "i2t": ("image", "text"),
    "m2i": ("multi", "image"),
    "m2t": ("multi", "text"),
    "t2m": ("text", "multi"),
    "i2m": ("image", "multi"),
    "m2m": ("multi", "multi"),
}
SIDES = ("query", "doc")


def side_kinds(mode: str) -> dict[str, str]:
    """Each side's kind (text, image or multi) in retrieval mode `mode`: {"query": ..., "doc": ...}."""
    return dict(zip(SIDES, MODES[mode]))


def _pick(batch: Mapping[str, Any], prefix: str, field: str, legacy: bool) -> Any:
    value = batch.get(f"{prefix}_{field}")
    if value is None and legacy:
        value = batch.get(field)
    return value


def _side(
    batch: Mapping[str, Any], prefix: str, kind: str, legacy_text: bool, legacy_image: bool, mode: str
) -> dict[str, Any]:
    needs = {"text": TEXT_FIELDS, "image": IMAGE_FIELDS, "multi": TEXT_FIELDS + IMAGE_FIELDS}[kind]
    side = {}
    for field in needs:
        value = _pick(batch, prefix, field, legacy_text if field in TEXT_FIELDS else legacy_image)
        if value is not None:
            side[field] = value
    if kind == "image":  # a VLM's image item also carries its chat-template tokens
        for field in TEXT_FIELDS:
            value = batch.get(f"{prefix}_{field}")
            if value is not None:
                side[field] = value
    required = (
        ("input_ids",) if kind == "text" else ("pixel_values",) if kind == "image" else ("input_ids", "pixel_values")
    )
    for field in required:
        if field not in side:
            tried = [f"{prefix}_{field}"] + ([field] if (legacy_text if field in TEXT_FIELDS else legacy_image) else [])
            raise BatchError(
                f"retrieval mode {mode!r}: the {prefix} side needs {field}; "
                f"none of the keys {tried} is in the batch (keys: {sorted(batch)})"
            )
    return side


def unpack_batch(batch: Mapping[str, Any], mode: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
    """(query, positive, negative or None) model inputs of a collated retrieval batch.

    Legacy aliases: `input_ids` / `attention_mask` serve the query; `pixel_values` /
    `image_grid_thw` serve the positive when it is an image, else the query.
    """
    if mode not in MODES:
        raise BatchError(f"retrieval mode {mode!r}: choose one of {', '.join(MODES)}")
    query_kind, pos_kind = MODES[mode]
    image_alias_to_query = pos_kind != "image"
    query = _side(batch, "query", query_kind, legacy_text=True, legacy_image=image_alias_to_query, mode=mode)
    positive = _side(batch, "pos", pos_kind, legacy_text=False, legacy_image=not image_alias_to_query, mode=mode)
    has_negative = any(key.startswith("neg_") and batch[key] is not None for key in batch)
    negative = _side(batch, "neg", pos_kind, legacy_text=False, legacy_image=False, mode=mode) if has_negative else None
    return query, positive, negative
