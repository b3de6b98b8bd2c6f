"""Retrieval over quantized document embeddings, as sentence-transformers' embedding quantization serves them.

`[eval] beir_precisions` / `evaluate --precision`: beside the float search, the corpus's embeddings quantized by
sentence-transformers' `quantize_embeddings` and searched by its `semantic_search_usearch`, with its defaults:

- `int8`: each dimension's range over the corpus (the calibration set) cut into 256 buckets, stored as signed
  bytes, 4x smaller than float32; `ubinary`: each dimension's sign, 8 to a byte, 32x smaller;
- the float queries quantized the same way for an exact search (usearch: inner product of the int8 codes; Hamming
  distance for bits), then that search's best `rescore_multiplier` x k (its default, 2) rescored by the float query
  against each candidate's dequantized values (int8) or bits (0 or 1, ubinary), and the k best kept.

So the figures are what a user of that guide's recipe measures for the index they would build. Not offered: the
`uint8` of its faiss search, whose inner product of unsigned codes (every code offset by the range's minimum) ranks
by the codes' sums as much as by their agreement. Needs usearch (in `.[hf]`).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["PRECISIONS", "quantized_top_k"]

PRECISIONS = ("int8", "ubinary")
"""The corpus precisions searched besides float32."""


def quantized_top_k(
    queries: torch.Tensor, corpus: torch.Tensor, k: int, precision: str, normalize: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, corpus indices) [Q, min(k, N)] of each query's best documents when the corpus is held in `precision`
    (the module docstring's search), best first; `normalize`: both sides L2-normalized first (a Matryoshka cut)."""
    from sentence_transformers.util.quantization import quantize_embeddings, semantic_search_usearch

    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: one of {', '.join(PRECISIONS)}")
    q, c = queries.float(), corpus.float()
    if normalize:
        q, c = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(c, dim=-1)
    q, c = q.cpu().numpy(), np.ascontiguousarray(c.cpu().numpy())
    k = min(k, len(c))
    index = quantize_embeddings(c, precision=precision, calibration_embeddings=c)
    hits, _ = semantic_search_usearch(
        q, corpus_embeddings=index, corpus_precision=precision, top_k=k, calibration_embeddings=c
    )
    scores = torch.tensor([[hit["score"] for hit in row] for row in hits], dtype=torch.float64)
    indices = torch.tensor([[hit["corpus_id"] for hit in row] for row in hits], dtype=torch.long)
    return scores, indices
