"""Convolutional autoencoder with group norm, laid out like the SD / FLUX VAE.

Encoder: conv_in -> per level (ResBlock x n, then a stride-2 downsample except at the last level)
-> mid ResBlock [+ self-attention + ResBlock] -> GroupNorm, SiLU -> conv_out to the latent channels.
Decoder: the mirror, with nearest-neighbour 2x upsampling + conv. Latents are deterministic (no KL
term, no sampling): the family exists to train and benchmark the chunked pixel loss, whose cost is
all in the decoder. `AutoEncoder.forward(images, masks)` returns the pixel loss, computed *inside*
the module so a per-chunk decoder backward runs during the DP wrapper's forward (see
`AutoEncoder.forward`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titan_contrastive.components.pixel_loss import compute_pixel_loss
from titan_contrastive.models.vae.args import VAEArgs

__all__ = ["AutoEncoder", "Decoder", "Encoder", "ResBlock", "vae_blocks"]


class ResBlock(nn.Module):
    """GroupNorm -> SiLU -> conv3x3, twice, plus a (1x1 when widths differ) skip."""

    def __init__(self, cin: int, cout: int, groups: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(groups, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(groups, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        return self.skip(x) + self.conv2(F.silu(self.norm2(h)))


class AttnBlock(nn.Module):
    """Single-head self-attention over the H·W positions (the SD VAE's mid-block attention)."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.norm, self.qkv, self.out = (
            nn.GroupNorm(groups, channels),
            nn.Conv2d(channels, 3 * channels, 1),
            nn.Conv2d(channels, channels, 1),
        )

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, 3, 1, c, h * w).transpose(-1, -2).unbind(1)  # [B, 1, HW, C]
        out = F.scaled_dot_product_attention(q, k, v).transpose(-1, -2).reshape(b, c, h, w)
        return x + self.out(out)


def _mid(channels: int, args: VAEArgs) -> list[nn.Module]:
    blocks: list[nn.Module] = [ResBlock(channels, channels, args.groups)]
    if args.mid_attention:
        blocks += [AttnBlock(channels, args.groups), ResBlock(channels, channels, args.groups)]
    return blocks


class _ConvStack(nn.Module):
    """conv_in -> blocks -> GroupNorm, SiLU -> conv_out: the shape the encoder and decoder share."""

    conv_in: nn.Conv2d
    blocks: nn.ModuleList
    norm_out: nn.GroupNorm
    conv_out: nn.Conv2d

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv_in(x)
        for block in self.blocks:
            x = block(x)
        return self.conv_out(F.silu(self.norm_out(x)))


class Encoder(_ConvStack):
    def __init__(self, args: VAEArgs) -> None:
        super().__init__()
        widths = [args.base_channels * m for m in args.channel_mults]
        self.conv_in = nn.Conv2d(args.in_channels, widths[0], 3, padding=1)
        blocks: list[nn.Module] = []
        cin = widths[0]
        for level, width in enumerate(widths):
            for _ in range(args.num_res_blocks):
                blocks.append(ResBlock(cin, width, args.groups))
                cin = width
            if level < len(widths) - 1:
                blocks.append(nn.Conv2d(width, width, 3, stride=2, padding=1))
        self.blocks = nn.ModuleList([*blocks, *_mid(cin, args)])
        self.norm_out, self.conv_out = (
            nn.GroupNorm(args.groups, cin),
            nn.Conv2d(cin, args.latent_channels, 3, padding=1),
        )


class Upsample(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Decoder(_ConvStack):
    def __init__(self, args: VAEArgs) -> None:
        super().__init__()
        widths = [args.base_channels * m for m in args.channel_mults][::-1]
        self.conv_in = nn.Conv2d(args.latent_channels, widths[0], 3, padding=1)
        blocks: list[nn.Module] = _mid(widths[0], args)
        cin = widths[0]
        for level, width in enumerate(widths):
            for _ in range(args.num_res_blocks + args.extra_decoder_blocks):
                blocks.append(ResBlock(cin, width, args.groups))
                cin = width
            if level < len(widths) - 1:
                blocks.append(Upsample(width))
        self.blocks = nn.ModuleList(blocks)
        self.norm_out, self.conv_out = nn.GroupNorm(args.groups, cin), nn.Conv2d(cin, args.in_channels, 3, padding=1)


class AutoEncoder(nn.Module):
    """`encoder` images -> latents, `decoder` latents -> images; forward returns the pixel loss."""

    def __init__(self, args: VAEArgs) -> None:
        super().__init__()
        self.args = args
        self.encoder, self.decoder = Encoder(args), Decoder(args)

    def init_weights(self, seed: int | None = None) -> None:
        """PyTorch's default conv / norm init (what the SD VAE trains from)."""
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.GroupNorm)):
                module.reset_parameters()

    def forward(
        self,
        images: Tensor,
        masks: Tensor,
        backward_scale: float = 1.0,
        reconstruct: bool = False,
        decode_chunk: int | None = None,
    ) -> tuple[Tensor, Tensor] | Tensor:
        """(masked pixel loss of the reconstruction, latents); `reconstruct=True` (evaluation): the
        decoded images only, which the evaluation scores itself. Going through forward matters
        under FSDP2, whose root unshards its parameters only there. `decode_chunk` fixes the
        images per decoder call for this forward (the memory planner's knob).

        Order: encode -> `compute_pixel_loss` (decode in chunks per `args.pixel_loss`). With
        mode per_chunk_backward the decoder's backward happens here, inside the DP wrapper's
        forward, where DDP ignores gradient hooks; a zero-weighted touch of every decoder
        parameter then makes the caller's backward fire their hooks once, so DDP all-reduces the
        accumulated decoder gradients with the encoder's.
        """
        if images.shape[2] % self.args.downsample or images.shape[3] % self.args.downsample:
            raise ValueError(
                f"images are {images.shape[2]}x{images.shape[3]}; the vae needs sides divisible by its "
                f"downsampling factor {self.args.downsample} (pad them, see pad_to_batch)"
            )
        latents = self.encoder(images)
        if reconstruct:
            return self.decoder(latents)
        options = self.args.pixel_loss
        loss = compute_pixel_loss(
            latents, images, masks, self.decoder, backward_scale=backward_scale, **options.kwargs(decode_chunk)
        )
        if options.mode == "per_chunk_backward" and torch.is_grad_enabled():
            loss = loss + sum(p.reshape(-1)[0] * 0 for p in self.decoder.parameters() if p.requires_grad)
        return loss, latents


def vae_blocks(model: nn.Module) -> list[nn.Module]:
    """`ModelSpec.blocks`: the encoder's and decoder's residual / attention / resampling blocks."""
    if not isinstance(model, AutoEncoder):
        raise TypeError(f"vae_blocks expects an AutoEncoder, got {type(model).__name__}")
    return [*model.encoder.blocks, *model.decoder.blocks]
