"""Inference-free SPLADE's query side (sentence-transformers' SparseStaticEmbedding): a query's embedding is a
learned weight w_v on each vocabulary entry v among its tokens, and 0 elsewhere, so a query costs a lookup, no
forward pass; the documents are SPLADE's (`pooling.splade_pooled`). The tokens the tokenizer adds (CLS, SEP, ...)
and padding do not count: sentence-transformers tokenizes these queries without them."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from titan_contrastive.models.bi_encoder.folder import TextFolderError


class StaticQuery(nn.Module):
    def __init__(self, weight: Tensor, ignored_ids: Iterable[int]) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        """w [V], one weight per vocabulary entry."""
        ignored = sorted({i for i in ignored_ids if 0 <= i < len(weight)})
        self.register_buffer("ignored", torch.tensor(ignored, dtype=torch.long), persistent=False)

    def forward(self, ids: Tensor) -> Tensor:
        """[B, V]: w_v where entry v is among a row of `ids` [B, L] (once however often), else 0."""
        present = torch.zeros(len(ids), len(self.weight), dtype=self.weight.dtype, device=ids.device)
        present.scatter_(1, ids, 1.0)
        present[:, self.ignored] = 0
        return present * self.weight


def static_weight(file: str, vocab_size: int, tokenizer: Any) -> Tensor:
    """[vocab_size] weights of a SparseStaticEmbedding from `file`, its `model.safetensors` or a JSON of
    {token: weight} (an `idf.json`, the tokens read by `tokenizer`; entries it names not, 0); "": ones,
    sentence-transformers' start."""
    if not file:
        return torch.ones(vocab_size)
    if file.endswith(".json"):
        try:
            table = json.loads(Path(file).read_text())
            tokens, values = list(table), torch.tensor([float(v) for v in table.values()])
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise TextFolderError(f"{file}: not a JSON object of token: weight ({e}); repair it") from None
        ids = torch.tensor(tokenizer.convert_tokens_to_ids(tokens), dtype=torch.long)
        known = (ids >= 0) & (ids < vocab_size)
        return torch.zeros(vocab_size).index_put_((ids[known],), values[known])
    from safetensors.torch import load_file

    weight = load_file(file).get("weight")
    if weight is None or weight.shape != (vocab_size,):
        shape = None if weight is None else tuple(weight.shape)
        raise TextFolderError(
            f"{file}: a SparseStaticEmbedding whose weight is {shape}, and the masked LM's vocabulary holds "
            f"{vocab_size} entries; save one weight per entry of the document model's vocabulary"
        )
    return weight.float()
