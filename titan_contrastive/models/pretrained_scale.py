"""The learnable temperature of the families that start from pretrained weights (bi_encoder, qwen_vl, static):
log t as a [1] parameter, the one weight `init_weights` sets (the rest is loaded when the model is built)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class PretrainedScale:
    """A mixin for an `nn.Module` whose `args` carry `init_scale` (t at the start) and `learn_logit_scale`."""

    args: Any
    logit_scale: nn.Parameter

    def add_logit_scale(self) -> None:
        """`self.logit_scale` = log t, trained unless `learn_logit_scale` is false."""
        self.logit_scale = nn.Parameter(
            torch.full((1,), math.log(self.args.init_scale)), requires_grad=self.args.learn_logit_scale
        )

    def init_weights(self) -> None:
        """Pretrained: only the scale has an initial value of its own."""
        with torch.no_grad():
            self.logit_scale.fill_(math.log(self.args.init_scale))
