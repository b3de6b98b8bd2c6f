"""The hf_clip family's export (`python -m titan_contrastive.export STEP --to hf`) and its state-dict adapter.

`hf`: the run's model as the transformers folder it came from (`CLIPModel` / `MetaClip2Model` / `SiglipModel` /
`Siglip2Model`, `AutoModel.from_pretrained(DIR)`), with LoRA the adapters merged into the weights, at the run's
image size (its position table and config), with the folder's tokenizer and `preprocessor_config.json` (the run's
image size; SigLIP 2: the run's `max_num_patches`; and `processor_config.json`, where it has one). A SigLIP or
SigLIP 2 folder is also a sentence-transformers model whose processing is the run's (`processing_kwargs`): ids
padded to the run's length with no attention mask, SigLIP 2's patch budget; sentence-transformers' defaults (padding
to the longest caption, a mask; `Siglip2Processor`'s 256 patches of 16 px) would change the embeddings. The folder
is loaded back and must give the run's image and text embeddings of probe images and captions
(`models.export_check`), through sentence-transformers too.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titan_contrastive.datasets.image_transforms import Normalize
from titan_contrastive.models.export_check import PROBE_TEXTS, compare, refuse, reloaded
from titan_contrastive.models.hf_clip.model import (
    KINDS,
    LAST_POSITION,
    HFClip,
    HFClipArgs,
    build_tokenizer,
    load_hf_model,
    resize_vision_positions,
    stretch_text_positions,
)
from titan_contrastive.models.registry import StateDictAdapter
from titan_contrastive.models.weights import read_json, read_ours

__all__ = ["ADAPTER", "hf_names", "merged"]


def merged(model: HFClip) -> HFClip:
    """A copy of `model` with each LoRA layer merged into its base layer and replaced by it."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    plain = copy.deepcopy(model)
    for name, module in list(plain.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(plain.get_submodule(parent), child, module.get_base_layer())
    return plain


def hf_names(model_type: str) -> dict[str, str]:
    """Our parameter-name prefixes -> the transformers model's."""
    image_proj, text_proj = KINDS[model_type]
    names = {"visual.transformer.": "vision_model.", "text.transformer.": "text_model."}
    if image_proj:
        names |= {"visual.projection.": f"{image_proj}.", "text.projection.": f"{text_proj}."}
    return names


def _renamed(state: dict[str, Tensor], names: dict[str, str]) -> dict[str, Tensor]:
    out = {}
    for key, value in state.items():
        prefix = next((p for p in names if key.startswith(p)), "")
        out[names[prefix] + key[len(prefix) :] if prefix else key] = value
    return out


def _probe(args: HFClipArgs) -> tuple[np.ndarray, Tensor, Tensor]:
    """(pictures, images, token ids): random uint8 pictures at the run's size, normalized as the run's data;
    `PROBE_TEXTS` as the run tokenizes them."""
    pixels = np.random.default_rng(0).integers(0, 256, (3, args.image_size, args.image_size, 3), dtype=np.uint8)
    return pixels, Normalize(args.image_mean, args.image_std)(pixels), build_tokenizer(args).encode(PROBE_TEXTS)


def _processing(args: HFClipArgs) -> dict[str, dict]:
    """sentence-transformers' `processing_kwargs` that make its processor call the run's data."""
    text = {"padding": "max_length", "max_length": args.context_length, "return_attention_mask": False}
    image = {"max_num_patches": args.max_num_patches, "patch_size": args.patch_size} if args.max_num_patches else {}
    return {"text": text, "image": image} if image else {"text": text}


def _copy_processor(model_dir: str, out: Path, args: HFClipArgs, own_size: int) -> None:
    """The folder's `preprocessor_config.json` (and `processor_config.json`, where it has one) into `out`, with the
    image processor's `max_num_patches` (SigLIP 2) or `size` and `crop_size` (CLIP, SigLIP at another size than the
    folder's `own_size`) set to the run's (`data.image_size`)."""
    resized = not args.max_num_patches and args.image_size != own_size
    for name in ("preprocessor_config.json", "processor_config.json"):
        source = Path(model_dir) / name
        if not source.is_file():
            continue
        if not (args.max_num_patches or resized):
            shutil.copy(source, out / name)
            continue
        config = read_json(source)
        for part in (config, config.get("image_processor")):
            if not isinstance(part, dict):
                continue
            if args.max_num_patches and "max_num_patches" in part:
                part["max_num_patches"] = args.max_num_patches
            for key in ("size", "crop_size") if resized else ():
                if isinstance(part.get(key), int):
                    part[key] = args.image_size
                elif isinstance(part.get(key), dict):  # shortest_edge, or height and width
                    part[key] = dict.fromkeys(part[key], args.image_size)
        (out / name).write_text(json.dumps(config, indent=2) + "\n")


def _write_sentence_transformers(out: Path, args: HFClipArgs) -> None:
    """Add sentence-transformers' files to the transformers folder `out` (its own save, no model card)."""
    from sentence_transformers import SentenceTransformer

    model = reloaded("sentence-transformers", lambda: SentenceTransformer(str(out), device="cpu"))
    model[0].processing_kwargs = _processing(args)
    model.save(str(out), create_model_card=False)


def _features(out: object) -> Tensor:
    return F.normalize(out if isinstance(out, Tensor) else out.pooler_output, dim=-1)


def write(src: str, out: Path, tower_name: str = "") -> None:
    """Write the hf_clip step folder `src` as a transformers folder into `out`, then load it back and compare."""
    family, args, model = read_ours(Path(src).expanduser())
    if family != "hf_clip":
        refuse(f"{src}: a {family} checkpoint; --to hf exports the hf_clip family here")
    model.eval()
    plain = merged(model) if args.lora_rank else model
    theirs: nn.Module = load_hf_model(args.model_dir).eval()
    kind = theirs.config.model_type
    if hasattr(plain, "logit_bias") and not hasattr(theirs, "logit_bias"):
        refuse(
            f"--to hf: the run learnt a logit bias (the sigmoid loss), which a transformers {type(theirs).__name__} "
            "cannot hold; nothing was written"
        )
    own_size = 0 if args.max_num_patches else theirs.config.vision_config.image_size
    if own_size:  # the run's image size (its position table and config)
        resize_vision_positions(theirs.vision_model, args.image_size)
    stretch_text_positions(theirs.text_model, args.context_length)
    theirs.load_state_dict(_renamed(plain.state_dict(), hf_names(kind)), strict=True)
    theirs.save_pretrained(str(out))
    build_tokenizer(args).pair.hf.save_pretrained(str(out))
    tokenizer_config = out / "tokenizer_config.json"  # the run's caption length (shorter, or stretched)
    tokenizer_config.write_text(json.dumps(read_json(tokenizer_config) | {"model_max_length": args.context_length}))
    _copy_processor(args.model_dir, out, args, own_size)
    if kind in LAST_POSITION:
        _write_sentence_transformers(out, args)
    from transformers import AutoModel

    back = reloaded("transformers", lambda: AutoModel.from_pretrained(str(out)).eval())
    pixels, images, ids = _probe(args)
    with torch.no_grad():
        want = model(images, ids)
        got = (
            _features(back.get_image_features(**model.image_inputs(images))),
            _features(back.get_text_features(input_ids=ids)),
        )
    for what, mine, their in zip(("image", "text"), want, got):
        compare("hf", what, mine, their, "transformers")
    if kind in LAST_POSITION:
        _check_sentence_transformers(out, pixels, want)


def _check_sentence_transformers(out: Path, pixels: np.ndarray, want: tuple[Tensor, ...]) -> None:
    """sentence-transformers embeds the probe pictures and captions as the run does."""
    from PIL import Image
    from sentence_transformers import SentenceTransformer

    st = reloaded("sentence-transformers", lambda: SentenceTransformer(str(out), device="cpu"))
    inputs = ([Image.fromarray(p) for p in pixels], list(PROBE_TEXTS))
    for what, mine, batch in zip(("image", "text"), want, inputs):
        their = st.encode(batch, convert_to_tensor=True, normalize_embeddings=True)
        compare("hf", what, mine, their, "sentence-transformers")


ADAPTER = StateDictAdapter(writes={"hf": write})
