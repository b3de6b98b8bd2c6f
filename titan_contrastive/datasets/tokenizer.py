"""Tokenizers: the byte-level one the bundled image-caption sets use, and a family's pretrained one.

`ByteTokenizer`: every UTF-8 byte is a token, so no vocabulary file has to ship. Captions here
are short English phrases; bytes keep the tokenizer exact, dependency-free and identical on every
rank. The text model pools at the EOS position, found with `(ids == ByteTokenizer.EOS).int().argmax(-1)`,
so EOS is always present, even after truncation.

`PairTokenizer`: a model family's pretrained subword tokenizer (Hugging Face) for text pairs,
with the length the family's document tower reads (its args), handed to the dataset by the
family's `ModelSpec.build_tokenizer`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


class ByteTokenizer:
    """`encode` -> [B, context_length] int64: BOS, the text's UTF-8 bytes (each + 3), EOS, PAD..."""

    PAD = 0
    BOS = 1
    EOS = 2
    OFFSET = 3  # byte b is token b + OFFSET
    vocab_size = 256 + OFFSET

    def __init__(self, context_length: int = 32) -> None:
        if context_length < 3:
            raise ValueError(f"context_length={context_length}: too short for BOS, one byte and EOS; use 3 or more")
        self.context_length = context_length

    def encode(self, texts: list[str]) -> torch.Tensor:
        """Token ids [len(texts), context_length]. Texts longer than context_length - 2 bytes are
        cut so that EOS stays the last non-pad token (a cut may split a multi-byte character)."""
        if isinstance(texts, str):
            raise TypeError("ByteTokenizer.encode takes a list of strings, not a single string")
        ids = np.full((len(texts), self.context_length), self.PAD, dtype=np.int64)
        ids[:, 0] = self.BOS
        max_bytes = self.context_length - 2
        for row, text in enumerate(texts):
            data = np.frombuffer(text.encode("utf-8")[:max_bytes], dtype=np.uint8)
            ids[row, 1 : 1 + len(data)] = data.astype(np.int64) + self.OFFSET
            ids[row, 1 + len(data)] = self.EOS
        return torch.from_numpy(ids)

    def decode(self, ids: torch.Tensor) -> list[str]:
        """Inverse of `encode` up to truncation: the bytes between BOS and the first EOS."""
        texts = []
        for row in ids.tolist():
            end = row.index(self.EOS) if self.EOS in row else len(row)
            data = bytes(t - self.OFFSET for t in row[:end] if t >= self.OFFSET)
            texts.append(data.decode("utf-8", errors="replace"))
        return texts


def padded(
    flat: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, length: int, pad: int, left: bool = False
) -> torch.Tensor:
    """int64 [*starts.shape, length]: the rows `flat[start : start + n]` (`starts`, `lengths` of any one shape,
    each n <= length), padded with `pad` after them, or before them when `left`."""
    at, lengths, starts = torch.arange(length), lengths.unsqueeze(-1), starts.unsqueeze(-1)
    if not len(flat):
        return torch.full((*lengths.shape[:-1], length), pad, dtype=torch.int64)
    if left:  # the row's first id at `length - n`
        real, place = at >= length - lengths, starts + at - (length - lengths)
    else:
        real, place = at < lengths, starts + at
    return torch.where(real, flat[place.clamp_(0, len(flat) - 1)].to(torch.int64), pad)


@dataclass(frozen=True)
class PairTokenizer:
    """Queries are cut to `[data] context_length`, documents to the family's `doc_length`; each side's
    prompt is prepended to its texts (and counts toward its length)."""

    hf: Any
    """A Hugging Face tokenizer (called with padding/truncation to a fixed length)."""
    doc_length: int
    pad_id: int | None = None
    """What padding is written as (None: the tokenizer's pad token); -1 where that token also stands
    in real text, e.g. a decoder's EOS, so that `ids != pad_id` is the attention mask."""
    query_prompt: str = ""
    doc_prompt: str = ""
    pad_left: bool = False
    """Padding before the ids (a tokenizer whose `padding_side` is left, where the model reads them so: hf_clip)."""
    query_length: int = 0
    """The model folder's query length (PyLate's `query_length`), the queries' when `[data] context_length` is 0."""
    special_tokens: bool = True
    """Whether the tokenizer adds its special tokens (CLS, SEP, EOS); a StaticEmbedding's reads the text alone."""

    @property
    def vocab_size(self) -> int:
        return self.hf.vocab_size

    @property
    def pad_value(self) -> int:
        """What a row is padded with: `pad_id`, else the tokenizer's pad token."""
        return self.hf.pad_token_id if self.pad_id is None else self.pad_id

    def token_rows(self, texts: list[str], length: int) -> list[list[int]]:
        """Each text's token ids, truncated to `length`, unpadded."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None:  # a slow (Python) tokenizer: its own call
            return self.hf(texts, truncation=True, max_length=length, add_special_tokens=self.special_tokens)[
                "input_ids"
            ]
        # the Rust tokenizer's ids as the tokenizer's own call sets it up, without its per-text dicts
        backend.no_padding()
        backend.enable_truncation(max_length=length, strategy="longest_first", direction=self.hf.truncation_side)
        if hasattr(backend, "encode_special_tokens"):  # tokenizers >= 0.19: special-token text split as text
            backend.encode_special_tokens = bool(getattr(self.hf, "split_special_tokens", False))
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=self.special_tokens)]

    def encode(self, texts: list[str], length: int, prompt: str = "") -> torch.Tensor:
        """Token ids [len(texts), length] of `prompt + text`, padded with `pad_value` (on the right unless
        `pad_left`) and truncated."""
        rows = self.token_rows([prompt + t for t in texts], length)
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
        flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
        return padded(
            torch.from_numpy(flat), lengths.cumsum(0) - lengths, lengths, length, self.pad_value, self.pad_left
        )

    def encode_queries(self, texts: list[str], length: int) -> torch.Tensor:
        return self.encode(texts, length, self.query_prompt)

    def encode_docs(self, texts: list[str]) -> torch.Tensor:
        return self.encode(texts, self.doc_length, self.doc_prompt)


@dataclass(frozen=True)
class CaptionTokenizer:
    """A family's pretrained tokenizer at one length, for image captions (the lit family's text
    tower reads MiniLM's WordPiece ids instead of the byte tokenizer's)."""

    pair: PairTokenizer
    context_length: int

    @property
    def vocab_size(self) -> int:
        return self.pair.vocab_size

    def encode(self, texts: list[str]) -> torch.Tensor:
        return self.pair.encode(texts, self.context_length)
