"""A folder's text tower as transformers loads it, readied for training here: its base model (or its masked-LM
model, SPLADE's), without the pooler head and key-value cache we never use, attending both ways when asked,
on the attention kernel asked for."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from titan_contrastive.models.bi_encoder.folder import WRAPPERS, TextFolderError, folder_json, is_causal, load_config
from titan_contrastive.models.bi_encoder.splade_head import fuse_vocabulary_head


def load_text_tower(
    model_dir: str, trust: bool = False, bidirectional: bool = False, masked_lm: bool = False, attention: str = ""
) -> nn.Module:
    """The folder's base model (no LM head, no pooler: the pooling is ours, no key-value cache; an
    encoder-decoder's encoder, `text_model_class`), its load
    report kept out of the log, in training mode as a freshly built module is (`from_pretrained` returns
    it in eval mode: its dropout would stay off in training until the first evaluation switched it on); `trust`:
    the folder's own model code may run (`load_config`); `bidirectional`: a decoder's tokens attend to the whole
    text (transformers' `is_causal` set false in its config, which its exports save), or a TextFolderError where
    its code does not read that switch; `masked_lm`: with its masked-LM head (SPLADE), `text_model_class`,
    whose output layer returns its inputs for `splade_head` to finish (`fuse_vocabulary_head`);
    `attention`: transformers' `attn_implementation` ("" = its default), a TextFolderError where it cannot run."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    config = load_config(model_dir, trust)
    auto = text_model_class(config, model_dir, masked_lm)
    kernel = {"attn_implementation": attention} if attention else {}
    file = Path(model_dir) / "config.json"
    wrapper = WRAPPERS.get(folder_json(file).get("model_type", "")) if file.is_file() else None
    if wrapper:  # transformers' retrieval wrapper: its base model's config (a copy), its weights without their prefix
        kernel |= {"config": copy.deepcopy(config), "key_mapping": {f"^{re.escape(wrapper[1])}": ""}}
    try:
        tower = auto.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust, **kernel)
    except (ImportError, ValueError, OSError) as e:
        why = " ".join(str(e).split())[:200]
        if attention and not isinstance(e, OSError):  # the kernel's package is missing, or the model has no such path
            raise TextFolderError(
                f"model.attn_implementation={attention}: transformers cannot run {model_dir} with it ({why}); use "
                "sdpa (or install what it names)"
            ) from None
        if isinstance(e, ImportError):
            raise
        raise TextFolderError(f"{model_dir}: transformers cannot load its weights ({why})") from None
    if isinstance(getattr(tower, "pooler", None), nn.Module):
        tower.pooler = None
    if masked_lm:  # its logits left to SPLADE's fused head and pooling (`splade_head.py`)
        fuse_vocabulary_head(tower)
    for config in (tower.config, getattr(tower.config, "text_config", None)):
        if getattr(config, "use_cache", False):  # a decoder would keep every layer's keys and values (for generation)
            config.use_cache = False  # and an activation-checkpointing recompute would attend to them twice
    if bidirectional and is_causal(tower.config):
        tower.config.is_causal = False  # read by transformers' mask builders and attention functions
        if not _attends_ahead(tower):
            raise TextFolderError(
                f"model.bidirectional=true: {model_dir} still attends to earlier tokens only (its model code, "
                f"{type(tower).__name__}, does not read transformers' is_causal); remove the setting"
            )
    return tower.train()


def _attends_ahead(tower: nn.Module) -> bool:
    """Whether the first token's hidden state depends on a later token (a two-row probe, without gradients)."""
    ids = torch.tensor([[0, 1, 2], [0, 1, 3]], device=tower.device)
    with torch.no_grad():
        hidden = tower(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
    return not torch.equal(hidden[0, 0], hidden[1, 0])


def text_model_class(config: Any, model_dir: str, masked_lm: bool = False) -> Any:
    """The transformers auto class a folder's text tower loads with: `AutoModelForTextEncoding` where
    transformers names a text encoder for the architecture (an encoder-decoder's encoder alone: T5, mT5,
    UMT5, as sentence-T5 and GTR use them; the decoder would want inputs of its own), else `AutoModel`
    (the base model, no head); TextFolderError for another encoder-decoder, whose encoder has no class.
    `masked_lm` (the splade pooling): `AutoModelForMaskedLM`, the model with its vocabulary head, or a
    TextFolderError where transformers knows none for the architecture."""
    from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForTextEncoding
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        MODEL_FOR_TEXT_ENCODING_MAPPING_NAMES,
    )

    if masked_lm:
        if config.model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES and "AutoModelForMaskedLM" not in (
            getattr(config, "auto_map", None) or {}
        ):
            raise TextFolderError(
                f"model.pooling='splade' with {model_dir}: it reads a masked-LM head's logits over the vocabulary, "
                f"and transformers knows none for {config.model_type!r}; use a BERT-like folder (BERT, DistilBERT, "
                "ModernBERT, a SPLADE checkpoint)"
            )
        return AutoModelForMaskedLM

    if config.model_type in MODEL_FOR_TEXT_ENCODING_MAPPING_NAMES:
        return AutoModelForTextEncoding
    if getattr(config, "is_encoder_decoder", False):
        raise TextFolderError(
            f"{model_dir}: an encoder-decoder ({config.model_type}) whose encoder transformers cannot load alone "
            "(AutoModelForTextEncoding); save its encoder as a model folder of its own and set model.path to it"
        )
    return AutoModel
