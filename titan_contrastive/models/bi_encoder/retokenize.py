"""A guide with another vocabulary reads the trained model's token ids as text: the ids decoded
(padding and special tokens dropped) and tokenized again with the guide's own tokenizer, as
sentence-transformers' GISTEmbedLoss does for such a guide. The model's prompts are in its ids,
so they reach the guide as text too. Host work per call (a decode and an encode of every row);
a guide with the model's tokenizer skips it (`BiEncoderArgs.as_guide`)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from titan_contrastive.datasets.tokenizer import PairTokenizer
from titan_contrastive.models.bi_encoder.folder import pad_id


class Retokenizer:
    """Right-padded token ids of the transformers tokenizer `source` -> right-padded ids of `target`'s, at
    most `length` tokens (its special tokens included; longer texts are cut, as the guide's own
    max_seq_length cuts them in sentence-transformers)."""

    def __init__(self, source: Any, target: Any, length: int) -> None:
        self.source = source
        self.source_pad = pad_id(source)
        self.target = PairTokenizer(target, doc_length=length, pad_id=pad_id(target))

    def __call__(self, ids: Tensor) -> Tensor:
        rows = [[t for t in row if t != self.source_pad] for row in ids.tolist()]
        texts = self.source.batch_decode(rows, skip_special_tokens=True)
        return self.target.encode_docs(texts).to(ids.device)
