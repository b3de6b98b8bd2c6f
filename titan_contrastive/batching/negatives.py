"""Hard negatives beside the positives: one document input of 1 + k rows per sample.

A pair batch with mined hard negatives holds the positives as `doc` [B, L] and the negatives as
`neg` [B, k, L'] (`datasets/pairs.py`; sentence-transformers' (anchor, positive, negative_1..k)
columns). The document tower embeds them in one forward: `with_negatives` lays them out sample by
sample, [p_1, n_11..n_1k, p_2, ...] as [B (1 + k), L], so the embeddings come back as
[B, 1 + k, d] per-sample rows that GradCache chunks, reorders and concatenates like any other
per-sample output; the objective (`losses`) reads column 0 as the positive and the rest as
that sample's hard negatives.

The duplicate mask compares document ids. `document_ids` derives them from the token ids; data
that knows its documents' identities serves them instead as `doc_id` (`DOC_IDS`), int64 [B], or
[B, 1 + k] in the layout above when it serves hard negatives (`datasets/pairs.py`'s id column).
A teacher's scores of the same documents ride along as `TEACHER_SCORES` for distillation, and a
frozen model's embeddings computed ahead (`datasets/frozen.py`) as `FROZEN_QUERIES` and `FROZEN_DOCS`,
and the queries to score against their own documents only (`data.in_batch_negatives`) as `OWN_GROUP`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .inputs import BatchError

__all__ = [
    "DOC_IDS",
    "FROZEN_DOCS",
    "FROZEN_QUERIES",
    "NEGATIVES",
    "OWN_GROUP",
    "TEACHER_SCORES",
    "document_ids",
    "with_negatives",
]

NEGATIVES = "neg"
"""The batch key of the hard negatives [B, k, ...]."""
DOC_IDS = "doc_id"
"""The batch key of the documents' ids given by the data: int64 [B], or [B, 1 + k] with `NEGATIVES`."""
TEACHER_SCORES = "teacher_scores"
"""The batch key of a teacher's scores of each sample's documents, float32 [B, 1 + k] in the layout
above (`losses/distill.py`)."""
FROZEN_QUERIES = "frozen_query"
"""The batch key of a frozen model's embeddings of the queries, float32 [B, d'] (`datasets/frozen.py`)."""
FROZEN_DOCS = "frozen_doc"
"""The same model's embeddings of the documents, [B, d'] or [B, 1 + k, d'] in the layout above."""
OWN_GROUP = "own_group"
"""The batch key of bool [B]: True where the query is scored against its own positive and hard negatives only
(its source's `data.in_batch_negatives` is false; `losses/masking.py`)."""


def with_negatives(doc: Tensor, neg: Tensor, pad_id: int | None) -> Tensor:
    """[B, L] positives and [B, k, L'] negatives as one [B (1 + k), max(L, L')] input, sample by
    sample; right-padded token ids are padded with `pad_id` to the common width."""
    if neg.dim() != doc.dim() + 1 or len(neg) != len(doc):
        raise BatchError(
            f"hard negatives {tuple(neg.shape)} do not fit documents {tuple(doc.shape)}: expected [B, k, ...] with "
            f"B = {len(doc)}"
        )
    width = max(doc.shape[-1], neg.shape[-1])
    if doc.shape[-1] != neg.shape[-1]:
        if pad_id is None or doc.dim() != 2:
            raise BatchError(
                f"documents {tuple(doc.shape)} and hard negatives {tuple(neg.shape)} differ in width and the model "
                "names no pad id for them (padded_inputs): serve them at the same width"
            )
        doc = F.pad(doc, (0, width - doc.shape[-1]), value=pad_id)
        neg = F.pad(neg, (0, width - neg.shape[-1]), value=pad_id)
    return torch.cat([doc.unsqueeze(1), neg], 1).flatten(0, 1)


def _token_hash(ids: Tensor, pad_id: int | None) -> Tensor:
    """[..., L] token ids -> [...] int64, equal for equal token sequences (real tokens, by position,
    so a row trimmed of its padding hashes the same) and different otherwise but for a 2^-64 chance."""
    gen = torch.Generator().manual_seed(0x7E57)
    weights = torch.randint(-(2**62), 2**62, (ids.shape[-1],), generator=gen, dtype=torch.int64).to(ids.device)
    tokens = ids.long() + 1
    if pad_id is not None:
        tokens = tokens * (ids != pad_id)
    return (tokens * weights).sum(-1)  # int64 arithmetic wraps: a hash, the same on every rank


def document_ids(doc: Tensor, neg: Tensor | None, pad_id: int | None) -> Tensor:
    """An id per document, [B] or [B, 1 + k] with hard negatives (the layout of `with_negatives`):
    equal exactly for documents with the same token ids, which is what the duplicate mask
    (`losses.masking`) compares. Token ids only: a document the model reads as pixels has none."""
    if doc.is_floating_point() or (neg is not None and neg.is_floating_point()):
        raise BatchError(
            "loss.mask_duplicates compares documents by their token ids, but this family's documents are not "
            "token ids: set loss.mask_duplicates=false"
        )
    ids = _token_hash(doc, pad_id)
    return ids if neg is None else torch.cat([ids.unsqueeze(1), _token_hash(neg, pad_id)], 1)
