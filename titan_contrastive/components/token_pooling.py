"""Token pooling of a late-interaction index: each document's token vectors clustered into about 1 / factor as many
(their means), so the index holds fewer vectors (ColBERT's and ColQwen's documents; queries are never pooled).

The clustering is sentence-transformers' `HierarchicalTokenPooling` (Ward linkage on the tokens' cosine distances,
the first `protected` tokens kept out of the clustering, every vector normalized to unit length), applied to the token
sets the models here emit: rows [n, L * dim] whose zero tokens (padding, skipped punctuation) do not count
(`losses/late_interaction.py`). A document's pooled tokens depend on it alone (the rounding of a sum aside), never on
the batch it came in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from titan_contrastive.extras import import_failure

__all__ = ["document_pooler", "pooled_tokens", "token_counts"]


def pooled_tokens(tokens: int, factor: float, protected: int) -> int:
    """The most tokens a document of at most `tokens` tokens keeps: the protected ones, and
    floor(rest / factor) clusters of the rest (at least one)."""
    kept = min(protected, tokens)
    return min(tokens, kept + max(int((tokens - kept) // factor), 1))


def token_counts(rows: Tensor, dim: int) -> Tensor:
    """The number of tokens that count (not zero) in each row [n, L * dim]."""
    return (rows.unflatten(-1, (-1, dim)) != 0).any(-1).sum(-1)


def document_pooler(dim: int, factor: float, protected: int, who: str) -> Callable[[Tensor], Tensor]:
    """rows [n, L * dim] -> their pooled rows [n, pooled_tokens(L) * dim], zero tokens after each document's own.
    `who`: the setting that asked for it, named if sentence-transformers is missing."""
    try:
        from sentence_transformers.multi_vector_encoder.modules.token_pooling import HierarchicalTokenPooling
    except ImportError as e:
        raise ImportError(import_failure(e, who, "hf")) from None
    pooler: Any = HierarchicalTokenPooling(factor, num_protected_tokens=protected)

    def pool(rows: Tensor) -> Tensor:
        tokens = rows.unflatten(-1, (-1, dim))
        documents = [t[(t != 0).any(-1)] for t in tokens]
        out = rows.new_zeros(len(rows), pooled_tokens(tokens.shape[1], factor, protected), dim)
        for row, pooled in zip(out, pooler.pool(documents)):
            row[: len(pooled)] = pooled
        return out.flatten(1)

    return pool
