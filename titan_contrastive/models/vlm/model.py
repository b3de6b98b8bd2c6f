"""A VLM embedder that consumes Qwen-VL-style packed patches at mixed resolutions.

Image tower, order of operations:
1. check `pixel_values` [T, C·p·p] against `image_grid_thw` [B, 3] (t = 1, h, w ≤ max_grid, Σ h·w = T);
2. embed every patch (a linear map of the flattened patch) and add its row and column position
   embeddings (factorized, so any h×w grid up to max_grid works);
3. unpack to [B, max h·w, width] with zero padding and a key-padding mask, run the transformer
   (padding is never attended, so an image's embedding does not depend on its batch: tested);
4. mean-pool the image's own tokens, LayerNorm, project, L2-normalize.

Why pad-and-mask rather than one packed sequence with a block-diagonal mask: the dense mask of a
packed batch is T×T (quadratic in the whole batch), the padded form is B·L² with L the largest
image; and every block runs once per forward, which is what per-block FSDP2, activation
checkpointing and compile expect.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from titan_contrastive.models.clip.model import TextTower
from titan_contrastive.models.transformer import Transformer
from titan_contrastive.models.vlm.args import VLMArgs

__all__ = ["PackedImageTower", "VLMEmbedder", "vlm_blocks"]


class PackedImageTower(nn.Module):
    """Patch embedding + 2-D factorized positions -> masked transformer -> mean pool -> projection."""

    def __init__(self, args: VLMArgs) -> None:
        super().__init__()
        width = args.vision_width
        self.patch_dim, self.max_grid = args.patch_dim, args.max_grid
        self.patch_embed = nn.Linear(args.patch_dim, width, bias=False)
        self.row_embedding = nn.Parameter(torch.empty(args.max_grid, width))
        self.col_embedding = nn.Parameter(torch.empty(args.max_grid, width))
        self.ln_pre = nn.LayerNorm(width)
        self.transformer = Transformer(
            width, args.vision_layers, args.vision_heads, args.mlp_ratio, args.dropout, causal=False
        )
        self.ln_post = nn.LayerNorm(width)
        self.proj = nn.Parameter(torch.empty(width, args.embed_dim))

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """ViT-style: positions and projection ~ N(0, width^-0.5), patch embedding like a conv."""
        scale = self.proj.shape[0] ** -0.5
        nn.init.kaiming_uniform_(self.patch_embed.weight, a=math.sqrt(5), generator=generator)
        for param in (self.row_embedding, self.col_embedding, self.proj):
            nn.init.normal_(param, std=scale, generator=generator)
        self.ln_pre.reset_parameters()
        self.ln_post.reset_parameters()
        self.transformer.init_weights(generator)

    def _check(self, pixel_values: Tensor, grid: Tensor) -> Tensor:
        if pixel_values.ndim != 2 or pixel_values.shape[1] != self.patch_dim:
            raise ValueError(
                f"pixel_values must be [total_patches, {self.patch_dim}] (C·p·p), got {list(pixel_values.shape)}"
            )
        if grid.ndim != 2 or grid.shape[1] != 3 or grid.is_floating_point():
            raise ValueError(
                f"image_grid_thw must be integer [num_images, 3] (t, h, w), got {grid.dtype} {list(grid.shape)}"
            )
        if len(grid) and (
            bool((grid[:, 0] != 1).any()) or int(grid[:, 1:].min()) < 1 or int(grid[:, 1:].max()) > self.max_grid
        ):
            raise ValueError(
                f"image_grid_thw rows must be (1, h, w) with 1 <= h, w <= max_grid={self.max_grid} (still "
                f"images up to the largest training size), got {grid.tolist()}"
            )
        lengths = grid[:, 1] * grid[:, 2]
        if int(lengths.sum()) != pixel_values.shape[0]:
            raise ValueError(
                f"image_grid_thw gives {int(lengths.sum())} patches but pixel_values has {pixel_values.shape[0]} rows"
            )
        return lengths

    def forward(self, pixel_values: Tensor, image_grid_thw: Tensor) -> Tensor:
        """Packed patches of B images -> [B, embed_dim] unit-norm embeddings."""
        lengths = self._check(pixel_values, image_grid_thw)
        widths = image_grid_thw[:, 2].repeat_interleave(lengths)
        starts = (torch.cumsum(lengths, 0) - lengths).repeat_interleave(lengths)
        local = torch.arange(len(pixel_values), device=pixel_values.device) - starts  # token index inside its image
        x = self.patch_embed(pixel_values) + (
            self.row_embedding[local // widths] + self.col_embedding[local % widths]
        ).to(pixel_values.dtype)
        x = pad_sequence(list(x.split(lengths.tolist())), batch_first=True)  # [B, L, width]
        valid = torch.arange(x.shape[1], device=x.device) < lengths.unsqueeze(1)  # [B, L]
        x = self.transformer(self.ln_pre(x), attn_mask=valid[:, None, None, :])
        x = self.ln_post(x) * valid.unsqueeze(-1)
        pooled = x.sum(1) / lengths.unsqueeze(1).to(x.dtype)
        return F.normalize(pooled @ self.proj, dim=-1)


class VLMEmbedder(nn.Module):
    """Packed-patch image tower `visual`, causal text tower `text`, learnable `logit_scale`."""

    def __init__(self, args: VLMArgs) -> None:
        super().__init__()
        self.args = args
        self.visual = PackedImageTower(args)
        self.text = TextTower(args)  # type: ignore[arg-type]  # VLMArgs has the text fields TextTower reads
        # shape [1]: FSDP2 shards on dim 0
        self.logit_scale = nn.Parameter(torch.empty(1), requires_grad=args.learn_logit_scale)
        if args.init_logit_bias is not None:  # the sigmoid loss's bias
            self.logit_bias = nn.Parameter(torch.empty(1), requires_grad=args.learn_logit_bias)
        self.init_weights()

    def init_weights(self, seed: int | None = None) -> None:
        """(Re)initialize in place; `seed` uses a private generator (see CLIP.init_weights)."""
        device = self.logit_scale.device
        generator = (
            torch.Generator(device=device).manual_seed(seed) if seed is not None and device.type != "meta" else None
        )
        self.visual.init_weights(generator)
        self.text.init_weights(generator)
        nn.init.constant_(self.logit_scale, self.args.init_logit_scale)
        if self.args.init_logit_bias is not None:
            nn.init.constant_(self.logit_bias, self.args.init_logit_bias)

    def forward(self, pixel_values: Tensor, image_grid_thw: Tensor, text: Tensor) -> tuple[Tensor, ...]:
        """(image embeddings [B, d], text embeddings [B, d], exp(logit_scale)[, logit_bias])."""
        out = (self.visual(pixel_values, image_grid_thw), self.text(text), self.logit_scale.exp())
        return (*out, self.logit_bias) if self.args.init_logit_bias is not None else out


def vlm_blocks(model: nn.Module) -> list[nn.Module]:
    """`ModelSpec.blocks` for the vlm family: the residual blocks of both towers."""
    if not isinstance(model, VLMEmbedder):
        raise TypeError(f"vlm_blocks expects a VLMEmbedder, got {type(model).__name__}")
    return [*model.visual.transformer.blocks, *model.text.transformer.blocks]
