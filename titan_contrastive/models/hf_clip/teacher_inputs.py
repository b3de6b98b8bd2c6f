"""A frozen teacher (or guide) of an hf_clip run that was trained with another tokenizer or other image statistics
reads the run's batches as its own processor would have made them (`guide.read_guide` decides what it needs):

- pixels: the run's normalized pixels x = (p - m_run) / s_run, normalized again to the teacher's statistics,
  (x s_run + m_run - m_teacher) / s_teacher per channel, in float32 at least: the same crop and resize, the
  teacher's normalization;
- captions: the run's token ids decoded (padding and special tokens dropped) and tokenized again by the teacher's
  own tokenizer at its own length, padded as its processor pads them (`model.build_tokenizer`), as
  sentence-transformers' GISTEmbedLoss does for a guide of another vocabulary. The teacher reads the text the run's
  ids hold: after the run's tokenizer's normalization (a CLIP tokenizer lower-cases) and cut to the run's length.

The captions cost host work per call (the ids come to the host, one sync, then a decode and an encode); the pixels
one multiply-add on the device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["TeacherInputs"]


class TeacherInputs:
    """The run's (images, token ids) -> the teacher's. `source`: the run's transformers tokenizer and its pad id,
    `target`: the teacher's `CaptionTokenizer` (None: the ids as they are); `pixels_from`: the run's (mean, std) and
    `pixels_to` the teacher's (empty: the pixels as they are)."""

    def __init__(
        self,
        source: tuple[Any, int] | None = None,
        target: Any = None,
        pixels_from: Sequence[Sequence[float]] = (),
        pixels_to: Sequence[Sequence[float]] = (),
    ) -> None:
        self.source, self.target = source, target
        self.affine: tuple[Tensor, Tensor] | None = None
        if pixels_from:
            run_mean, run_std = (torch.tensor(v, dtype=torch.float64) for v in pixels_from)
            mean, std = (torch.tensor(v, dtype=torch.float64) for v in pixels_to)
            scale, shift = run_std / std, (run_mean - mean) / std
            self.affine = (scale.view(1, -1, 1, 1), shift.view(1, -1, 1, 1))

    def __call__(self, images: Tensor | Mapping[str, Tensor], texts: Tensor) -> tuple[Any, Tensor]:
        if self.affine is not None and isinstance(images, Tensor):
            acc = torch.promote_types(images.dtype, torch.float32)
            scale, shift = (t.to(images.device, acc) for t in self.affine)
            images = torch.addcmul(shift, images.to(acc), scale).to(images.dtype)
        if self.target is not None:
            tokenizer, pad = self.source
            rows = [[t for t in row if t != pad] for row in texts.tolist()]
            captions = tokenizer.batch_decode(rows, skip_special_tokens=True)
            texts = self.target.encode(captions).to(texts.device)
        return images, texts
