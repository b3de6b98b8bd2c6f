"""Pre-norm transformer shared by the towers of the model families.

Why one shared block type: per-block FSDP wrapping, activation checkpointing and
`torch.compile` treat `ResidualBlock` as the unit, so the CLIP towers and the vlm
family's towers use the same class. Tensors are batch-first `[B, T, width]`.

The parameter layout matches OpenAI/open_clip CLIP (fused q/k/v `in_proj` with bias,
`out_proj`, `ln_1`/`ln_2`, MLP `c_fc`/`c_proj` with biases), so parameter counts agree
with the reference models exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ACTIVATIONS", "Attention", "MLP", "QuickGELU", "ResidualBlock", "Transformer", "mlp_hidden"]


def mlp_hidden(width: int, mlp_ratio: float) -> int:
    """Hidden size of the MLP; the single definition used by the modules and by analytic counts."""
    return int(width * mlp_ratio)


def _maybe_dropout(p: float) -> nn.Module:
    """Dropout only when enabled, so `dropout=0` costs nothing and draws no random numbers."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


class Attention(nn.Module):
    """Multi-head self-attention through `scaled_dot_product_attention`.

    `causal=True` (text) uses the kernel's built-in causal masking instead of a mask
    tensor, so no mask buffer exists that meta-device init would have to rebuild.
    """

    def __init__(self, width: int, heads: int, *, causal: bool) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"attention width={width} is not divisible by heads={heads}")
        self.heads = heads
        self.causal = causal
        self.in_proj = nn.Linear(width, 3 * width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        """`attn_mask`: optional bool [B, 1, 1, T], True where a key may be attended (padding)."""
        b, t, w = x.shape
        # [B, T, 3, H, D] -> three [B, H, T, D] views; unbind, not permute(2, 0, 3, 1, 4): the same
        # values, but permute's backward stacks q, k, v gradients into a new tensor and copies it
        q, k, v = (z.transpose(1, 2) for z in self.in_proj(x).view(b, t, 3, self.heads, w // self.heads).unbind(2))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=self.causal)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, w))


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x): the activation OpenAI's CLIP checkpoints were trained with."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {"gelu": nn.GELU, "quick_gelu": QuickGELU}


class MLP(nn.Module):
    """Two-layer MLP; GELU (open_clip's default for ViT-B/32) or OpenAI's quick GELU."""

    def __init__(self, width: int, hidden: int, act: str = "gelu") -> None:
        super().__init__()
        self.c_fc = nn.Linear(width, hidden)
        self.act = ACTIVATIONS[act]()
        self.c_proj = nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class ResidualBlock(nn.Module):
    """Pre-norm block `x + drop(attn(ln_1(x)))`, then `x + drop(mlp(ln_2(x)))`.

    Dropout sits on the attention output and the MLP output (residual dropout), which is
    where RNG replay under activation checkpointing matters.
    """

    def __init__(
        self, width: int, heads: int, mlp_ratio: float, dropout: float, *, causal: bool, act: str = "gelu"
    ) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads, causal=causal)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLP(width, mlp_hidden(width, mlp_ratio), act)
        self.dropout = _maybe_dropout(dropout)

    def forward(self, x: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        x = x + self.dropout(self.attn(self.ln_1(x), attn_mask))
        return x + self.dropout(self.mlp(self.ln_2(x)))

    def init_weights(
        self, *, attn_std: float, proj_std: float, fc_std: float, generator: torch.Generator | None
    ) -> None:
        """CLIP init: normal weights, zero biases, unit LayerNorms (see `Transformer.init_weights`)."""
        for ln in (self.ln_1, self.ln_2):
            ln.reset_parameters()
        for linear, std in (
            (self.attn.in_proj, attn_std),
            (self.attn.out_proj, proj_std),
            (self.mlp.c_fc, fc_std),
            (self.mlp.c_proj, proj_std),
        ):
            nn.init.normal_(linear.weight, std=std, generator=generator)
            nn.init.zeros_(linear.bias)


class Transformer(nn.Module):
    """A stack of `ResidualBlock`s; `blocks` is what per-block parallelism wraps."""

    def __init__(
        self, width: int, layers: int, heads: int, mlp_ratio: float, dropout: float, *, causal: bool, act: str = "gelu"
    ) -> None:
        super().__init__()
        self.width = width
        self.blocks = nn.ModuleList(
            ResidualBlock(width, heads, mlp_ratio, dropout, causal=causal, act=act) for _ in range(layers)
        )

    def forward(self, x: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        for block in self.blocks:
            x = block(x) if attn_mask is None else block(x, attn_mask)
        return x

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """CLIP-style init: attention input std width^-0.5, MLP input std (2*width)^-0.5, and
        residual output projections scaled by (2*layers)^-0.5 so the residual stream's
        variance stays O(1) with depth."""
        attn_std = self.width**-0.5
        proj_std = attn_std * (2 * len(self.blocks)) ** -0.5
        fc_std = (2 * self.width) ** -0.5
        for block in self.blocks:
            block.init_weights(attn_std=attn_std, proj_std=proj_std, fc_std=fc_std, generator=generator)
