"""Sizes of the `vae` family and its flavors."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

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
        """Exact parameter count of `AutoEncoder(self)` (tested against the module)."""
        widths = [self.base_channels * m for m in self.channel_mults]

        def mid(c: int) -> int:
            attention = _norm(c) + _conv(c, 3 * c, 1) + _conv(c, c, 1) + _res(c, c) if self.mid_attention else 0
            return _res(c, c) + attention

        def levels(widths: list[int], blocks: int) -> int:  # ResBlocks per level, a resampling conv between levels
            cin, total = widths[0], 0
            for width in widths:
                total += _res(cin, width) + (blocks - 1) * _res(width, width)
                cin = width
            return total + sum(_conv(w, w, 3) for w in widths[:-1])

        encoder = _conv(self.in_channels, widths[0], 3) + levels(widths, self.num_res_blocks) + mid(widths[-1])
        decoder = _conv(self.latent_channels, widths[-1], 3) + mid(widths[-1])
        decoder += levels(widths[::-1], self.num_res_blocks + self.extra_decoder_blocks)
        outputs = _norm(widths[-1]) + _conv(widths[-1], self.latent_channels, 3)
        outputs += _norm(widths[0]) + _conv(widths[0], self.in_channels, 3)
        return encoder + decoder + outputs

    def flops_per_sample(self) -> int:
        """0: not modelled (convolution FLOPs depend on the image size); no MFU is reported."""
        return 0


def _conv(cin: int, cout: int, kernel: int) -> int:
    return cin * cout * kernel * kernel + cout


def _norm(channels: int) -> int:
    return 2 * channels


def _res(cin: int, cout: int) -> int:
    """A ResBlock: two norms and 3x3 convs, and a 1x1 skip conv when the widths differ."""
    skip = _conv(cin, cout, 1) if cin != cout else 0
    return _norm(cin) + _conv(cin, cout, 3) + _norm(cout) + _conv(cout, cout, 3) + skip


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
