"""Hyper-parameters of the `vlm` family (packed-patch image tower + causal text tower) and its counts."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from titan_contrastive.losses import temperature_from_config
from titan_contrastive.models.clip.args import _block_flops, _block_params, text_tower_flops, text_tower_params
from titan_contrastive.models.transformer import mlp_hidden

__all__ = ["VLMArgs", "vlm_flavors"]


@dataclass(frozen=True)
class VLMArgs:
    """Sizes of a VLM embedder whose image tower reads Qwen-VL-style packed patches.

    The text fields have the CLIP family's names, so the CLIP `TextTower` is reused as is.
    """

    embed_dim: int
    patch_size: int
    """Side of the square patches the data is packed into (`pixel_values` rows are C·p·p)."""
    in_channels: int
    """Image channels; overridden from the data."""
    max_grid: int
    """Largest image side in patches (size of the row / column position tables); from the data."""
    vision_width: int
    vision_layers: int
    vision_heads: int
    vocab_size: int
    context_length: int
    text_width: int
    text_layers: int
    text_heads: int
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    init_logit_scale: float = math.log(1 / 0.07)
    learn_logit_scale: bool = True
    init_logit_bias: float | None = None
    """b at the start, for an objective with a bias (the sigmoid loss); None: no bias."""
    learn_logit_bias: bool = True
    eos_id: int = 2
    """End-of-text id where the text tower (clip's) pools; from the tokenizer."""
    act: str = "gelu"
    """MLP activation of the text tower (clip's)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.type == "int" and getattr(self, f.name) < 1:
                raise ValueError(f"VLMArgs.{f.name}={getattr(self, f.name)} must be an integer >= 1")
        for tower in ("vision", "text"):
            width, heads = getattr(self, f"{tower}_width"), getattr(self, f"{tower}_heads")
            if width % heads:
                raise ValueError(f"VLMArgs.{tower}_width={width} is not divisible by {tower}_heads={heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"VLMArgs.dropout={self.dropout} must be in [0, 1)")

    def update_from_config(self, cfg: Any) -> VLMArgs:
        """A copy with the job's `[loss] init_logit_scale` / `learn_logit_scale` (and, for the sigmoid loss,
        `init_logit_bias` / `learn_logit_bias`)."""
        t = temperature_from_config(cfg)
        return dataclasses.replace(
            self,
            init_logit_scale=t.init_logit_scale,
            learn_logit_scale=t.learn_logit_scale,
            init_logit_bias=t.init_logit_bias,
            learn_logit_bias=t.learn_logit_bias,
        )

    @property
    def patch_dim(self) -> int:
        """Length of one `pixel_values` row."""
        return self.in_channels * self.patch_size**2

    def update_from_data(
        self, *, image_shape: tuple[int, int, int], vocab_size: int, context_length: int, eos_id: int = 2
    ) -> VLMArgs:
        """A copy sized for the data; `image_shape` is (C, H, W) of the *largest* resolution served."""
        channels, height, width = image_shape
        if height % self.patch_size or width % self.patch_size:
            raise ValueError(
                f"the largest data image is {height}x{width}, not a multiple of patch_size={self.patch_size}; "
                f"set data.image_sizes to multiples of {self.patch_size}"
            )
        return dataclasses.replace(
            self,
            in_channels=channels,
            max_grid=max(height, width) // self.patch_size,
            vocab_size=vocab_size,
            context_length=context_length,
            eos_id=eos_id,
        )

    def num_params(self) -> int:
        """Exact parameter count of `VLMEmbedder(self)` (tested against the module)."""
        vw = self.vision_width
        vision = (
            self.patch_dim * vw
            + 2 * self.max_grid * vw
            + 2 * vw  # patch embed, row/col positions, ln_pre
            + self.vision_layers * _block_params(vw, mlp_hidden(vw, self.mlp_ratio))
            + 2 * vw
            + vw * self.embed_dim
        )
        return vision + text_tower_params(self) + 1 + (self.init_logit_bias is not None)

    def flops_per_sample(self) -> int:
        """Training FLOPs (3 x forward matmuls) of one pair with the image at the largest resolution
        (an upper bound when `data.image_sizes` mixes resolutions); the loss is excluded."""
        vw, tokens = self.vision_width, self.max_grid**2
        vision = (
            2 * tokens * self.patch_dim * vw
            + self.vision_layers * _block_flops(tokens, vw, mlp_hidden(vw, self.mlp_ratio))
            + 2 * vw * self.embed_dim
        )
        return 3 * (vision + text_tower_flops(self))


vlm_flavors: dict[str, VLMArgs] = {
    # Tiny; trains on a 2-core CPU. Channels, grid, vocab and context come from the data.
    "debug": VLMArgs(
        embed_dim=64,
        patch_size=8,
        in_channels=3,
        max_grid=4,
        vision_width=64,
        vision_layers=2,
        vision_heads=4,
        vocab_size=259,
        context_length=32,
        text_width=64,
        text_layers=2,
        text_heads=4,
    ),
}
