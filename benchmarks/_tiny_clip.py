"""A smaller CLIP than the debug flavor, for `clip_distill_bench`'s student of a larger teacher: the clip family
registered again as `clip_tiny` with one flavor (loaded by `--job.custom_import=benchmarks._tiny_clip`, the way a
user's own family is)."""

from __future__ import annotations

import dataclasses

from titan_contrastive.models import get_model_spec, register_model
from titan_contrastive.models.clip import clip_flavors

TINY = dataclasses.replace(
    clip_flavors["debug"],
    embed_dim=32,
    vision_width=32,
    vision_layers=1,
    vision_heads=2,
    text_width=32,
    text_layers=1,
    text_heads=2,
)
"""The debug flavor at half its widths and depths: one block of width 32 per tower."""

register_model(dataclasses.replace(get_model_spec("clip"), name="clip_tiny", flavors={"tiny": TINY}), overwrite=True)
