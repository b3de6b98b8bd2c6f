"""A frozen teacher (or guide) of an hf_clip run that was trained with another tokenizer or other image statistics
reads the run's batches as its own processor would have made them (`guide.read_guide`, and `guide.read_foreign` for
a teacher of the clip family, decide what it needs):

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

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["OURS", "TeacherInputs", "run_decoder"]


OURS = ("byte", "clip_bpe")
"""The clip family's tokenizers (`data.tokenizer`), whose ids a teacher of the hf_clip family reads as text."""


def run_decoder(source: str) -> Callable[[Tensor], list[str]]:
    """The texts of a run's caption ids: `source` one of `OURS`, or the run's transformers folder (its padding and
    special tokens dropped)."""
    if source in OURS:
        from titan_contrastive.datasets.clip_bpe import ClipBpeTokenizer
        from titan_contrastive.datasets.tokenizer import ByteTokenizer

        ours = ByteTokenizer() if source == "byte" else ClipBpeTokenizer()
        return lambda ids: ours.decode(ids.cpu())
    from titan_contrastive.models.bi_encoder.folder import load_tokenizer

    tokenizer = load_tokenizer(source)
    pad = int(tokenizer.pad_token_id)
    return lambda ids: tokenizer.batch_decode([[t for t in row if t != pad] for row in ids.tolist()], True)


class TeacherInputs:
    """The run's (images, token ids) -> the teacher's. `decode`: the run's ids -> texts (`run_decoder`), `target`: the
    teacher's `CaptionTokenizer` (None: the ids as they are); `pixels_from`: the run's (mean, std) and `pixels_to`
    the teacher's (empty: the pixels as they are)."""

    def __init__(
        self,
        decode: Callable[[Tensor], list[str]] | None = None,
        target: Any = None,
        pixels_from: Sequence[Sequence[float]] = (),
        pixels_to: Sequence[Sequence[float]] = (),
    ) -> None:
        self.decode, self.target = decode, target
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
            texts = self.target.encode(self.decode(texts)).to(texts.device)
        return images, texts
