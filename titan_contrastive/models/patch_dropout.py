"""Patch dropout (FLIP: Li et al. 2023, "Scaling Language-Image Pre-training via Masking"): in training, each
image's transformer sees a random subset of its patch tokens, so the image tower costs about `1 - prob` of its
compute and activations per sample, and a step holds more samples.

The tokens are dropped after the position embeddings are added (each kept token keeps its position), before
the blocks; prefix tokens (CLIP's class token) are always kept. Each image keeps `max(1, int(n * (1 - prob)))`
of its `n` patches, in their original order, drawn independently per image from the torch RNG of the
tokens' device. That draw is an ordinary random draw, like dropout's: a cached-gradient re-forward replays
it (`grad_cache.rng`), so every step kind stays exact. In evaluation (and in a locked tower, which runs in
eval mode) every patch is kept; `prob = 0` draws nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["PatchDropout", "drop_patches_after", "kept_patches"]


def kept_patches(patches: int, prob: float) -> int:
    """Patch tokens each image keeps in training (open_clip's count: at least one)."""
    return max(1, int(patches * (1 - prob))) if prob else patches


class PatchDropout(nn.Module):
    """[B, prefix + n, D] -> [B, prefix + kept_patches(n, prob), D] in training; the identity in evaluation."""

    def __init__(self, prob: float, prefix: int = 0) -> None:
        super().__init__()
        if not 0.0 <= prob < 1.0:
            raise ValueError(f"patch dropout prob={prob} must be in [0, 1)")
        self.prob, self.prefix = prob, prefix

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or not self.prob:
            return x
        b, n = x.shape[0], x.shape[1] - self.prefix
        keep = torch.rand(b, n, device=x.device).topk(kept_patches(n, self.prob), dim=-1).indices.sort(-1).values
        patches = x[:, self.prefix :].gather(1, keep[..., None].expand(-1, -1, x.shape[-1]))
        return torch.cat([x[:, : self.prefix], patches], dim=1)

    def extra_repr(self) -> str:
        return f"prob={self.prob}, prefix={self.prefix}"


def drop_patches_after(embeddings: nn.Module, prob: float, prefix: int) -> None:
    """Patch dropout on the output of a transformers vision `embeddings` module (CLIP's: the class token then
    the patches, positions added; SigLIP's: the patches): a `patch_dropout` child (no parameters: the state
    dict's names are unchanged) applied by a forward hook, in the embeddings' own train / eval mode."""
    embeddings.patch_dropout = PatchDropout(prob, prefix)
    embeddings.register_forward_hook(lambda module, args, out: module.patch_dropout(out))
