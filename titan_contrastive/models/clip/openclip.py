"""open_clip checkpoints <-> the clip family (ViT image tower + causal text tower, open_clip's `CLIP`).

open_clip's layout is the one this family copies (OpenAI's), so the mapping is renames only:
`transformer.resblocks.N` -> `transformer.blocks.N`, `attn.in_proj_weight` -> `attn.in_proj.weight`,
the text tower's tensors at the top level -> under `text.`, `logit_scale` 0-d -> [1].

The architecture comes from `open_clip_config.json` (`model_cfg`: `embed_dim`, `quick_gelu`,
`vision_cfg` {image_size, layers, width, patch_size, head_width, mlp_ratio}, `text_cfg`
{context_length, vocab_size, width, heads, layers, mlp_ratio, pool_type, eos_id}) when the
checkpoint has one, else from the tensors' shapes as open_clip's own `build_model_from_openai_state_dict`
does (heads = width / 64; the activation is then quick GELU, what OpenAI's `.pt` files were
trained with; pooling at the highest id). Models with a custom text tower (HF text encoders),
attention pooling or non-default norms are not representable: a one-line error.

Two conventions of ours that open_clip's defaults do not share, written so that open_clip computes
what our model computes:

- Text pooling. open_clip pools at the highest id (`pool_type: argmax`, right for CLIP's BPE,
  whose end-of-text is its last id) unless `text_cfg` says `pool_type: eos` with an `eos_id`, where
  it pools at the first `eos_id`, as our text tower does. The byte tokenizer's EOS is 2, below every
  byte, so its models are written with `pool_type: eos` (any `eos_id >= 0` is; `eos_id = -1`, the
  legacy rule, is `argmax`).
- Image channels. open_clip's `VisionTransformer` builds its patch convolution for 3 channels,
  whatever the config says (3.3.0: `in_channels=3`, no config field). A 1-channel model is written
  as the 3-channel model that gives the same embedding for an image repeated over 3 channels, which
  is what open_clip's preprocessing makes of a grayscale image: the kernel is split into (a, a, c)
  with a = w / 3 and c = w - 2a, whose sum a + a + c is w exactly (Sterbenz: w - 2a is exact), so
  our reader folds it back bit-identically. The channel count is recorded outside `model_cfg`
  (`"titan_contrastive": {"in_channels": 1}`: open_clip reads only `model_cfg` and `preprocess_cfg`
  and would reject an unknown `vision_cfg` key). Other channel counts have no open_clip equivalent.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from titan_contrastive.models.clip.args import CLIPArgs
from titan_contrastive.models.weights import WeightsError

CONFIG_FILE = "open_clip_config.json"
WEIGHT_FILES = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
OURS_KEY = "titan_contrastive"
"""Top-level `open_clip_config.json` entry for what open_clip's config cannot say (`in_channels`)."""
_RENAMES = [
    (r"\.resblocks\.", ".blocks."),
    (r"\.in_proj_weight$", ".in_proj.weight"),
    (r"\.in_proj_bias$", ".in_proj.bias"),
]
_TEXT_KEYS = ("token_embedding.", "positional_embedding", "transformer.", "ln_final.", "text_projection")
_PATCH = "visual.conv1.weight"
# options of open_clip's towers that change what they compute without changing the weights' keys
_UNSUPPORTED = {
    "text_cfg": {"no_causal_mask": False, "final_ln_after_pool": False, "embed_cls": False},
    "vision_cfg": {"pool_type": "tok", "final_ln_after_pool": False, "no_ln_pre": False},
}


def _layers(state: dict[str, Tensor], prefix: str) -> int:
    return len({int(m.group(1)) for k in state if (m := re.match(rf"{re.escape(prefix)}resblocks\.(\d+)\.", k))})


def _text_eos(text: dict[str, Any]) -> int:
    """`CLIPArgs.eos_id` of a `text_cfg`: -1 for open_clip's default `argmax` pooling, its `eos_id` for `eos`."""
    pool = text.get("pool_type", "argmax")
    if pool == "argmax":
        return -1
    if pool == "eos":
        return int(text.get("eos_id", 2))
    raise WeightsError(
        f"{CONFIG_FILE}: text_cfg pool_type={pool!r}; the clip family pools the text at its EOS token "
        "('eos') or at the highest id ('argmax')"
    )


def args_from_open_clip(config: dict[str, Any] | None, state: dict[str, Tensor]) -> CLIPArgs:
    """CLIPArgs from `open_clip_config.json`'s content (or None: from the open_clip state dict's shapes)."""
    if config is not None:
        cfg = config.get("model_cfg", config)
        vision, text = cfg["vision_cfg"], cfg["text_cfg"]
        if "hf_model_name" in text or vision.get("timm_model_name") or vision.get("attentional_pool"):
            raise WeightsError(
                f"{CONFIG_FILE}: a model with a custom tower (hf_model_name / timm_model_name / attentional_pool); "
                "the clip family builds only open_clip's own ViT + text transformer"
            )
        for section, defaults in _UNSUPPORTED.items():
            sub = cfg[section]
            changed = [f"{k}={sub[k]!r}" for k, d in defaults.items() if sub.get(k, d) != d]
            changed += [f"{k}={sub[k]!r}" for k in ("act_kwargs", "norm_kwargs") if sub.get(k)]
            if changed:
                raise WeightsError(
                    f"{CONFIG_FILE}: {section} sets {', '.join(changed)}; the clip family builds open_clip's "
                    "default ViT and causal text transformer only"
                )
        ratios = {vision.get("mlp_ratio", 4.0), text.get("mlp_ratio", 4.0)}
        if len(ratios) != 1:
            raise WeightsError(
                f"{CONFIG_FILE}: mlp_ratio {sorted(ratios)} differs between the towers; the clip family uses one"
            )
        width = vision["width"]
        return CLIPArgs(
            embed_dim=cfg["embed_dim"],
            image_size=vision["image_size"],
            patch_size=vision["patch_size"],
            in_channels=int(config.get(OURS_KEY, {}).get("in_channels", 3)),
            vision_width=width,
            vision_layers=vision["layers"],
            vision_heads=width // vision.get("head_width", 64),
            vocab_size=text.get("vocab_size", 49408),
            context_length=text.get("context_length", 77),
            text_width=text["width"],
            text_layers=text["layers"],
            text_heads=text.get("heads", 8),
            mlp_ratio=ratios.pop(),
            act="quick_gelu" if cfg.get("quick_gelu") else "gelu",
            eos_id=_text_eos(text),
        )
    conv = state[_PATCH]
    grid = round((state["visual.positional_embedding"].shape[0] - 1) ** 0.5)
    return CLIPArgs(
        embed_dim=state["text_projection"].shape[1],
        image_size=conv.shape[-1] * grid,
        patch_size=conv.shape[-1],
        in_channels=conv.shape[1],
        vision_width=conv.shape[0],
        vision_layers=_layers(state, "visual.transformer."),
        vision_heads=max(1, conv.shape[0] // 64),
        vocab_size=state["token_embedding.weight"].shape[0],
        context_length=state["positional_embedding"].shape[0],
        text_width=state["ln_final.weight"].shape[0],
        text_layers=_layers(state, "transformer."),
        text_heads=max(1, state["ln_final.weight"].shape[0] // 64),
        act="quick_gelu",
        eos_id=-1,
    )


def open_clip_config(args: CLIPArgs) -> dict[str, Any]:
    """`open_clip_config.json` content for a clip-family model (OpenAI's preprocessing)."""
    if args.init_logit_bias is not None:
        raise WeightsError(
            "the model has SigLIP's logit_bias: open_clip's CLIP has none (its SigLIP models use custom towers)"
        )
    if args.vision_width % args.vision_heads:
        raise WeightsError(f"vision_width {args.vision_width} is not a multiple of vision_heads {args.vision_heads}")
    if args.in_channels not in (1, 3):
        raise WeightsError(
            f"the model reads {args.in_channels}-channel images; open_clip's ViT reads 3 channels (1-channel "
            "models are written as their 3-channel equivalent), so this one has no open_clip form: export with --to hf"
        )
    pooling = {"pool_type": "argmax"} if args.eos_id < 0 else {"pool_type": "eos", "eos_id": args.eos_id}
    return {
        "model_cfg": {
            "embed_dim": args.embed_dim,
            "quick_gelu": args.act == "quick_gelu",
            "vision_cfg": {
                "image_size": args.image_size,
                "layers": args.vision_layers,
                "width": args.vision_width,
                "patch_size": args.patch_size,
                "head_width": args.vision_width // args.vision_heads,
                "mlp_ratio": args.mlp_ratio,
            },
            "text_cfg": {
                "context_length": args.context_length,
                "vocab_size": args.vocab_size,
                "width": args.text_width,
                "heads": args.text_heads,
                "layers": args.text_layers,
                "mlp_ratio": args.mlp_ratio,
                **pooling,
            },
        },
        "preprocess_cfg": {"mean": [0.48145466, 0.4578275, 0.40821073], "std": [0.26862954, 0.26130258, 0.27577711]},
        OURS_KEY: {"in_channels": args.in_channels},
    }


def from_open_clip_state_dict(state: dict[str, Tensor], in_channels: int = 3) -> dict[str, Tensor]:
    """open_clip's state dict -> ours (renames; the text tower under `text.`; attn_mask buffers dropped).
    `in_channels=1` (what `args_from_open_clip` read from the config) folds a 3-channel patch kernel
    written by `to_open_clip_state_dict(..., rgb=True)` back into the 1-channel one (module doc)."""
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
    conv = out.get(_PATCH)
    if in_channels == 1 and conv is not None and conv.shape[1] == 3:
        out[_PATCH] = (conv[:, 0:1] + conv[:, 1:2]) + conv[:, 2:3]
    return out


def to_open_clip_state_dict(ours: dict[str, Tensor], *, rgb: bool = False) -> dict[str, Tensor]:
    """Ours -> open_clip's (the inverse of `from_open_clip_state_dict`). `rgb`: a 1-channel patch
    kernel w becomes the 3-channel (a, a, c), a = w / 3, c = w - 2a, that open_clip's ViT can load."""
    out = {}
    for name, tensor in ours.items():
        key = name.removeprefix("text.")
        key = (
            key.replace(".blocks.", ".resblocks.")
            .replace(".in_proj.weight", ".in_proj_weight")
            .replace(".in_proj.bias", ".in_proj_bias")
        )
        out[key] = tensor.reshape(()) if name == "logit_scale" else tensor.contiguous()
    conv = out.get(_PATCH)
    if rgb and conv is not None and conv.shape[1] == 1:
        third = conv / 3
        out[_PATCH] = torch.cat([third, third, conv - 2 * third], dim=1).contiguous()
    return out
