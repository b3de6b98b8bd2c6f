"""Texts and images as a Qwen-VL model reads them: what transformers' `Qwen2VLProcessor` does,
without its video processor (which needs torchvision).

Per sample and side, a template (`{image}` where the image goes, `{text}` the sample's text, cut
to its first `max_text_tokens` tokens) is filled; `{image}` becomes `<|vision_start|>`, one
`<|image_pad|>` per merged visual token (`prod(image_grid_thw) / merge_size²`) and
`<|vision_end|>`; the folder's tokenizer turns the whole string into ids, right-padded with -1 (so
padding is never a real token: Qwen pads with its EOS).
Images go through the folder's image processor (`Qwen2VLImageProcessorPil`, its own `patch_size`,
`merge_size`, mean and std) at their native resolution, resized to multiples of
`patch_size · merge_size` within `[min_pixels, max_pixels]`; the patches of a batch's images are
packed into one `pixel_values` [total_patches, C·t·p·p] with `image_grid_thw` [images, 3].
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from titan_contrastive.config import ConfigError

__all__ = ["IMAGE", "PAD", "VISION", "VLProcessor"]

IMAGE = "{image}"
PAD = -1
_START, _PAD, _END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
VISION = _START + _PAD + _END
"""An image in a chat-rendered text, before the processor repeats `<|image_pad|>` per visual token."""


class VLProcessor:
    """(texts, images) of one side -> token ids [B, L] (-1 padded) and packed image patches."""

    def __init__(self, model_dir: str, min_pixels: int, max_pixels: int, max_text_tokens: int) -> None:
        from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

        from titan_contrastive.models.bi_encoder.folder import load_tokenizer

        self.tokenizer = load_tokenizer(model_dir)
        ids = {t: self.tokenizer.convert_tokens_to_ids(t) for t in (_START, _PAD, _END)}
        missing = [t for t, i in ids.items() if i is None or i == self.tokenizer.unk_token_id]
        if missing:
            raise ConfigError(f"{model_dir}: its tokenizer lacks {missing}; not a Qwen-VL tokenizer")
        self.image_token_id = int(ids[_PAD])
        options = {}
        if min_pixels:
            options["min_pixels"] = min_pixels
        if max_pixels:
            options["max_pixels"] = max_pixels
        try:
            self.images = Qwen2VLImageProcessorPil.from_pretrained(model_dir, local_files_only=True, **options)
        except OSError:
            raise ConfigError(
                f"{model_dir}: no preprocessor_config.json; save the model's image processor into the folder"
            ) from None
        self.merge = int(self.images.merge_size)
        self.max_text_tokens = max_text_tokens

    @property
    def most_visual_tokens(self) -> int:
        """The merged visual tokens of an image at the processor's largest size (its `longest_edge` pixels over a
        merged patch's area); an extreme aspect ratio can round past it."""
        unit = int(self.images.patch_size) * self.merge
        return int(self.images.size["longest_edge"]) // unit**2

    def most_tokens(self, template: str) -> int:
        """The tokens `template` gives at most: its own (with an empty text and no visual tokens), the text's
        `max_text_tokens` where it has `{text}`, `most_visual_tokens` where it has `{image}`."""
        own = template.replace(IMAGE, _START + _END).replace("{text}", "")
        text = self.max_text_tokens if "{text}" in template else 0
        image = self.most_visual_tokens if IMAGE in template else 0
        return len(self.tokenizer(own, add_special_tokens=False)["input_ids"]) + text + image

    def visual_tokens(self, grid: Tensor) -> list[int]:
        """Merged visual tokens per image (`<|image_pad|>` per image in the ids)."""
        return (grid.long().prod(-1) // self.merge**2).tolist()

    def pixels(self, images: Sequence[np.ndarray]) -> tuple[Tensor, Tensor]:
        """(pixel_values [patches, C·t·p·p] float32, image_grid_thw [images, 3]) of uint8 HWC images."""
        try:
            out = self.images(images=list(images), return_tensors="pt")
        except ValueError as e:  # an aspect ratio or size its resizing cannot bring within the limits
            raise ConfigError(
                f"an image of shape {[tuple(x.shape) for x in images][:3]}: {' '.join(str(e).split())[:200]}; "
                "crop it or change data.min_pixels / data.max_pixels"
            ) from None
        return out["pixel_values"].float(), out["image_grid_thw"].long()

    def cut(self, text: str) -> str:
        """`text` cut to its first `max_text_tokens` tokens (itself when it has no more)."""
        words = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer.decode(words[: self.max_text_tokens]) if len(words) > self.max_text_tokens else text

    def encode(
        self,
        template: str | Sequence[str],
        texts: Sequence[str],
        images: Sequence[np.ndarray | None] | None,
    ) -> dict[str, Tensor]:
        """One side of a batch: `template` for every sample, or one per sample (each with `{image}` when the sample
        has an image: `images` one per sample, None for a sample without; None: none has one). `pixel_values` and
        `image_grid_thw` hold the images of the samples that have one, in their order."""
        templates = [template] * len(texts) if isinstance(template, str) else list(template)
        each = [None] * len(texts) if images is None else list(images)
        for used, imaged in dict.fromkeys((t, image is not None) for t, image in zip(templates, each)):
            if (IMAGE in used) != imaged:
                need = "an image side needs {image} in its template" if imaged else "a text side has no image"
                raise ConfigError(f"template {used!r}: {need}")
        out: dict[str, Tensor] = {}
        counts = [0] * len(texts)
        present = [i for i, image in enumerate(each) if image is not None]
        if present:
            out["pixel_values"], out["image_grid_thw"] = self.pixels([each[i] for i in present])
            for i, count in zip(present, self.visual_tokens(out["image_grid_thw"])):
                counts[i] = count
        rows = []
        for text, count, template in zip(texts, counts, templates, strict=True):
            # the whole string at once, as the transformers processor tokenizes it (BPE merges across the template)
            filled = template.replace(IMAGE, _START + _PAD * count + _END).replace("{text}", self.cut(text))
            rows.append(self.tokenizer(filled, add_special_tokens=False)["input_ids"])
        width = max(len(r) for r in rows)
        out["ids"] = torch.tensor([r + [PAD] * (width - len(r)) for r in rows], dtype=torch.long).reshape(
            len(rows), width
        )
        return out

    def check(self, ids: Tensor, grid: Tensor) -> None:
        """A side's ids must hold each image's visual tokens: `<|image_pad|>` per row with an image = its image's
        count (the rows without one hold none)."""
        have = [n for n in (ids == self.image_token_id).sum(1).tolist() if n]
        want = self.visual_tokens(grid)
        if have != want:
            raise ConfigError(
                f"image_grid_thw {grid.tolist()[:3]} asks for {want[:3]} visual tokens per image, the ids hold "
                f"{have[:3]}: ids and images of different samples, or a grid that does not match the patches"
            )
