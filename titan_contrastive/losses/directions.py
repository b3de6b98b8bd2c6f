"""Joint directions: more candidates in each query's one softmax (GTE's "improved contrastive loss").

One-way InfoNCE gives query i the columns D as candidates. `directions` (sentence-transformers'
names; its `partition_mode = "joint"`) add to the same denominator, with S = t <., .>:
- `query_to_query`: S(q_i, q_j) for every other query j != i;
- `doc_to_query`: S(p_i, q_j) for every query j, its own query included (GTE, sentence-transformers);
- `doc_to_doc`: S(p_i, d_j) for every column j that is not one of query i's documents (its
  positive and its hard negatives).
L = 1/N sum_i (logsumexp over all of query i's candidates - S(q_i, p_i)). GTE uses all three;
Qwen3-Embedding and GISTEmbed `query_to_query` and `doc_to_doc`.

The false-negative mask (`losses/masking.py`) applies to every direction with query i's
threshold (<q_i, p_i> plus the margin, or times the relative factor), as GISTEmbed applies its
guide's; `mask_duplicates` masks the candidates whose id is p_i's: another query whose positive is
p_i's document, or that document again. The streamed form (`streamed_joint`) gathers the queries
(O(N d)), takes each direction's row LSE in blocks, merges them and then each direction's
gradients; the queries' gradient shares go back to their ranks with one reduce-scatter.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from titan_contrastive.losses.base import Ranks, StreamResult, own_columns, row_dots
from titan_contrastive.losses.hardness import Hardness
from titan_contrastive.losses.masking import FalseNegatives
from titan_contrastive.losses.streaming import BlockMask, streamed_row_col_lse, streamed_softmax_grads

DIRECTIONS = ("query_to_query", "doc_to_query", "doc_to_doc")
# each direction's rows (q: the queries, p: their positives) and keys (q: all queries, d: all columns)
SIDES = {"query_to_doc": ("q", "d"), "query_to_query": ("q", "q"), "doc_to_query": ("p", "q"), "doc_to_doc": ("p", "d")}


def check_directions(directions: tuple[str, ...], symmetric: bool) -> None:
    """ValueError for an unknown or repeated direction, or directions with the symmetric loss."""
    unknown = [d for d in directions if d not in DIRECTIONS]
    if unknown or len(set(directions)) != len(directions):
        raise ValueError(f"loss.joint_directions={list(directions)}: each at most once, from {', '.join(DIRECTIONS)}")
    if directions and symmetric:
        raise ValueError(
            f"loss.joint_directions={list(directions)} join each query's one softmax, and the symmetric loss "
            "averages two: set loss.symmetric=false (add doc_to_query for GTE's loss)"
        )


class Term(NamedTuple):
    """One direction of the rows' denominator: its rows against its keys, and what is masked."""

    direction: str
    rows: Tensor
    keys: Tensor
    mask: BlockMask | None


def _either(a: BlockMask | None, b: BlockMask | None) -> BlockMask | None:
    if a is None or b is None:
        return a or b

    def both(block: Tensor, start: int) -> Tensor | None:
        x, y = a(block, start), b(block, start)
        return y if x is None else (x if y is None else x | y)

    return both


def _own_keys(first_row: int, num_queries: int, num_columns: int) -> BlockMask:
    """The keys that are query i's own, masked: its query (keys: the N queries), or its positive
    and hard negatives (keys: the columns)."""

    def own(block: Tensor, start: int) -> Tensor:
        masked = torch.zeros(block.shape, dtype=torch.bool, device=block.device)
        cols = own_columns(first_row + start, len(block), num_queries, num_columns, block.device)
        return masked.scatter_(1, cols if block.shape[1] == num_columns else cols[:, :1], True)

    return own


def terms(
    directions: tuple[str, ...],
    false_negatives: FalseNegatives,
    q_own: Tensor,
    queries: Tensor | None,
    docs: Tensor,
    scale: float,
    first_row: int,
    num_queries: int,
    ids: Tensor | None,
) -> list[Term]:
    """query_to_doc, then each direction, with its mask, for the own rows `q_own` (global rows
    first_row, ...); `queries`: all N queries (the directions to queries need them)."""
    n = num_queries
    rows = {"q": q_own, "p": docs[first_row : first_row + len(q_own)]}
    keys, key_ids = {"q": queries, "d": docs}, {"q": None if ids is None else ids[:n], "d": ids}
    own = dict.fromkeys(("query_to_query", "doc_to_doc"), _own_keys(first_row, n, len(docs)))
    if false_negatives.enabled:
        with torch.no_grad():
            positive = scale * row_dots(q_own, rows["p"], torch.float64)
    out = []
    for direction in ("query_to_doc", *directions):
        r, c = SIDES[direction]
        mask = None
        if false_negatives.enabled:
            mask = false_negatives.for_keys(positive, scale, first_row, docs.shape[1], key_ids[c], ids, (r, c))
        out.append(Term(direction, rows[r], keys[c], _either(mask, own.get(direction))))
    return out


def dense_joint(
    directions: tuple[str, ...],
    false_negatives: FalseNegatives,
    hardness: Hardness,
    q: Tensor,
    docs: Tensor,
    scale: Tensor,
    ids: Tensor | None,
) -> Tensor:
    """The joint loss on whole tensors (autograd; every direction's logits materialised)."""
    n = len(q)
    rows, keys = {"q": q, "p": docs[:n]}, {"q": q, "d": docs}
    logits = []
    for term in terms(
        directions, false_negatives, q.detach(), q.detach(), docs.detach(), float(scale.detach()), 0, n, ids
    ):
        r, c = SIDES[term.direction]
        cosines = rows[r] @ keys[c].T
        block = scale * cosines
        masked = None if term.mask is None else term.mask(block.detach(), 0)
        if hardness.enabled and term.direction == "query_to_doc":
            block = hardness.dense(block, cosines, 0, n)
        logits.append(block if masked is None else block.masked_fill(masked, -math.inf))
    joint = torch.cat(logits, 1)
    diagonal = torch.arange(n, device=q.device)
    return (torch.logsumexp(joint, 1) - joint[diagonal, diagonal]).mean()


def streamed_joint(
    directions: tuple[str, ...],
    false_negatives: FalseNegatives,
    hardness: Hardness,
    q_own: Tensor,
    docs: Tensor,
    scale: Tensor,
    *,
    first_row: int,
    num_queries: int,
    chunk: int,
    ranks: Ranks,
    ids: Tensor | None,
) -> StreamResult:
    """The joint loss of own rows first_row, ... in blocks of `chunk` rows: each direction's row
    LSE, merged; then each direction's gradients against the merged LSE (the positive only in
    query_to_doc's W). The queries are gathered when a direction needs them, and their gradient
    shares reduce-scattered to their ranks (every rank holds as many rows)."""
    n, c, s = num_queries, len(q_own), float(scale)
    needs_queries = any(SIDES[d][1] == "q" for d in directions)
    queries = ranks.gather(q_own) if needs_queries else None
    parts = terms(directions, false_negatives, q_own, queries, docs, s, first_row, n, ids)
    weight = hardness.for_rows(first_row, n, s) if hardness.enabled else None
    weights = [weight if t.direction == "query_to_doc" else None for t in parts]  # query -> document only
    lses = [
        streamed_row_col_lse(t.rows, t.keys, s, chunk, lse_columns=0, mask=t.mask, weight=w)[0]
        for t, w in zip(parts, weights)
    ]
    row_lse = torch.logsumexp(torch.stack(lses), 0)
    acc = row_lse.dtype
    p_own = docs[first_row : first_row + c]
    terms_sum = (row_lse - row_dots(q_own, p_own, acc) * scale.to(acc)).sum()
    loss = ranks.sum(terms_sum.detach().clone()) / n
    grad_rows = torch.zeros(c, docs.shape[1], dtype=acc, device=docs.device)
    grad_cols = torch.zeros(len(docs), docs.shape[1], dtype=acc, device=docs.device)
    grad_queries = torch.zeros(len(queries), docs.shape[1], dtype=acc, device=docs.device) if needs_queries else None
    scale_rows = torch.zeros(c, dtype=acc, device=docs.device)
    row_grads = {"q": grad_rows, "p": grad_cols[first_row : first_row + c]}
    key_grads = {"q": grad_queries, "d": grad_cols}
    for t, w in zip(parts, weights):
        g_rows, g_keys = streamed_softmax_grads(
            t.rows, t.keys, row_lse, None, s, first_row, chunk,
            num_queries=n, mask=t.mask, weight=w, positive=t.direction == "query_to_doc",
        )  # fmt: skip
        scale_rows += row_dots(t.rows, g_rows, acc) / s  # dL/ds = sum of <row, dL/drow> / s over directions
        r, k = SIDES[t.direction]
        row_grads[r].add_(g_rows)
        key_grads[k].add_(g_keys)
    if grad_queries is not None:
        grad_rows += ranks.scatter_sum(grad_queries)
    return StreamResult(loss, grad_rows, grad_cols, scale_rows, None)
