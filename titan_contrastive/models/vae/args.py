"""Sizes of the `vae` family and its flavors."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from titan_contrastive.components.pixel_loss import PixelLossOptions

__all__ = ["VAEArgs", "vae_flavors"]


@dataclass(frozen=True)
class VAEArgs:
    """A conv autoencoder: `len(channel_mults)` levels, a 2x down/upsample between levels."""

    in_channels: int
    """Image channels; overridden from the data."""
    latent_channels: int
    base_channels: int
    channel_mults: tuple[int, ...]
    num_res_blocks: int
    """ResBlocks per encoder level (the decoder has `num_res_blocks + extra_decoder_blocks`)."""
    groups: int = 32
    """GroupNorm groups; every width must be a multiple."""
    mid_attention: bool = False
    """A self-attention block (between two ResBlocks) at the lowest resolution, as in SD / FLUX."""
    extra_decoder_blocks: int = 1
    """SD's decoder has one ResBlock more per level than its encoder."""
    pixel_loss: PixelLossOptions = field(default_factory=PixelLossOptions)
    """How forward scores reconstructions (`compute_pixel_loss` keywords); set from `[pixel_loss]`."""

    def __post_init__(self) -> None:
        for name in ("in_channels", "latent_channels", "base_channels", "num_res_blocks", "groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"VAEArgs.{name}={getattr(self, name)} must be an integer >= 1")
        if not self.channel_mults or any(m < 1 for m in self.channel_mults):
            raise ValueError(f"VAEArgs.channel_mults={self.channel_mults} must be a non-empty tuple of integers >= 1")
        bad = [self.base_channels * m for m in self.channel_mults if self.base_channels * m % self.groups]
        if bad:
            raise ValueError(f"VAEArgs: widths {bad} are not multiples of groups={self.groups}")

    @property
    def downsample(self) -> int:
        """Image side / latent side (8 for the SD / FLUX VAE)."""
        return 2 ** (len(self.channel_mults) - 1)

    def update_from_data(
        self, *, image_shape: tuple[int, int, int], vocab_size: int = 0, context_length: int = 0, eos_id: int = 0
    ) -> VAEArgs:
        """A copy with the data's channel count; image sides must be multiples of `downsample`."""
        channels, height, width = image_shape
        if height % self.downsample or width % self.downsample:
            raise ValueError(
                f"the data images are {height}x{width}, not multiples of the vae's downsampling factor "
                f"{self.downsample}; set data.image_size / data.image_sizes to multiples of {self.downsample}"
            )
        return dataclasses.replace(self, in_channels=channels)

    def update_from_config(self, cfg: Any) -> VAEArgs:
        """A copy with the job's `[pixel_loss]` options."""
        px = cfg.pixel_loss
        return dataclasses.replace(
            self,
            pixel_loss=PixelLossOptions(
                mode=px.mode,
                loss_type=px.loss_type,
                chunk_size=px.chunk_size,
                adaptive=px.adaptive,
                empty_cache_every=px.empty_cache_every,
            ),
        )

    def num_params(self) -> int:
        """Parameter count, from a meta-device build (the layout has too many cases to count by hand)."""
        from titan_contrastive.models.vae.model import AutoEncoder

        with torch.device("meta"):
            return sum(p.numel() for p in AutoEncoder(self).parameters())

    def flops_per_sample(self) -> int:
        """0: not modelled (convolution FLOPs depend on the image size); no MFU is reported."""
        return 0


vae_flavors: dict[str, VAEArgs] = {
    # Tiny; trains on a 2-core CPU: 4x downsampling, 4 latent channels.
    "debug": VAEArgs(
        in_channels=3, latent_channels=4, base_channels=32, channel_mults=(1, 2, 2), num_res_blocks=1, groups=8
    ),
    # Shaped like the SD-3 / FLUX VAE: 16 latent channels, 8x downsampling, widths 128-256-512-512,
    # 2 (encoder) / 3 (decoder) ResBlocks per level, mid attention. Random weights: for memory benchmarks.
    "sd": VAEArgs(
        in_channels=3,
        latent_channels=16,
        base_channels=128,
        channel_mults=(1, 2, 4, 4),
        num_res_blocks=2,
        groups=32,
        mid_attention=True,
    ),
}
