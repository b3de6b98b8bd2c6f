"""CLIP dual encoder: ViT image tower, causal text tower, learnable log temperature.

Each tower returns the final L2-normalized embedding, so `model.encoder_x(images)` equals
`model.encode_image(images)`; a streaming (GradCache-like) step can therefore run the towers
separately without re-implementing the projection / normalization.

No buffers: every tensor is a parameter, so a model built on the meta device is complete
after `to_empty(device=...)` + `init_weights()`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titan_contrastive.components.freeze import locked_forward
from titan_contrastive.models.clip.args import CLIPArgs
from titan_contrastive.models.patch_dropout import PatchDropout
from titan_contrastive.models.transformer import Transformer

__all__ = ["CLIP", "EOS_ID", "ImageTower", "TextTower", "clip_blocks", "patchify"]

EOS_ID = 2
"""End-of-text id of the byte tokenizer (PAD=0, BOS=1, EOS=2), the default of `CLIPArgs.eos_id`."""


def patchify(images: Tensor, patch: int) -> Tensor:
    """[B, C, H, W] -> [B, (H/patch)(W/patch), C*patch*patch], patches in row-major order, each flattened
    as (channel, row, column): the conv weight's layout. The patch embedding is then one GEMM against
    `conv1.weight.flatten(1)`: the sums of the stride-`patch` convolution, which cuDNN can run far slower
    than the GEMM (its weight gradient above all; docs/performance.md)."""
    b, c, h, w = images.shape
    x = images.reshape(b, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // patch) * (w // patch), c * patch * patch)


class ImageTower(nn.Module):
    """ViT: patch embedding + class token + positional embedding -> (patch dropout) -> blocks -> class token
    -> proj."""

    def __init__(self, args: CLIPArgs) -> None:
        super().__init__()
        width = args.vision_width
        self.in_channels, self.image_size = args.in_channels, args.image_size
        patch = args.patch_size
        self.conv1 = nn.Conv2d(args.in_channels, width, kernel_size=patch, stride=patch, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(width))
        self.positional_embedding = nn.Parameter(torch.empty(args.num_patches + 1, width))
        self.patch_dropout = PatchDropout(args.patch_dropout, prefix=1)
        self.ln_pre = nn.LayerNorm(width)
        self.transformer = Transformer(
            width, args.vision_layers, args.vision_heads, args.mlp_ratio, args.dropout, causal=False, act=args.act
        )
        self.ln_post = nn.LayerNorm(width)
        self.proj = nn.Parameter(torch.empty(width, args.embed_dim))

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """open_clip ViT init: embeddings and projection ~ N(0, width^-0.5); the patch
        embedding keeps PyTorch's default conv init (uniform, bound fan_in^-0.5)."""
        scale = self.proj.shape[0] ** -0.5
        nn.init.kaiming_uniform_(self.conv1.weight, a=math.sqrt(5), generator=generator)
        for param in (self.class_embedding, self.positional_embedding, self.proj):
            nn.init.normal_(param, std=scale, generator=generator)
        self.ln_pre.reset_parameters()
        self.ln_post.reset_parameters()
        self.transformer.init_weights(generator)

    def forward(self, images: Tensor) -> Tensor:
        """[B, C, H, W] images -> [B, embed_dim] unit-norm embeddings."""
        expected = (self.in_channels, self.image_size, self.image_size)
        if images.ndim != 4 or tuple(images.shape[1:]) != expected:
            raise ValueError(
                f"image tower expects images of shape [B, {', '.join(map(str, expected))}] "
                f"(in_channels, image_size, image_size), got {list(images.shape)}"
            )
        x = F.linear(patchify(images, self.conv1.kernel_size[0]), self.conv1.weight.flatten(1))  # [B, patches, width]
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + self.positional_embedding.to(x.dtype)
        x = self.transformer(self.ln_pre(self.patch_dropout(x)))
        return F.normalize(self.ln_post(x[:, 0]) @ self.proj, dim=-1)


class TextTower(nn.Module):
    """Causal transformer over token ids, pooled at the EOS token, then projected."""

    def __init__(self, args: CLIPArgs) -> None:
        super().__init__()
        width = args.text_width
        self.context_length = args.context_length
        self.eos_id = args.eos_id
        self.token_embedding = nn.Embedding(args.vocab_size, width)
        self.positional_embedding = nn.Parameter(torch.empty(args.context_length, width))
        self.transformer = Transformer(
            width, args.text_layers, args.text_heads, args.mlp_ratio, args.dropout, causal=True, act=args.act
        )
        self.ln_final = nn.LayerNorm(width)
        self.text_projection = nn.Parameter(torch.empty(width, args.embed_dim))

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """open_clip text init: token std 0.02, positions std 0.01, projection std width^-0.5."""
        nn.init.normal_(self.token_embedding.weight, std=0.02, generator=generator)
        nn.init.normal_(self.positional_embedding, std=0.01, generator=generator)
        self.ln_final.reset_parameters()
        nn.init.normal_(self.text_projection, std=self.text_projection.shape[0] ** -0.5, generator=generator)
        self.transformer.init_weights(generator)

    def forward(self, ids: Tensor) -> Tensor:
        """[B, L] token ids -> [B, embed_dim] unit-norm embeddings, read at the first EOS.

        A row without EOS is pooled at position 0 (argmax of an all-zero row).
        """
        if ids.ndim != 2 or ids.shape[1] != self.context_length or ids.is_floating_point():
            raise ValueError(
                f"text tower expects integer token ids of shape [B, {self.context_length}] (context_length), "
                f"got {ids.dtype} {list(ids.shape)}"
            )
        x = self.token_embedding(ids) + self.positional_embedding
        x = self.transformer(x)
        eos = ids.argmax(-1) if self.eos_id < 0 else (ids == self.eos_id).int().argmax(-1)
        pooled = x[torch.arange(x.shape[0], device=x.device), eos]
        return F.normalize(self.ln_final(pooled) @ self.text_projection, dim=-1)


class CLIP(nn.Module):
    """Image tower `visual`, text tower `text` and the learnable log temperature `logit_scale`.

    Built with the global torch RNG (seed it first for reproducibility); a meta-device build
    is materialized with `to_empty(device=...)` followed by `init_weights()`.
    """

    def __init__(self, args: CLIPArgs) -> None:
        super().__init__()
        self.args = args
        self.visual = ImageTower(args)
        self.text = TextTower(args)
        # shape [1], not a scalar: FSDP2 shards parameters on dim 0 and rejects 0-d ones
        self.logit_scale = nn.Parameter(torch.empty(1), requires_grad=args.learn_logit_scale)
        if args.init_logit_bias is not None:  # the sigmoid loss's bias
            self.logit_bias = nn.Parameter(torch.empty(1), requires_grad=args.learn_logit_bias)
        self.init_weights()

    @property
    def encoder_x(self) -> ImageTower:
        """The tower for the first modality (images), under the name the streaming step uses."""
        return self.visual

    @property
    def encoder_y(self) -> TextTower:
        """The tower for the second modality (text)."""
        return self.text

    def init_weights(self, seed: int | None = None) -> None:
        """(Re)initialize every parameter in place.

        With `seed=None` the global RNG is used (deterministic given `torch.manual_seed`);
        with a seed, a private generator on the parameters' device, leaving the global RNG
        untouched (on the meta device there is nothing to draw, so the seed is ignored).
        """
        device = self.logit_scale.device
        generator = None
        if seed is not None and device.type != "meta":
            generator = torch.Generator(device=device).manual_seed(seed)
        self.visual.init_weights(generator)
        self.text.init_weights(generator)
        nn.init.constant_(self.logit_scale, self.args.init_logit_scale)
        if self.args.init_logit_bias is not None:
            nn.init.constant_(self.logit_bias, self.args.init_logit_bias)

    def encode_image(self, images: Tensor, replay: Sequence[Tensor | None] | None = None) -> Tensor:
        """[B, C, H, W] -> [B, embed_dim], L2-normalized (a locked tower: `locked_forward`, `replay`
        as forward's)."""
        return locked_forward(self.visual, 0, lambda: self.visual(images), replay)

    def encode_text(self, ids: Tensor, replay: Sequence[Tensor | None] | None = None) -> Tensor:
        """[B, context_length] token ids -> [B, embed_dim], L2-normalized (a locked tower:
        `locked_forward`, `replay` as forward's)."""
        return locked_forward(self.text, 1, lambda: self.text(ids), replay)

    def forward(
        self, images: Tensor, texts: Tensor, *, replay: Sequence[Tensor | None] | None = None
    ) -> tuple[Tensor, ...]:
        """(image embeddings, text embeddings, exp(logit_scale)[, logit_bias]).

        The temperature (and the sigmoid loss's bias) are returned by forward (as open_clip does)
        rather than read from the attributes by the caller: under FSDP2 a parameter is only
        unsharded inside forward. `replay`: in a cached-gradient re-forward, pass 1's outputs of
        these samples (`grad_cache.engine.Replay`), which a locked tower returns instead of running.
        """
        out = (self.encode_image(images, replay), self.encode_text(texts, replay), self.logit_scale.exp())
        return (*out, self.logit_bias) if self.args.init_logit_bias is not None else out

    def blocks(self) -> list[nn.Module]:
        """Residual blocks of both towers: the per-block FSDP / checkpoint / compile units."""
        return [*self.visual.transformer.blocks, *self.text.transformer.blocks]


def clip_blocks(model: nn.Module) -> list[nn.Module]:
    """`ModelSpec.blocks` for the CLIP family."""
    if not isinstance(model, CLIP):
        raise TypeError(f"clip_blocks expects a CLIP model, got {type(model).__name__}")
    return model.blocks()
