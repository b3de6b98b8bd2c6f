"""The qwen_vl family: a Qwen2-VL / Qwen2.5-VL / Qwen3-VL model from a local folder as an embedder
(VLM2Vec's and GME's recipe): one tower embeds queries and documents, each the normalized hidden
state of its last real token (or the mean over its tokens), a text or an image with its template.

A batch (`datasets`: any image-text set served through `QwenVLArgs.processor`) holds `query` and
`doc` token ids [B, L] right-padded with -1, and the image side's packed `pixel_values` with its
`image_grid_thw` (one image per sample; `[data] retrieval_mode` t2i: the documents are the images,
i2t: the queries). The model builds what the transformers model needs beside the ids: the
attention mask (ids != -1) and `mm_token_type_ids` (1 at `<|image_pad|>`, for M-RoPE).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titan_contrastive.batching import NEGATIVES, right_trimmed
from titan_contrastive.components.lora import add_lora
from titan_contrastive.config import ConfigError
from titan_contrastive.losses import temperature_from_config
from titan_contrastive.models.bi_encoder.folder import layer_blocks, load_config, read_text_folder
from titan_contrastive.models.bi_encoder.model import load_text_tower, pooled
from titan_contrastive.models.qwen_vl.processor import IMAGE, PAD, VLProcessor

__all__ = ["MODES", "QwenVLArgs", "QwenVLEmbedder", "qwen_vl_blocks", "qwen_vl_flavors", "vl_embed"]

LORA_TARGETS = ("q_proj", "v_proj")
"""LoRA's default: the language model's query and value projections (the vision blocks name theirs
`qkv`: they stay frozen unless `[lora] target_modules` names them)."""
MODES = {"t2i": "doc", "i2t": "query"}
"""Retrieval mode -> the side whose samples are images (the other is the caption)."""


@dataclass(frozen=True)
class QwenVLArgs:
    path: str = ""
    """The model folder (config, weights, tokenizer, preprocessor_config.json); `[model] path`."""
    mode: str = "t2i"
    """`[data] retrieval_mode`: t2i (captions query images) or i2t."""
    pooling: str = "last_token"
    text_template: str = "{text}"
    """The text side's template (`[model] query_prompt` / `doc_prompt` for that side)."""
    image_template: str = IMAGE
    """The image side's: `{image}` where the image goes, e.g. "{image} Summarize above image in one word:"."""
    min_pixels: int = 0
    """Images are resized to at least this many pixels (0: the folder's image processor's)."""
    max_pixels: int = 0
    """... and at most this many: the visual tokens per image (0: the folder's)."""
    text_length: int = 32
    """Caption tokens at most (`[data] context_length`; set before the data is laid out), before the template."""
    init_scale: float = 50.0
    """t at the start: VLM2Vec's temperature 0.02."""
    learn_logit_scale: bool = True
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ()
    lora_modules_to_save: tuple[str, ...] = ()

    def update_from_config(self, cfg: Any) -> QwenVLArgs:
        t = temperature_from_config(cfg, default_logit_scale=math.log(self.init_scale))
        mode = cfg.data.retrieval_mode
        if mode not in MODES:
            raise ConfigError(f"data.retrieval_mode={mode!r}: the qwen_vl family trains {' or '.join(MODES)}")
        image_side = MODES[mode]
        prompts = {"query": cfg.model.query_prompt, "doc": cfg.model.doc_prompt}
        image_prompt, text_prompt = prompts[image_side], prompts["doc" if image_side == "query" else "query"]
        if image_prompt != "auto" and IMAGE not in image_prompt:
            raise ConfigError(
                f"model.{image_side}_prompt={image_prompt!r}: the image side's template needs {IMAGE} where the "
                f"image goes (retrieval_mode={mode}), e.g. '{IMAGE} Summarize above image in one word:'"
            )
        pooling = "last_token" if cfg.model.pooling == "auto" else cfg.model.pooling
        if pooling not in ("last_token", "mean"):
            raise ConfigError(f"model.pooling={pooling!r}: the qwen_vl family pools last_token or mean")
        lora = cfg.lora
        path = read_text_folder(cfg.model.path or self.path).model_dir if (cfg.model.path or self.path) else ""
        if not path:
            raise ConfigError("model.path is empty: the qwen_vl family needs a local Qwen-VL folder")
        return dataclasses.replace(
            self,
            path=path,
            mode=mode,
            pooling=pooling,
            text_template=self.text_template if text_prompt == "auto" else text_prompt,
            image_template=self.image_template if image_prompt == "auto" else image_prompt,
            min_pixels=cfg.data.min_pixels,
            text_length=cfg.data.context_length,
            max_pixels=cfg.data.max_pixels,
            init_scale=math.exp(t.init_logit_scale),
            learn_logit_scale=t.learn_logit_scale,
            lora_rank=lora.rank if lora.enable else 0,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            lora_targets=(tuple(lora.target_modules) or LORA_TARGETS) if lora.enable else (),
            lora_modules_to_save=tuple(lora.modules_to_save) if lora.enable else (),
        )

    def update_from_data(
        self, *, image_shape: Any = None, vocab_size: int = 0, context_length: int = 32, eos_id: int = 0
    ) -> QwenVLArgs:
        return dataclasses.replace(self, text_length=context_length)

    @property
    def model_dir(self) -> str:
        return self.path

    @property
    def lora_options(self) -> tuple[int, float, float, tuple[str, ...], tuple[str, ...]]:
        return self.lora_rank, self.lora_alpha, self.lora_dropout, self.lora_targets, self.lora_modules_to_save

    @functools.cached_property
    def _counts(self) -> tuple[int, int]:
        """(parameters, parameters in the language model's layers), on the meta device."""
        from transformers import AutoModel

        with torch.device("meta"):
            tower = AutoModel.from_config(load_config(self.path))
            if self.lora_rank:
                add_lora(tower, *self.lora_options)
        decoder = sum(p.numel() for b in layer_blocks(tower.language_model) for p in b.parameters())
        return sum(p.numel() for p in tower.parameters()) + 1, decoder

    def num_params(self) -> int:
        return self._counts[0]

    def flops_per_sample(self) -> int:
        """6 x decoder-layer parameters x the caption's tokens (the image side's visual tokens vary: not counted)."""
        return 6 * self._counts[1] * self.text_length

    def processor(self) -> Callable[..., dict[str, Tensor]]:
        """(uint8 HWC images, captions[, negative captions, k per sample]) -> the batch entries: query,
        doc, pixel_values, image_grid_thw[, neg: [B, k, L] ids of the negative captions]. Negative
        captions are hard negatives of the documents, so they take the i2t mode (documents are text)."""
        proc = VLProcessor(self.path, self.min_pixels, self.max_pixels, self.text_length)
        image_side = MODES[self.mode]
        text_side = "doc" if image_side == "query" else "query"

        def process(
            images: Sequence[np.ndarray], texts: Sequence[str], negatives: Sequence[str] = ()
        ) -> dict[str, Tensor]:
            picture = proc.encode(self.image_template, [""] * len(texts), images)
            proc.check(picture["ids"], picture["image_grid_thw"])  # the tokenizer kept every <|image_pad|>
            words = proc.encode(self.text_template, texts, None)
            batch = {
                image_side: picture["ids"],
                text_side: words["ids"],
                "pixel_values": picture["pixel_values"],
                "image_grid_thw": picture["image_grid_thw"],
            }
            if negatives:
                ids = proc.encode(self.text_template, negatives, None)["ids"]
                batch[NEGATIVES] = ids.reshape(len(texts), len(negatives) // len(texts), -1)
            return batch

        process.negatives = image_side == "query"  # type: ignore[attr-defined]  # what serve_processed checks
        return process


qwen_vl_flavors = {"default": QwenVLArgs()}


def vl_embed(
    tower: nn.Module,
    ids: Tensor,
    pooling: str,
    pixel_values: Tensor | None = None,
    image_grid_thw: Tensor | None = None,
) -> Tensor:
    """The normalized embedding of each row of `ids` (-1 padded), with its image's patches when it has
    one; the columns that are padding in every row are cut first (as GradCache cuts a chunk: the same
    shapes, so the same dropout draws, in both)."""
    ids = right_trimmed(ids, PAD)
    mask = ids != PAD
    images = {} if pixel_values is None else {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw}
    hidden = tower(
        input_ids=ids.masked_fill(~mask, 0),
        attention_mask=mask.long(),
        mm_token_type_ids=(ids == tower.config.image_token_id).long(),
        **images,
    ).last_hidden_state
    return F.normalize(pooled(hidden, mask, pooling), dim=-1)


class QwenVLEmbedder(nn.Module):
    """One Qwen-VL tower for queries and documents, learnable `logit_scale`."""

    def __init__(self, args: QwenVLArgs) -> None:
        super().__init__()
        self.args = args
        self.tower = load_text_tower(args.path)
        if args.lora_rank:
            add_lora(self.tower, *args.lora_options)
        self.logit_scale = nn.Parameter(
            torch.full((1,), math.log(args.init_scale)), requires_grad=args.learn_logit_scale
        )

    def init_weights(self) -> None:
        with torch.no_grad():
            self.logit_scale.fill_(math.log(self.args.init_scale))

    @property
    def padded_inputs(self) -> dict[str, int]:
        """Right-padded token ids (batch key: pad id), for GradCache's trimming and token budgets."""
        return {"query": PAD, "doc": PAD, NEGATIVES: PAD}

    def embed(self, ids: Tensor, pixel_values: Tensor | None = None, image_grid_thw: Tensor | None = None) -> Tensor:
        return vl_embed(self.tower, ids, self.args.pooling, pixel_values, image_grid_thw)

    def forward(
        self, query: Tensor, doc: Tensor, pixel_values: Tensor, image_grid_thw: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(query embeddings, document embeddings, exp(logit_scale)); the images belong to the mode's side."""
        image_side = MODES[self.args.mode]
        return (
            self.embed(query, *((pixel_values, image_grid_thw) if image_side == "query" else ())),
            self.embed(doc, *((pixel_values, image_grid_thw) if image_side == "doc" else ())),
            self.logit_scale.exp(),
        )


def qwen_vl_blocks(model: QwenVLEmbedder) -> list[nn.Module]:
    """The vision blocks and the decoder layers (`_no_split_modules`): FSDP2, AC and compile units."""
    return layer_blocks(model.tower)
