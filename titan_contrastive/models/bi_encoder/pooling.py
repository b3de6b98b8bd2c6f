"""The poolings of a text tower's outputs into one vector per text: sentence-transformers' Pooling modes
(`pooled`) and SPLADE's vocabulary-wide sparse embedding (`splade_pooled`)."""

from __future__ import annotations

import torch
from torch import Tensor


def pooled(hidden: Tensor, mask: Tensor, pooling: str, skip: int = 0) -> Tensor:
    """One vector per row of `hidden` [B, L, d] over its real tokens (`mask` [B, L], right-padded), without the
    first `skip` positions (a prompt left out of the pooling, as sentence-transformers leaves it: cls then reads
    the first position after it; the last token is the last either way). `pooling` as sentence-transformers'
    Pooling: cls, last_token, mean, max, mean_sqrt_len (the sum over the square root of the count), or
    weighted_mean (the t-th token, counted from 1 with the prompt, weighted t)."""
    if pooling == "cls":
        return hidden[:, skip]
    if pooling == "last_token":
        last = mask.sum(1).clamp_min(1) - 1
        return hidden[torch.arange(len(hidden), device=hidden.device), last]
    if skip:
        mask = mask.clone()
        mask[:, :skip] = False
    if pooling == "max":
        return hidden.masked_fill(~mask.unsqueeze(-1), -torch.inf).amax(1)
    acc = torch.promote_types(hidden.dtype, torch.float32)  # sums of bf16 tokens, and positions past 256, in fp32
    weights = mask.unsqueeze(-1).to(acc)
    if pooling == "weighted_mean":
        weights = weights * torch.arange(1, hidden.shape[1] + 1, dtype=acc, device=hidden.device)[:, None]
    count = weights.sum(1).clamp_min(1)
    total = (hidden.to(acc) * weights).sum(1)
    return (total / count.sqrt() if pooling == "mean_sqrt_len" else total / count).to(hidden.dtype)


SPLADE_POOLINGS = ("max", "sum")
"""How SPLADE pools its tokens' activations: max (SPLADE v2 and later), sum (SPLADE v1)."""
SPLADE_ACTIVATIONS = ("relu", "log1p_relu")
"""log(1 + relu(x)) (SPLADE), or log(1 + log(1 + relu(x))) (OpenSearch's inference-free document models)."""


def splade_pooled(logits: Tensor, mask: Tensor, strategy: str = "max", activation: str = "relu") -> Tensor:
    """SPLADE's embedding [B, V] of MLM `logits` [B, L, V] over the real tokens (`mask` [B, L]): the max (or the sum,
    `strategy` "sum"; of bf16 in fp32) over the tokens of log(1 + relu(logits)), with `activation` log1p_relu one
    more log(1 + .), sentence-transformers' SpladePooling; padding counts 0."""
    weights = torch.log1p(torch.relu(logits.masked_fill(~mask.unsqueeze(-1), 0)))
    if activation == "log1p_relu":
        weights = torch.log1p(weights)
    if strategy != "sum":
        return weights.amax(1)
    return weights.sum(1, dtype=torch.promote_types(weights.dtype, torch.float32)).to(weights.dtype)  # bf16 in fp32
