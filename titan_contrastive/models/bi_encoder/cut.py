"""A bi_encoder run trained with `[loss] adaptive_layers` cut to one of its earlier exits for export
(`python -m titan_contrastive.export STEP --layers K`): each tower keeps its first K transformer layers (LoRA merged
first), its config says K layers, and the run's pooling and Dense layers follow them. The cut model must embed as the
run's exit K did (`cut_to`'s check): so it is for towers whose layer K's output is what the next layer reads and the
pooling read in training (BERT-like encoders; a decoder trained with `loss.adaptive_final_norm`, whose exits went
through its final norm). Otherwise a decoder normalizes its last layer's output (`norm`), which an exit never had:
refused by the check, unless the norm's weights leave the directions alone (still 1, as under LoRA).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch import nn

from titan_contrastive.models.bi_encoder.folder import layer_blocks
from titan_contrastive.models.export_check import PROBE_TEXTS, TOLERANCE, refuse

__all__ = ["cut_to"]


def _cut_tower(tower: nn.Module, layers: int) -> nn.Module:
    """A copy of `tower` (a plain transformers model) with its first `layers` transformer layers."""
    cut = copy.deepcopy(tower)
    blocks = {id(b) for b in layer_blocks(cut)}
    lists = [m for m in cut.modules() if isinstance(m, nn.ModuleList) and {id(b) for b in m} == blocks]
    if len(lists) != 1:
        refuse(f"--layers {layers}: the layers of {type(tower).__name__} are not one list to cut")
    del lists[0][layers:]
    config = cut.config
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):  # per-layer attention kinds (sliding, full)
        config.layer_types = config.layer_types[:layers]
    return cut


def cut_to(model: Any, args: Any, layers: int, plain: Any, probe: Any) -> tuple[Any, Any]:
    """(`model` with its towers cut to their first `layers` layers, its args without adapters or exits): refused in
    one line unless the run trained that exit (`args.exits`) and the cut model embeds the probe texts as the exit
    did (`probe(model, args, side, texts)` gives a side's ids and embeddings; `plain(args, tower)` merges LoRA)."""
    if layers not in args.exits:
        refuse(
            f"--layers {layers}: this run trained the earlier layers {list(args.exits)} (loss.adaptive_layers); "
            "cut it to one of them"
        )
    block = 1 + args.exits.index(layers)
    cut = copy.copy(model)  # the heads, the scale and the tokenizer's settings shared; the towers its own
    cut._modules = dict(model._modules)
    cut.query_tower = _cut_tower(plain(args, model.query_tower), layers)
    cut.doc_tower = cut.query_tower if args.shared else _cut_tower(plain(args, model.doc_tower), layers)
    cut.args = dataclasses.replace(args, lora_rank=0, exits=())
    model.exits_in_eval = True
    try:
        for side in ("query", "doc"):
            ids, wide = probe(model, args, side, PROBE_TEXTS)
            width = wide.shape[-1] // (1 + len(args.exits))
            with torch.no_grad():
                diff = (cut.embed_side(side, ids) - wide[:, block * width : (block + 1) * width]).abs().max().item()
            if not diff <= TOLERANCE:
                refuse(
                    f"--layers {layers}: cut to its first {layers} layers, the model embeds the {side} probes up to "
                    f"{diff:.3g} away from the run's layer-{layers} exit (a decoder normalizes its last layer's "
                    "output, which an exit never had); export the whole model"
                )
    finally:
        model.exits_in_eval = False
    return cut, cut.args
