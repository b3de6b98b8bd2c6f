"""`ModelArgs`: what every model family's args (a frozen dataclass, one per flavor) provide.

The trainer never reads a family's fields; it calls these four methods: sizing by the data,
the job's settings, and the two numbers it logs (parameters and training FLOPs per sample, for
MFU). `register_model` refuses a flavor that lacks one, naming it.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from titan_contrastive.config import ConfigError

__all__ = ["ModelArgs", "configured", "missing_methods"]


@runtime_checkable
class ModelArgs(Protocol):
    def update_from_data(self, *, image_shape: Any, vocab_size: int, context_length: int, eos_id: int) -> ModelArgs:
        """A copy sized by the training data: its image shape (C, H, W), its tokenizer's vocabulary and
        EOS id, the context length. A ValueError when the flavor cannot take this data (the message says why)."""
        ...

    def update_from_config(self, cfg: Any) -> ModelArgs:
        """A copy with the job's settings the model reads from its args (temperature, a folder to load,
        pixel-loss options); returns itself unchanged when there are none. Applied once, before the data."""
        ...

    def num_params(self) -> int:
        """The built model's parameter count, exact."""
        ...

    def flops_per_sample(self) -> int:
        """Training FLOPs per sample (forward and backward), 0 when not modelled (no MFU is logged then)."""
        ...


def missing_methods(args: Any) -> list[str]:
    """The `ModelArgs` methods `args` lacks (empty when it is one)."""
    return [
        name
        for name in ("update_from_data", "update_from_config", "num_params", "flops_per_sample")
        if not callable(getattr(args, name, None))
    ]


def configured(args: Any, cfg: Any, spec: Any) -> Any:
    """`args.update_from_config(cfg)` for the family of `spec` (a `ModelSpec`); a ConfigError for the settings it
    cannot take: `[model] patch_dropout`, `trust_remote_code`, `include_prompt`, `bidirectional`,
    `attn_implementation`, the SPLADE pooling's or ColBERT's keys, `pooling`, `static_dim`, `[lora] enable` where its
    args do not carry them (no image patches to drop, no folder whose code it runs, no prompt left out of a pooling,
    no decoder whose causal mask could go, no transformers model, no SPLADE, no ColBERT, no pooling, no table, no
    adapters), `[optimizer] layer_decay` where it names no towers whose layers
    could decay."""
    m = cfg.model
    for key, given, why in (  # the setting, whether it is given, why this family cannot take it
        ("trust_remote_code", m.trust_remote_code, "loads no folder's own code (bi_encoder does)"),
        ("include_prompt", m.include_prompt is not None, "pools no prompted texts (bi_encoder does)"),
        ("attn_implementation", m.attn_implementation, "runs no transformers model (bi_encoder and qwen_vl do)"),
        ("bidirectional", m.bidirectional is not None, "has no decoder whose attention it could turn (bi_encoder has)"),
        ("inference_free", m.inference_free is not None, "has no SPLADE queries (bi_encoder has)"),
        ("splade_pooling", m.splade_pooling != "auto", "has no SPLADE pooling (bi_encoder has)"),
        ("splade_activation", m.splade_activation != "auto", "has no SPLADE pooling (bi_encoder has)"),
        ("colbert_dim", m.colbert_dim != 0, "has no ColBERT projection (bi_encoder has)"),
        ("query_expansion", m.query_expansion is not None, "has no ColBERT queries (bi_encoder has)"),
        ("pooling", m.pooling != "auto", "pools as its architecture does (bi_encoder and qwen_vl take a pooling)"),
        ("static_dim", m.static_dim != 0, "has no table of token vectors to start (static has)"),
    ):
        if given and not hasattr(args, key):
            value = getattr(m, key)
            shown = str(value).lower() if isinstance(value, bool) else value
            fix = "set model.trust_remote_code=false" if key == "trust_remote_code" else "remove it"
            raise ConfigError(f"model.{key}={shown}: the {spec.name} family {why}; {fix}")
    if cfg.lora.enable and not hasattr(args, "lora_rank"):
        raise ConfigError(
            f"lora.enable=true: the {spec.name} family has no Hugging Face layers to adapt (bi_encoder, hf_clip and "
            "qwen_vl have); set lora.enable=false"
        )
    args = args.update_from_config(cfg)
    if getattr(args, "patch_dropout", 0.0) != cfg.model.patch_dropout:
        raise ConfigError(
            f"model.patch_dropout={cfg.model.patch_dropout}: the {spec.name} family has no image patches to drop "
            "(clip, lit and hf_clip have); set model.patch_dropout=0"
        )
    if cfg.optimizer.layer_decay < 1 and not spec.towers:
        raise ConfigError(
            f"optimizer.layer_decay={cfg.optimizer.layer_decay}: the {spec.name} family names no towers whose layers "
            "could decay (clip, hf_clip, lit and bi_encoder do); set optimizer.layer_decay=1"
        )
    return args
