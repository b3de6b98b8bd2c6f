"""The vision tower run on one blank image and added to a forward at zero weight: where rows of several retrieval modes
share a batch (`[data] retrieval_modes`), one rank's chunk may hold images and another's, at the same place, none, and
FSDP gathers a block's parameters only where it runs: every rank must run the same blocks in the same order, and DDP
must see every trained parameter in each synced backward. A text-only forward runs the vision tower on a blank
image of one merged token and adds its output times zero: the same blocks run on every rank, and the loss and every
gradient stay what they were (the tower's gradient from it is exactly zero)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["visual_anchor"]


def visual_anchor(tower: nn.Module, like: Tensor) -> Tensor:
    """A zero scalar that depends on every vision block of `tower` (a Qwen-VL model: its `get_image_features` on one
    blank image of one merged token), on `like`'s device."""
    vision = tower.config.vision_config
    merge, patch = int(vision.spatial_merge_size), int(vision.patch_size)
    channels = int(getattr(vision, "in_channels", getattr(vision, "in_chans", 3)))
    width = channels * int(vision.temporal_patch_size) * patch * patch
    grid = torch.tensor([[1, merge, merge]], device=like.device)
    pixels = torch.zeros(merge * merge, width, device=like.device, dtype=tower.visual.dtype)
    return 0.0 * sum(t.float().sum() for t in _tensors(tower.get_image_features(pixels, grid)))


def _tensors(value: Any) -> list[Tensor]:
    """Every floating tensor in a model output (a ModelOutput, or tuples and lists of tensors)."""
    if isinstance(value, Tensor):
        return [value] if value.is_floating_point() else []
    if hasattr(value, "values"):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []
