"""A folder's text tower as transformers loads it, readied for training here: its base model (or its masked-LM
model, SPLADE's), without the pooler head and key-value cache we never use, attending both ways when asked,
on the attention kernel asked for."""

from __future__ import annotations

import torch
from torch import nn

from titan_contrastive.models.bi_encoder.folder import TextFolderError, is_causal, load_config, text_model_class
from titan_contrastive.models.bi_encoder.splade_head import fuse_vocabulary_head


def load_text_tower(
    model_dir: str, trust: bool = False, bidirectional: bool = False, masked_lm: bool = False, attention: str = ""
) -> nn.Module:
    """The folder's base model (no LM head, no pooler: the pooling is ours, no key-value cache; an
    encoder-decoder's encoder, `folder.text_model_class`), its load
    report kept out of the log, in training mode as a freshly built module is (`from_pretrained` returns
    it in eval mode: its dropout would stay off in training until the first evaluation switched it on); `trust`:
    the folder's own model code may run (`load_config`); `bidirectional`: a decoder's tokens attend to the whole
    text (transformers' `is_causal` set false in its config, which its exports save), or a TextFolderError where
    its code does not read that switch; `masked_lm`: with its masked-LM head (SPLADE), `folder.text_model_class`,
    whose output layer returns its inputs for `splade_head` to finish (`fuse_vocabulary_head`);
    `attention`: transformers' `attn_implementation` ("" = its default), a TextFolderError where it cannot run."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    auto = text_model_class(load_config(model_dir, trust), model_dir, masked_lm)
    kernel = {"attn_implementation": attention} if attention else {}
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
