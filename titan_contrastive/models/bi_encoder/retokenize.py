"""A guide with another vocabulary reads the trained model's token ids as text: the ids decoded
(padding and special tokens dropped) and tokenized again with the guide's own tokenizer, as
sentence-transformers' GISTEmbedLoss does for such a guide. The model's prompts are in its ids,
so they reach the guide as text too, as do a static model's (`args.text_guide`: ids without special tokens,
padded with -1). Host work per call (a decode and an encode of every row); a guide with the model's tokenizer
skips it (`BiEncoderArgs.as_guide`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from titan_contrastive.datasets.tokenizer import PairTokenizer
from titan_contrastive.models.bi_encoder.folder import load_tokenizer, pad_id


def source_tokenizer(path: str, trust: bool = False) -> tuple[Any, int]:
    """(tokenizer, pad id) of the ids a guide reads: a transformers tokenizer's folder (`load_tokenizer`), or a bare
    `tokenizer.json` (a StaticEmbedding's or model2vec's, whose batches pad with -1)."""
    if Path(path).is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_file=path), -1
    tokenizer = load_tokenizer(path, trust)
    return tokenizer, pad_id(tokenizer)


class Retokenizer:
    """Right-padded token ids of the transformers tokenizer `source` (padded with `source_pad`; no id is below 0)
    -> right-padded ids of `target`'s, at most `length` tokens (its special tokens included; longer texts are
    cut, as the guide's own max_seq_length cuts them in sentence-transformers)."""

    def __init__(self, source: Any, source_pad: int, target: Any, length: int) -> None:
        self.source = source
        self.source_pad = source_pad
        self.target = PairTokenizer(target, doc_length=length, pad_id=pad_id(target))

    def __call__(self, ids: Tensor) -> Tensor:
        rows = [[t for t in row if t >= 0 and t != self.source_pad] for row in ids.tolist()]
        texts = self.source.batch_decode(rows, skip_special_tokens=True)
        return self.target.encode_docs(texts).to(ids.device)
