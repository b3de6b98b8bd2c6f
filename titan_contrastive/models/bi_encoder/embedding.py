"""A text tower's embedding of token ids: the tower's forward on the ids (a locked tower's through
`locked_forward`), its pooling (`pooling.py`), the folder's Dense layers (`dense_head`) and the L2 normalization;
SPLADE's sparse vectors as pooled."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titan_contrastive.batching import right_trimmed
from titan_contrastive.components.freeze import locked_forward
from titan_contrastive.models.bi_encoder.folder import DenseLayer, TextFolderError
from titan_contrastive.models.bi_encoder.pooling import pooled, splade_pooled
from titan_contrastive.models.bi_encoder.splade_head import fused_head, splade_head_pooled


def dense_head(layers: Sequence[DenseLayer], width: int) -> nn.Sequential | None:
    """The folder's Dense modules (`folder.DenseLayer`) after a pooling `width` wide, each a
    `Sequential(Linear, activation)` with its weights (safetensors), in one Sequential; None without any."""
    from safetensors.torch import load_file

    modules: list[nn.Module] = []
    for layer in layers:
        if layer.in_features != width:
            raise TextFolderError(
                f"{layer.folder}: in_features={layer.in_features}, and the embedding that reaches it is {width} "
                "wide; repair its config.json or remove the module from modules.json"
            )
        width = layer.out_features
        linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias)
        weights = load_file(str(Path(layer.folder) / "model.safetensors"))
        try:
            linear.load_state_dict(
                {k.removeprefix("linear."): v for k, v in weights.items() if k.startswith("linear.")}
            )
        except RuntimeError as e:
            raise TextFolderError(f"{layer.folder}: its weights do not fit its config.json ({str(e)[:160]})") from None
        modules.append(nn.Sequential(linear, nn.Tanh() if layer.activation == "tanh" else nn.Identity()))
    return nn.Sequential(*modules) if modules else None


def embed(
    tower: nn.Module,
    ids: Tensor,
    pad: int,
    pooling: str,
    index: int,
    replay: Sequence[Tensor | None] | None = None,
    head: nn.Module | None = None,
    skip: int = 0,
    splade: tuple[str, str] = ("max", "relu"),
    exits: tuple[int, ...] = (),
    exit_norm: nn.Module | None = None,
) -> Tensor:
    """The tower's pooled (then `head`'s, the folder's Dense layers), L2-normalized embedding (SPLADE's: as
    pooled) of right-padded `ids` (a locked tower, `tower.frozen`, through `locked_forward`; `index`: its
    output's place in the model's, `replay`: the model's argument of that name; `skip`: prompt positions left
    out of the pooling; `splade`: SPLADE's pooling strategy and activation; `exits`: earlier layers whose hidden
    states are embedded the same way, side by side after the last's, [n, (1 + len(exits)) d], each through
    `exit_norm` first where given, a decoder's final norm). The tower runs on
    `ids` without the trailing columns that are padding in every row: the padding is masked, so that changes the
    embeddings by float rounding only, and saves its compute."""

    def run() -> Tensor:
        trimmed = right_trimmed(ids, pad)
        mask = trimmed != pad
        out = tower(
            input_ids=trimmed.masked_fill(~mask, 0), attention_mask=mask.long(), output_hidden_states=bool(exits)
        )
        if pooling == "splade":  # vocabulary-wide, sparse, not unit length: its logits are dot products
            vocabulary = fused_head(tower)  # ours returns the head's inputs; a plain masked LM (an export), its logits
            if vocabulary is None:
                return splade_pooled(out.logits, mask, *splade)
            return splade_head_pooled(out.logits, vocabulary, mask, *splade)
        norm = exit_norm or nn.Identity()
        layers = [out.last_hidden_state, *(norm(out.hidden_states[k]) for k in exits)]
        vectors = [pooled(hidden, mask, pooling, skip) for hidden in layers]
        return torch.cat([F.normalize(v if head is None else head(v), dim=-1) for v in vectors], -1)

    return locked_forward(tower, index, run, replay)
