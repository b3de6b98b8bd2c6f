"""The lit family: a trainable ViT image tower against the pretrained all-MiniLM-L6-v2 text tower.

LiT (Zhai et al. 2022, "locked-image tuning") locks a pretrained tower and trains the other one
into its embedding space. Here the roles are swapped, because the pretrained tower that ships
offline is a text one: `[model] freeze = ["text"]` locks MiniLM (sentence-transformers' mean-pooled,
normalized 384-d embedding) and the image tower learns to land on its captions' embeddings;
without `freeze` both towers train (the comparison the README reports). Captions are MiniLM
WordPiece ids (`datasets.tokenizer.CaptionTokenizer`), so any image-text dataset works, bundled or
your own. Needs the `[hf]` extra (transformers and the offline weights package).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from titan_contrastive.components.freeze import locked_forward
from titan_contrastive.datasets.tokenizer import CaptionTokenizer, PairTokenizer
from titan_contrastive.losses import temperature_from_config
from titan_contrastive.models.bi_encoder.args import BiEncoderArgs
from titan_contrastive.models.bi_encoder.embedding import embed
from titan_contrastive.models.bi_encoder.folder import load_config, load_tokenizer, pad_id
from titan_contrastive.models.bi_encoder.tower import load_text_tower
from titan_contrastive.models.clip.args import CLIPArgs, text_tower_flops, text_tower_params
from titan_contrastive.models.clip.model import ImageTower
from titan_contrastive.models.registry import ModelSpec, register_model

__all__ = ["LiT", "LiTArgs", "lit_flavors"]


@dataclass(frozen=True)
class LiTArgs:
    image_size: int = 28
    """Side of the square input images; from the data."""
    patch_size: int = 4
    in_channels: int = 1
    """From the data."""
    vision_width: int = 64
    vision_layers: int = 2
    vision_heads: int = 4
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    patch_dropout: float = 0.0
    """`[model] patch_dropout` (the ViT's)."""
    context_length: int = 16
    """MiniLM tokens per caption ([CLS] and [SEP] included)."""
    init_logit_scale: float = math.log(1 / 0.07)
    learn_logit_scale: bool = True
    init_logit_bias: float | None = None
    """b at the start, for an objective with a bias (the sigmoid loss: SigLIP's SigLiT); None: no bias."""
    learn_logit_bias: bool = True

    @functools.cached_property
    def _text(self) -> BiEncoderArgs:
        return BiEncoderArgs(query_length=self.context_length, doc_length=self.context_length)

    def image_args(self) -> CLIPArgs:
        """The image tower's sizes as the clip family's ViT reads them; it projects to MiniLM's width.
        (Its text fields are placeholders: only `ImageTower` is built from them.)"""
        return CLIPArgs(
            embed_dim=load_config(self._text.model_dir).hidden_size,
            image_size=self.image_size,
            patch_size=self.patch_size,
            in_channels=self.in_channels,
            vision_width=self.vision_width,
            vision_layers=self.vision_layers,
            vision_heads=self.vision_heads,
            vocab_size=1,
            context_length=1,
            text_width=self.vision_heads,
            text_layers=1,
            text_heads=self.vision_heads,
            mlp_ratio=self.mlp_ratio,
            dropout=self.dropout,
            patch_dropout=self.patch_dropout,
        )

    def update_from_config(self, cfg: Any) -> LiTArgs:
        t = temperature_from_config(cfg, default_logit_scale=math.log(1 / 0.07))
        return dataclasses.replace(
            self,
            init_logit_scale=t.init_logit_scale,
            learn_logit_scale=t.learn_logit_scale,
            init_logit_bias=t.init_logit_bias,
            learn_logit_bias=t.learn_logit_bias,
            patch_dropout=cfg.model.patch_dropout,
        )

    def update_from_data(
        self, *, image_shape: tuple[int, int, int], vocab_size: int = 0, context_length: int = 16, eos_id: int = 0
    ) -> LiTArgs:
        channels, height, width = image_shape
        if height != width or height % self.patch_size:
            raise ValueError(
                f"data images are {channels}x{height}x{width}; the image tower needs square images whose side "
                f"the patch size {self.patch_size} divides: set data.image_size"
            )
        return dataclasses.replace(self, in_channels=channels, image_size=height, context_length=context_length)

    def num_params(self) -> int:
        """Exact: the ViT (the clip count without its text tower and scale), MiniLM, logit_scale (and logit_bias)."""
        image = self.image_args()
        bias = self.init_logit_bias is not None
        return (image.num_params() - text_tower_params(image) - 1) + (self._text.num_params() - 1) + 1 + bias

    def flops_per_sample(self) -> int:
        image = self.image_args()
        return (image.flops_per_sample() - 3 * text_tower_flops(image)) + 6 * self._text._counts[
            1
        ] * self.context_length


lit_flavors = {"minilm_debug": LiTArgs()}


class LiT(nn.Module):
    """`visual` (ViT, trained) and `text` (MiniLM, pretrained), `logit_scale`; forward as clip's."""

    def __init__(self, args: LiTArgs) -> None:
        super().__init__()
        self.args = args
        self.visual = ImageTower(args.image_args())
        self.text = load_text_tower(args._text.model_dir)
        self.pad_id = pad_id(load_tokenizer(args._text.model_dir))
        self.logit_scale = nn.Parameter(torch.empty(1), requires_grad=args.learn_logit_scale)
        if args.init_logit_bias is not None:  # the sigmoid loss's bias
            self.logit_bias = nn.Parameter(torch.empty(1), requires_grad=args.learn_logit_bias)
        self.init_weights()

    def init_weights(self) -> None:
        """The image tower, the scale and the bias; MiniLM keeps its pretrained weights."""
        self.visual.init_weights()
        nn.init.constant_(self.logit_scale, self.args.init_logit_scale)
        if self.args.init_logit_bias is not None:
            nn.init.constant_(self.logit_bias, self.args.init_logit_bias)

    def forward(
        self, images: Tensor, texts: Tensor, *, replay: Sequence[Tensor | None] | None = None
    ) -> tuple[Tensor, ...]:
        """(image embeddings, text embeddings, exp(logit_scale)[, logit_bias]); `replay`: in a cached-gradient
        re-forward, pass 1's outputs of these samples (`grad_cache.engine.Replay`), which the locked tower returns
        instead of running."""
        image = locked_forward(self.visual, 0, lambda: self.visual(images), replay)
        out = (image, embed(self.text, texts, self.pad_id, "mean", 1, replay), self.logit_scale.exp())
        return (*out, self.logit_bias) if self.args.init_logit_bias is not None else out


def build_tokenizer(args: LiTArgs) -> CaptionTokenizer:
    hf = load_tokenizer(args._text.model_dir)
    return CaptionTokenizer(PairTokenizer(hf, doc_length=args.context_length, pad_id=pad_id(hf)), args.context_length)


register_model(
    ModelSpec(
        name="lit",
        flavors=lit_flavors,
        build_model=LiT,
        blocks=lambda m: [*m.visual.transformer.blocks, *m.text.encoder.layer],
        build_tokenizer=build_tokenizer,
        towers={"image": "visual.", "text": "text."},
        learns_bias=True,
    )
)
