"""SPLADE's vocabulary head and pooling in one autograd function, without the [B, L, V] logits.

A masked LM's head ends in a linear layer to the vocabulary, z = x W^T + b for each token's input x [h]; SPLADE's
embedding is the max (or sum) over a text's real tokens of f(z) = log(1 + relu(z)) (or log(1 + f)): V weights
per text from L x V logits. Autograd would keep those logits and the activations between them for the
backward, several [B, L, V] tensors per chunk of texts (32 texts of 256 tokens over BERT's 30,522 entries: 0.5 GB
each in bf16), far more than the transformer's own activations. `splade_head_pooled` computes the logits a block
of tokens at a time and keeps only what the backward needs: the head's inputs [B, L, h], the embedding [B, V] and,
for max, which token gave each entry [B, V].

The backward is exact. For max, an entry's gradient reaches only its arg-max token, at f'(z*), which the entry's
value gives (relu: f' = exp(-e), log1p_relu: exp(-e - expm1(e)), 0 where e = 0); for sum every real token's
logit gets f'(z), the block's logits recomputed. Then dx = dz W, dW = dz^T x and db = sum dz, block by block.
Ties between tokens in a max (a measure-zero event for real logits) send the gradient to one of them, where
autograd's amax would split it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

BLOCK_ELEMENTS = 1 << 26
"""Logits per block (B x tokens x V): a float32 temporary of 256 MiB."""


class VocabularyHead(nn.Module):
    """A masked LM's output layer (`get_output_embeddings()`) kept for its weight (tied to the input embeddings
    where it was) and bias, returning its input: the model's `logits` are then the head's inputs, which
    `splade_head_pooled` turns into the embedding. Its parameters keep their names in the state dict."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = getattr(linear, "bias", None)

    def forward(self, x: Tensor) -> Tensor:
        return x


def fuse_vocabulary_head(tower: nn.Module) -> None:
    """Put a `VocabularyHead` in place of `tower`'s output layer, when it is a linear layer to the vocabulary."""
    head = tower.get_output_embeddings() if hasattr(tower, "get_output_embeddings") else None
    if isinstance(head, nn.Linear) and head.out_features == tower.config.vocab_size:
        tower.set_output_embeddings(VocabularyHead(head))


def fused_head(tower: nn.Module) -> VocabularyHead | None:
    """`tower`'s `VocabularyHead`, if its output layer is one."""
    head = tower.get_output_embeddings() if hasattr(tower, "get_output_embeddings") else None
    return head if isinstance(head, VocabularyHead) else None


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _activation(z: Tensor, activation: str) -> Tensor:
    """f(z) in the accumulation dtype: log(1 + relu(z)), once more log(1 + .) for log1p_relu."""
    out = torch.log1p(torch.relu(z.to(_acc(z.dtype))))
    return torch.log1p(out) if activation == "log1p_relu" else out


def _slope(z: Tensor, activation: str) -> Tensor:
    """f'(z) in the accumulation dtype (0 for z <= 0, as autograd's relu)."""
    r = torch.relu(z.to(_acc(z.dtype)))
    slope = (z > 0).to(r.dtype) / (1 + r)
    return slope / (1 + torch.log1p(r)) if activation == "log1p_relu" else slope


class _SpladeHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, mask, strategy, activation, block):  # noqa: ANN001, ANN205
        batch, length, _ = x.shape
        vocab = weight.shape[0]
        w = weight.to(x.dtype)
        b = None if bias is None else bias.to(x.dtype)
        total = torch.zeros(batch, vocab, dtype=_acc(x.dtype), device=x.device)
        best = torch.full((batch, vocab), -1, dtype=torch.int32, device=x.device) if strategy == "max" else None
        for start in range(0, length, block):
            z = torch.nn.functional.linear(x[:, start : start + block], w, b)
            values = _activation(z, activation) * mask[:, start : start + block, None]
            if best is None:
                total += values.sum(1)
                continue
            top, where = values.max(1)
            better = top > total
            total = torch.where(better, top, total)
            best = torch.where(better, (where + start).to(torch.int32), best)
        ctx.save_for_backward(x, weight, bias, mask, total, best)
        ctx.options = (strategy, activation, block)
        return total.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x, weight, bias, mask, total, best = ctx.saved_tensors
        strategy, activation, block = ctx.options
        length = x.shape[1]
        w = weight.to(x.dtype)
        b = None if bias is None else bias.to(x.dtype)
        acc = _acc(x.dtype)
        grad = grad.to(acc)
        if strategy == "max":  # each entry's gradient at its arg-max token, f'(z*) from the entry's value
            slope = torch.exp(-total - (torch.expm1(total) if activation == "log1p_relu" else 0))
            grad = torch.where(total > 0, grad * slope, 0.0)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = torch.empty_like(x) if need_x else None
        dw = torch.zeros(weight.shape, dtype=acc, device=x.device) if need_w else None
        db = torch.zeros(weight.shape[0], dtype=acc, device=x.device) if need_b and bias is not None else None
        for start in range(0, length, block):
            xs = x[:, start : start + block]
            if best is not None:
                positions = torch.arange(start, start + xs.shape[1], device=x.device, dtype=torch.int32)
                dz = (best[:, None, :] == positions[None, :, None]) * grad[:, None, :]
            else:
                z = torch.nn.functional.linear(xs, w, b)
                dz = _slope(z, activation) * grad[:, None, :] * mask[:, start : start + block, None]
            if dx is not None:
                dx[:, start : start + block] = (dz.to(x.dtype) @ w).to(x.dtype)
            if dw is not None:
                dw += dz.flatten(0, 1).T @ xs.flatten(0, 1).to(acc)
            if db is not None:
                db += dz.sum((0, 1))
        dw = None if dw is None else dw.to(weight.dtype)
        db = None if db is None else db.to(bias.dtype)
        return dx, dw, db, None, None, None, None


def splade_head_pooled(
    x: Tensor,
    head: VocabularyHead,
    mask: Tensor,
    strategy: str = "max",
    activation: str = "relu",
    block: int | None = None,
) -> Tensor:
    """SPLADE's embedding [B, V] of the head's inputs `x` [B, L, h] over the real tokens (`mask` [B, L]): equal to
    `pooling.splade_pooled` of `head`'s logits (max, or sum for `strategy` "sum"; relu or log1p_relu), without
    them (see the module); `block`: tokens per block (default: BLOCK_ELEMENTS logits)."""
    if block is None:
        block = max(1, BLOCK_ELEMENTS // max(1, x.shape[0] * head.weight.shape[0]))
    return _SpladeHead.apply(x, head.weight, head.bias, mask.to(x.dtype), strategy, activation, block)
