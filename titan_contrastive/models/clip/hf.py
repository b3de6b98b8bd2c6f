"""Hugging Face transformers' `CLIPModel` <-> the clip family: configs and state dicts, both ways.

The clip family's layout is OpenAI's (fused q/k/v `in_proj`, `c_fc`/`c_proj`, projections as
[width, embed] matrices); HF splits q, k and v, names the layers differently and stores the
projections as `nn.Linear` weights ([embed, width]). Every tensor maps one to one, so a round trip
is bit-identical. What the architecture takes from the HF config:

- sizes (widths, depths, heads, patch and image size, vocabulary, context = max positions);
- `hidden_act`: `quick_gelu` (OpenAI's checkpoints) or `gelu`;
- the pooling token: HF pools the text tower at the first `eos_token_id`, except the legacy
  `eos_token_id == 2` of older OpenAI configs, where it pools at the highest id in the row
  (`CLIPArgs.eos_id = -1` here, which is the same thing for CLIP's BPE, whose EOS is its last id);
- the image channels (`num_channels`), so 1-channel models export and load as they are.

Not representable (a one-line error): different MLP ratios or activations in the two towers, a
layer-norm epsilon other than 1e-5, SigLIP's `logit_bias` on export, and on export a model that
pools at the first id 2, the byte tokenizer's EOS: transformers reads `eos_token_id == 2` as its
legacy rule (`CLIPTextTransformer`: `if self.eos_token_id == 2` pools at the argmax id, which for
the byte tokenizer is a byte, not EOS) and has no other way to say "first 2" (a list `[2]` passes
the config but breaks its forward), so such an export would change the text embeddings.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from titan_contrastive.models.clip.args import CLIPArgs
from titan_contrastive.models.weights import WeightsError

HF_LEGACY_EOS = 2


def args_from_hf_config(config: Any) -> CLIPArgs:
    """CLIPArgs from a `transformers.CLIPConfig` (or its dict)."""
    cfg = config if isinstance(config, dict) else config.to_dict()
    text, vision = cfg["text_config"], cfg["vision_config"]
    ratios = {tower: c["intermediate_size"] / c["hidden_size"] for tower, c in (("text", text), ("vision", vision))}
    acts = {text.get("hidden_act", "quick_gelu"), vision.get("hidden_act", "quick_gelu")}
    if len(set(ratios.values())) != 1 or len(acts) != 1 or acts - {"gelu", "quick_gelu"}:
        raise WeightsError(
            f"CLIP config: MLP ratios {ratios} and activations {sorted(acts)} must be equal in both towers "
            "and gelu or quick_gelu; this checkpoint's architecture is not one the clip family builds"
        )
    eps = {text.get("layer_norm_eps", 1e-5), vision.get("layer_norm_eps", 1e-5)}
    if eps != {1e-5}:
        raise WeightsError(f"CLIP config: layer_norm_eps={sorted(eps)}; the clip family uses 1e-5")
    eos = text.get("eos_token_id", HF_LEGACY_EOS)
    if not isinstance(eos, int):
        raise WeightsError(
            f"CLIP config: text_config eos_token_id={eos!r}; transformers' CLIP text model pools at one id, give an "
            "integer"
        )
    return CLIPArgs(
        embed_dim=cfg["projection_dim"],
        image_size=vision["image_size"],
        patch_size=vision["patch_size"],
        in_channels=vision.get("num_channels", 3),
        vision_width=vision["hidden_size"],
        vision_layers=vision["num_hidden_layers"],
        vision_heads=vision["num_attention_heads"],
        vocab_size=text["vocab_size"],
        context_length=text["max_position_embeddings"],
        text_width=text["hidden_size"],
        text_layers=text["num_hidden_layers"],
        text_heads=text["num_attention_heads"],
        mlp_ratio=next(iter(ratios.values())),
        act=acts.pop(),
        eos_id=-1 if eos == HF_LEGACY_EOS else eos,
        init_logit_scale=float(cfg.get("logit_scale_init_value", 2.6592)),
    )


def hf_config_from_args(args: CLIPArgs) -> Any:
    """The `transformers.CLIPConfig` of a clip-family model."""
    from transformers import CLIPConfig

    if args.init_logit_bias is not None:
        raise WeightsError(
            "the model has SigLIP's logit_bias, which transformers' CLIPModel has no place for; export a clip-loss "
            "model"
        )
    if args.eos_id == HF_LEGACY_EOS:
        raise WeightsError(
            f"the model pools its text at the first token id {HF_LEGACY_EOS} (the byte tokenizer's EOS), which "
            f"transformers' CLIPModel cannot express: it reads eos_token_id={HF_LEGACY_EOS} as its legacy rule and "
            "pools at the highest id, changing the text embeddings; export with --to open_clip, or train with "
            "data.tokenizer=clip_bpe"
        )

    def tower(width: int, layers: int, heads: int) -> dict[str, Any]:
        return dict(
            hidden_size=width,
            intermediate_size=int(width * args.mlp_ratio),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            hidden_act=args.act,
            layer_norm_eps=1e-5,
        )

    eos = HF_LEGACY_EOS if args.eos_id == -1 else args.eos_id
    text = dict(
        tower(args.text_width, args.text_layers, args.text_heads),
        vocab_size=args.vocab_size,
        max_position_embeddings=args.context_length,
        eos_token_id=eos,
        bos_token_id=min(49406, args.vocab_size - 1),
        pad_token_id=min(1, args.vocab_size - 1),
    )
    vision = dict(
        tower(args.vision_width, args.vision_layers, args.vision_heads),
        image_size=args.image_size,
        patch_size=args.patch_size,
        num_channels=args.in_channels,
    )
    return CLIPConfig(
        text_config=text,
        vision_config=vision,
        projection_dim=args.embed_dim,
        logit_scale_init_value=args.init_logit_scale,
    )


def _blocks(prefix_ours: str, prefix_hf: str, layers: int) -> list[tuple[str, str]]:
    names = [
        ("ln_1", "layer_norm1"),
        ("ln_2", "layer_norm2"),
        ("attn.out_proj", "self_attn.out_proj"),
        ("mlp.c_fc", "mlp.fc1"),
        ("mlp.c_proj", "mlp.fc2"),
    ]
    return [
        (f"{prefix_ours}.{i}.{ours}.{p}", f"{prefix_hf}.{i}.{hf}.{p}")
        for i in range(layers)
        for ours, hf in names
        for p in ("weight", "bias")
    ]


def _renames(args: CLIPArgs) -> list[tuple[str, str]]:
    """(our name, HF name) of every tensor that maps unchanged."""
    return [
        ("visual.class_embedding", "vision_model.embeddings.class_embedding"),
        ("visual.positional_embedding", "vision_model.embeddings.position_embedding.weight"),
        ("visual.conv1.weight", "vision_model.embeddings.patch_embedding.weight"),
        ("visual.ln_pre.weight", "vision_model.pre_layrnorm.weight"),
        ("visual.ln_pre.bias", "vision_model.pre_layrnorm.bias"),
        ("visual.ln_post.weight", "vision_model.post_layernorm.weight"),
        ("visual.ln_post.bias", "vision_model.post_layernorm.bias"),
        ("text.token_embedding.weight", "text_model.embeddings.token_embedding.weight"),
        ("text.positional_embedding", "text_model.embeddings.position_embedding.weight"),
        ("text.ln_final.weight", "text_model.final_layer_norm.weight"),
        ("text.ln_final.bias", "text_model.final_layer_norm.bias"),
        *_blocks("visual.transformer.blocks", "vision_model.encoder.layers", args.vision_layers),
        *_blocks("text.transformer.blocks", "text_model.encoder.layers", args.text_layers),
    ]


def _towers(args: CLIPArgs) -> list[tuple[str, str, int]]:
    return [
        ("visual.transformer.blocks", "vision_model.encoder.layers", args.vision_layers),
        ("text.transformer.blocks", "text_model.encoder.layers", args.text_layers),
    ]


def to_hf_state_dict(ours: dict[str, Tensor], args: CLIPArgs) -> dict[str, Tensor]:
    """Our state dict -> CLIPModel's (q/k/v split from `in_proj`, projections transposed)."""
    out = {hf: ours[name] for name, hf in _renames(args)}
    for prefix, hf_prefix, layers in _towers(args):
        for i in range(layers):
            for p in ("weight", "bias"):
                for part, tensor in zip("qkv", ours[f"{prefix}.{i}.attn.in_proj.{p}"].chunk(3)):
                    out[f"{hf_prefix}.{i}.self_attn.{part}_proj.{p}"] = tensor
    out["visual_projection.weight"] = ours["visual.proj"].t()
    out["text_projection.weight"] = ours["text.text_projection"].t()
    out["logit_scale"] = ours["logit_scale"].reshape(())
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_state_dict(hf: dict[str, Tensor], args: CLIPArgs) -> dict[str, Tensor]:
    """CLIPModel's state dict -> ours. Keys it lacks or has in excess (position_ids buffers aside)
    are a one-line error naming the first few."""
    expected = {h for _, h in _renames(args)} | {"visual_projection.weight", "text_projection.weight", "logit_scale"}
    expected |= {
        f"{hp}.{i}.self_attn.{q}_proj.{p}"
        for _, hp, n in _towers(args)
        for i in range(n)
        for q in "qkv"
        for p in ("weight", "bias")
    }
    present = {k for k in hf if not k.endswith("position_ids")}
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    if missing or unexpected:
        raise WeightsError(
            f"CLIP checkpoint: missing keys {missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected keys "
            f"{unexpected[:3]}{'...' if len(unexpected) > 3 else ''}; the checkpoint's config.json does not "
            "describe its weights, or it is not a CLIPModel"
        )
    out = {name: hf[h] for name, h in _renames(args)}
    for prefix, hf_prefix, layers in _towers(args):
        for i in range(layers):
            for p in ("weight", "bias"):
                out[f"{prefix}.{i}.attn.in_proj.{p}"] = torch.cat(
                    [hf[f"{hf_prefix}.{i}.self_attn.{q}_proj.{p}"] for q in "qkv"]
                )
    out["visual.proj"] = hf["visual_projection.weight"].t()
    out["text.text_projection"] = hf["text_projection.weight"].t()
    out["logit_scale"] = hf["logit_scale"].reshape(1)
    return {k: v.contiguous() for k, v in out.items()}
