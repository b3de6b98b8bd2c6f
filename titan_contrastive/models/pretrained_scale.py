"""The learnable temperature of the families that start from pretrained weights (bi_encoder, qwen_vl, static):
log t as a [1] parameter, and for an objective with a bias (the sigmoid loss) the bias b, the weights
`init_weights` sets (the rest is loaded when the model is built)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from titan_contrastive.losses import build_objective, temperature_from_config


def scale_fields(cfg: Any, start: float) -> dict[str, Any]:
    """The args' `init_scale`, `learn_logit_scale`, `init_logit_bias` and `learn_logit_bias` from `[loss]`: t starts
    at `[loss] init_logit_scale`, else at `start` (the family's), except under an objective with a bias, whose own
    pair (SigLIP's t = 10, b = -10) is the default; b is None for an objective without one."""
    biased = build_objective(cfg.loss).has_bias
    t = temperature_from_config(cfg, default_logit_scale=None if biased else math.log(start))
    return {
        "init_scale": math.exp(t.init_logit_scale),
        "learn_logit_scale": t.learn_logit_scale,
        "init_logit_bias": t.init_logit_bias,
        "learn_logit_bias": t.learn_logit_bias,
    }


class PretrainedScale:
    """A mixin for an `nn.Module` whose `args` carry `init_scale` (t at the start), `learn_logit_scale`,
    `init_logit_bias` (None: no bias) and `learn_logit_bias`."""

    args: Any
    logit_scale: nn.Parameter
    logit_bias: nn.Parameter | None

    def add_logit_scale(self) -> None:
        """`self.logit_scale` = log t, trained unless `learn_logit_scale` is false; `self.logit_bias` = b where
        the objective has one (else None), trained unless `learn_logit_bias` is false."""
        self.logit_scale = nn.Parameter(
            torch.full((1,), math.log(self.args.init_scale)), requires_grad=self.args.learn_logit_scale
        )
        bias = self.args.init_logit_bias
        self.logit_bias = (
            None
            if bias is None
            else nn.Parameter(torch.full((1,), float(bias)), requires_grad=self.args.learn_logit_bias)
        )

    def temperature(self) -> tuple[Tensor, ...]:
        """What forward returns after the embeddings: (exp(logit_scale),), or (exp(logit_scale), logit_bias)."""
        scale = self.logit_scale.exp()
        return (scale,) if self.logit_bias is None else (scale, self.logit_bias)

    def init_weights(self) -> None:
        """Pretrained: only the scale (and bias) have initial values of their own."""
        with torch.no_grad():
            self.logit_scale.fill_(math.log(self.args.init_scale))
            if self.logit_bias is not None:
                self.logit_bias.fill_(float(self.args.init_logit_bias))
