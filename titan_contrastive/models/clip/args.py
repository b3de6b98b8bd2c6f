"""Hyper-parameters of the CLIP family, its flavors, and analytic size / FLOP counts.

Why analytic counts: the trainer reports MFU and model size before (or without) building
the model, e.g. for a flavor that only fits on a GPU. `num_params` is tested to equal the
built module and `flops_per_sample` is cross-checked against `FlopCounterMode`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from titan_contrastive.losses import temperature_from_config
from titan_contrastive.models.patch_dropout import kept_patches
from titan_contrastive.models.transformer import mlp_hidden

__all__ = ["CLIPArgs", "clip_flavors"]


def _block_params(width: int, hidden: int) -> int:
    """ln_1 + in_proj (3w x w + 3w) + out_proj (w x w + w) + ln_2 + c_fc (+bias) + c_proj (+bias)."""
    return (
        2 * width
        + (3 * width * width + 3 * width)
        + (width * width + width)
        + 2 * width
        + (width * hidden + hidden)
        + (hidden * width + width)
    )


def _block_flops(tokens: int, width: int, hidden: int) -> int:
    """Forward matmul FLOPs of one block: q/k/v + out projections and the MLP (2*T*w*out
    each), plus attention scores and values (2*T*T*w each; causal masking is not
    subtracted, as kernels and `FlopCounterMode` do not subtract it either)."""
    return 2 * tokens * (4 * width * width + 2 * width * hidden) + 2 * 2 * tokens * tokens * width


def text_tower_params(args: Any) -> int:
    """Parameters of the causal text tower (`clip.model.TextTower`) of any args with CLIP's text
    fields (CLIPArgs, VLMArgs): embeddings, blocks, ln_final, projection (no bias)."""
    tw = args.text_width
    return (
        args.vocab_size * tw  # token embedding
        + args.context_length * tw  # positional embedding
        + args.text_layers * _block_params(tw, mlp_hidden(tw, args.mlp_ratio))
        + 2 * tw  # ln_final
        + tw * args.embed_dim  # text projection, no bias
    )


def text_tower_flops(args: Any) -> int:
    """Forward matmul FLOPs of the text tower on one caption (the full context, as the causal
    kernel's FLOPs are not subtracted) and its projection of the pooled token."""
    tw = args.text_width
    return (
        args.text_layers * _block_flops(args.context_length, tw, mlp_hidden(tw, args.mlp_ratio))
        + 2 * tw * args.embed_dim
    )


@dataclass(frozen=True)
class CLIPArgs:
    """Sizes of a CLIP dual encoder: ViT image tower + causal text transformer."""

    embed_dim: int
    """Width of the shared (L2-normalized) embedding space."""
    image_size: int
    """Side of the square input images; overridden from the data by `update_from_data`."""
    patch_size: int
    """Side of the square patches; must divide `image_size`."""
    in_channels: int
    """Image channels; overridden from the data."""
    vision_width: int
    vision_layers: int
    vision_heads: int
    vocab_size: int
    """Token vocabulary size; overridden from the tokenizer."""
    context_length: int
    """Tokens per caption (padded); overridden from the data."""
    text_width: int
    text_layers: int
    text_heads: int
    mlp_ratio: float = 4.0
    """MLP hidden size = int(width * mlp_ratio)."""
    eos_id: int = 2
    """The tokenizer's end-of-text id, where the text tower pools (byte tokenizer 2, CLIP BPE 49407);
    overridden from the tokenizer. -1: pool at the row's highest id (HF's legacy CLIP configs)."""
    act: str = "gelu"
    """MLP activation of both towers: `gelu` (open_clip's ViT-B/32 default) or `quick_gelu`
    (OpenAI's checkpoints); set by a checkpoint's config."""
    dropout: float = 0.0
    """Residual dropout on attention and MLP outputs in both towers."""
    patch_dropout: float = 0.0
    """FLIP's patch dropout: the share of each image's patches the image tower drops in training
    (`models.patch_dropout`); set from `[model] patch_dropout`."""
    init_logit_scale: float = math.log(1 / 0.07)
    """Initial value of the log temperature t' (CLIP: log(1/0.07)); set from the job's loss."""
    init_logit_bias: float | None = None
    """Initial logit bias b of the sigmoid loss; None: no bias (the softmax loss)."""
    learn_logit_scale: bool = True
    """Train t' (a parameter either way; frozen when false)."""
    learn_logit_bias: bool = True

    def __post_init__(self) -> None:
        for name in (
            "embed_dim",
            "image_size",
            "patch_size",
            "in_channels",
            "vision_width",
            "vision_layers",
            "vision_heads",
            "vocab_size",
            "context_length",
            "text_width",
            "text_layers",
            "text_heads",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"CLIPArgs.{name}={getattr(self, name)} must be an integer >= 1")
        if self.act not in ("gelu", "quick_gelu"):
            raise ValueError(f"CLIPArgs.act={self.act!r}: use 'gelu' or 'quick_gelu'")
        for tower in ("vision", "text"):
            width, heads = getattr(self, f"{tower}_width"), getattr(self, f"{tower}_heads")
            if width % heads:
                raise ValueError(
                    f"CLIPArgs.{tower}_width={width} is not divisible by {tower}_heads={heads}; "
                    "choose a width that is a multiple of the head count"
                )
        if self.image_size % self.patch_size:
            raise ValueError(
                f"CLIPArgs.patch_size={self.patch_size} does not divide image_size={self.image_size}; "
                "use an image size that is a multiple of the patch size"
            )
        for name in ("dropout", "patch_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"CLIPArgs.{name}={getattr(self, name)} must be in [0, 1)")
        if mlp_hidden(min(self.vision_width, self.text_width), self.mlp_ratio) < 1:
            raise ValueError(f"CLIPArgs.mlp_ratio={self.mlp_ratio} gives an empty MLP; use a value > 0")

    @property
    def num_patches(self) -> int:
        """Patches per image (the class token is extra)."""
        return (self.image_size // self.patch_size) ** 2

    def update_from_data(
        self, *, image_shape: tuple[int, int, int], vocab_size: int, context_length: int, eos_id: int = 2
    ) -> CLIPArgs:
        """A copy whose input sizes come from the data, so one flavor fits several datasets.

        `image_shape` is (channels, height, width) of one image.
        """
        channels, height, width = image_shape
        if height != width:
            raise ValueError(
                f"data images are {channels}x{height}x{width} but the CLIP image tower needs square "
                "images; resize or crop them to H == W"
            )
        if height % self.patch_size:
            raise ValueError(
                f"data images are {channels}x{height}x{width} but the flavor's "
                f"patch_size={self.patch_size} does not divide {height}; resize the images to a "
                f"multiple of {self.patch_size} (data.image_size) or use a flavor whose patch_size divides the image "
                "size"
            )
        return dataclasses.replace(
            self,
            in_channels=channels,
            image_size=height,
            vocab_size=vocab_size,
            context_length=context_length,
            eos_id=eos_id,
        )

    def update_from_config(self, cfg: Any) -> CLIPArgs:
        """A copy with the temperature and bias the job's loss starts from (`[loss] init_logit_scale`,
        `init_logit_bias`, `learn_*`, or the loss's own initial values: `titan_contrastive.losses`) and
        `[model] patch_dropout`."""
        return dataclasses.replace(
            self, patch_dropout=cfg.model.patch_dropout, **temperature_from_config(cfg)._asdict()
        )

    def num_params(self) -> int:
        """Exact parameter count of `CLIP(self)` (tied to the module layout; tested)."""
        vw = self.vision_width
        vision = (
            vw  # class embedding
            + (self.num_patches + 1) * vw  # positional embedding
            + self.in_channels * self.patch_size**2 * vw  # patch embedding, no bias
            + 2 * vw  # ln_pre
            + self.vision_layers * _block_params(vw, mlp_hidden(vw, self.mlp_ratio))
            + 2 * vw  # ln_post
            + vw * self.embed_dim  # proj, no bias
        )
        return vision + text_tower_params(self) + 1 + (self.init_logit_bias is not None)  # + logit_scale (+ logit_bias)

    def flops_per_sample(self) -> int:
        """Training FLOPs (forward x 3 for forward + backward) of one image-text pair.

        Counts matmuls: patch embedding, all transformer blocks (vision: the patches patch dropout keeps
        + class token; text: the full context, as the causal kernel's FLOPs are not subtracted) and
        the two output projections (applied to one pooled token per tower). The contrastive
        loss is excluded because its cost grows with the batch (N x N logits); add
        `loss_flops(batch)` for a step.
        """
        vw = self.vision_width
        vision = (
            2 * self.num_patches * self.in_channels * self.patch_size**2 * vw
            + self.vision_layers
            * _block_flops(kept_patches(self.num_patches, self.patch_dropout) + 1, vw, mlp_hidden(vw, self.mlp_ratio))
            + 2 * vw * self.embed_dim
        )
        return 3 * (vision + text_tower_flops(self))

    def loss_flops(self, batch: int) -> int:
        """Training FLOPs of the logits of `batch` pairs scored against each other.

        The forward `image_emb @ text_emb.T` is 2 * N^2 * embed_dim; the backward needs two
        matmuls of the same size (gradients for both sides), hence x 3 like `flops_per_sample`.
        """
        return 3 * 2 * batch * batch * self.embed_dim


# OpenAI / open_clip ViT-B/32: 151,277,313 parameters with vocab 49408 and context 77.
_VIT_B32 = CLIPArgs(
    embed_dim=512,
    image_size=224,
    patch_size=32,
    in_channels=3,
    vision_width=768,
    vision_layers=12,
    vision_heads=12,
    vocab_size=49408,
    context_length=77,
    text_width=512,
    text_layers=12,
    text_heads=8,
)

clip_flavors: dict[str, CLIPArgs] = {
    # Tiny; trains on a 2-core CPU. Image / vocab / context sizes come from the data.
    "debug": CLIPArgs(
        embed_dim=64,
        image_size=28,
        patch_size=4,
        in_channels=1,
        vision_width=64,
        vision_layers=2,
        vision_heads=4,
        vocab_size=259,
        context_length=32,
        text_width=64,
        text_layers=2,
        text_heads=4,
    ),
    "vit_b32": _VIT_B32,
    # open_clip ViT-B-16 / ViT-L-14 (OpenAI's ViT-B/16, ViT-L/14: 149,620,737 and 427,616,513 parameters);
    # OpenAI's own weights use quick GELU (their checkpoints' config sets it when loaded with init_from)
    "vit_b16": dataclasses.replace(_VIT_B32, patch_size=16),
    "vit_l14": CLIPArgs(
        embed_dim=768,
        image_size=224,
        patch_size=14,
        in_channels=3,
        vision_width=1024,
        vision_layers=24,
        vision_heads=16,
        vocab_size=49408,
        context_length=77,
        text_width=768,
        text_layers=12,
        text_heads=12,
    ),
}
