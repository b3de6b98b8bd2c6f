"""open_clip checkpoints <-> the clip family (ViT image tower + causal text tower, open_clip's `CLIP`).

open_clip's layout is the one this family copies (OpenAI's), so the mapping is renames only:
`transformer.resblocks.N` -> `transformer.blocks.N`, `attn.in_proj_weight` -> `attn.in_proj.weight`,
the text tower's tensors at the top level -> under `text.`, `logit_scale` 0-d -> [1].

The architecture comes from `open_clip_config.json` (`model_cfg`: `embed_dim`, `quick_gelu`,
`vision_cfg` {image_size, layers, width, patch_size, head_width, mlp_ratio}, `text_cfg`
{context_length, vocab_size, width, heads, layers, mlp_ratio}) when the checkpoint has one, else
from the tensors' shapes as open_clip's own `build_model_from_openai_state_dict` does (heads =
width / 64; the activation is then quick GELU, what OpenAI's `.pt` files were trained with).
Models with a custom text tower (HF text encoders), attention pooling or non-default norms are
not representable: their extra keys are a one-line error.
"""

from __future__ import annotations

import re
from typing import Any

from torch import Tensor

from titan_contrastive.interop.hf_clip import InteropError
from titan_contrastive.models.clip.args import CLIPArgs

CONFIG_FILE = "open_clip_config.json"
WEIGHT_FILES = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
_RENAMES = [(r"\.resblocks\.", ".blocks."), (r"\.in_proj_weight$", ".in_proj.weight"), (r"\.in_proj_bias$", ".in_proj.bias")]
_TEXT_KEYS = ("token_embedding.", "positional_embedding", "transformer.", "ln_final.", "text_projection")


def _layers(state: dict[str, Tensor], prefix: str) -> int:
    return len({int(m.group(1)) for k in state if (m := re.match(rf"{re.escape(prefix)}resblocks\.(\d+)\.", k))})


def args_from_open_clip(config: dict[str, Any] | None, state: dict[str, Tensor]) -> CLIPArgs:
    """CLIPArgs from `open_clip_config.json`'s content (or None: from the open_clip state dict's shapes)."""
    if config is not None:
        cfg = config.get("model_cfg", config)
        vision, text = cfg["vision_cfg"], cfg["text_cfg"]
        if "hf_model_name" in text or vision.get("timm_model_name") or vision.get("attentional_pool"):
            raise InteropError(f"{CONFIG_FILE}: a model with a custom tower (hf_model_name / timm_model_name / attentional_pool); "
                               "the clip family builds only open_clip's own ViT + text transformer")
        ratios = {vision.get("mlp_ratio", 4.0), text.get("mlp_ratio", 4.0)}
        if len(ratios) != 1:
            raise InteropError(f"{CONFIG_FILE}: mlp_ratio {sorted(ratios)} differs between the towers; the clip family uses one")
        width = vision["width"]
        return CLIPArgs(
            embed_dim=cfg["embed_dim"], image_size=vision["image_size"], patch_size=vision["patch_size"], in_channels=3,
            vision_width=width, vision_layers=vision["layers"], vision_heads=width // vision.get("head_width", 64),
            vocab_size=text.get("vocab_size", 49408), context_length=text.get("context_length", 77), text_width=text["width"],
            text_layers=text["layers"], text_heads=text.get("heads", 8), mlp_ratio=ratios.pop(),
            act="quick_gelu" if cfg.get("quick_gelu") else "gelu", eos_id=-1)
    conv = state["visual.conv1.weight"]
    grid = round((state["visual.positional_embedding"].shape[0] - 1) ** 0.5)
    return CLIPArgs(
        embed_dim=state["text_projection"].shape[1], image_size=conv.shape[-1] * grid, patch_size=conv.shape[-1],
        in_channels=conv.shape[1], vision_width=conv.shape[0], vision_layers=_layers(state, "visual.transformer."),
        vision_heads=max(1, conv.shape[0] // 64), vocab_size=state["token_embedding.weight"].shape[0],
        context_length=state["positional_embedding"].shape[0], text_width=state["ln_final.weight"].shape[0],
        text_layers=_layers(state, "transformer."), text_heads=max(1, state["ln_final.weight"].shape[0] // 64), act="quick_gelu", eos_id=-1)


def open_clip_config(args: CLIPArgs) -> dict[str, Any]:
    """`open_clip_config.json` content for a clip-family model (OpenAI's preprocessing)."""
    if args.init_logit_bias is not None:
        raise InteropError("the model has SigLIP's logit_bias: open_clip's CLIP has none (its SigLIP models use custom towers)")
    if args.vision_width % args.vision_heads:
        raise InteropError(f"vision_width {args.vision_width} is not a multiple of vision_heads {args.vision_heads}")
    return {
        "model_cfg": {
            "embed_dim": args.embed_dim, "quick_gelu": args.act == "quick_gelu",
            "vision_cfg": {"image_size": args.image_size, "layers": args.vision_layers, "width": args.vision_width,
                           "patch_size": args.patch_size, "head_width": args.vision_width // args.vision_heads, "mlp_ratio": args.mlp_ratio},
            "text_cfg": {"context_length": args.context_length, "vocab_size": args.vocab_size, "width": args.text_width,
                         "heads": args.text_heads, "layers": args.text_layers, "mlp_ratio": args.mlp_ratio},
        },
        "preprocess_cfg": {"mean": [0.48145466, 0.4578275, 0.40821073], "std": [0.26862954, 0.26130258, 0.27577711]},
    }


def from_open_clip_state_dict(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """open_clip's state dict -> ours (renames; the text tower under `text.`; attn_mask buffers dropped)."""
    out = {}
    for key, tensor in state.items():
        if key == "attn_mask" or key.endswith(".attn_mask"):
            continue
        name = key
        for pattern, repl in _RENAMES:
            name = re.sub(pattern, repl, name)
        if key.startswith(_TEXT_KEYS):
            name = "text." + name
        out[name] = tensor.reshape(1) if key == "logit_scale" else tensor
    return out


def to_open_clip_state_dict(ours: dict[str, Tensor]) -> dict[str, Tensor]:
    """Ours -> open_clip's (the inverse of `from_open_clip_state_dict`)."""
    out = {}
    for name, tensor in ours.items():
        key = name[len("text."):] if name.startswith("text.") else name
        key = key.replace(".blocks.", ".resblocks.").replace(".in_proj.weight", ".in_proj_weight").replace(".in_proj.bias", ".in_proj_bias")
        out[key] = tensor.reshape(()) if name == "logit_scale" else tensor.contiguous()
    return out
