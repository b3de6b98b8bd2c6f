"""The hf_clip family's export (`python -m titan_contrastive.export STEP --to hf`) and its state-dict adapter.

`hf`: the run's model as the transformers folder it came from (`CLIPModel` / `SiglipModel` / `Siglip2Model`,
`AutoModel.from_pretrained(DIR)`), with LoRA the adapters merged into the weights, with the folder's
tokenizer and `preprocessor_config.json` (and `processor_config.json`, where it has one). The folder is
loaded back and must give the run's image and text embeddings of probe images and captions
(`models.export_check`).
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titan_contrastive.datasets.image_transforms import Normalize
from titan_contrastive.models.export_check import PROBE_TEXTS, compare, refuse, reloaded
from titan_contrastive.models.hf_clip.model import KINDS, HFClip, HFClipArgs, build_tokenizer, load_hf_model
from titan_contrastive.models.registry import StateDictAdapter
from titan_contrastive.models.weights import read_ours

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


def _probe(args: HFClipArgs) -> tuple[Tensor, Tensor]:
    """(images, token ids): random pictures normalized as the run's data, `PROBE_TEXTS` as the run tokenizes them."""
    pixels = np.random.default_rng(0).integers(0, 256, (3, args.image_size, args.image_size, 3), dtype=np.uint8)
    return Normalize(args.image_mean, args.image_std)(pixels), build_tokenizer(args).encode(PROBE_TEXTS)


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
    theirs.load_state_dict(_renamed(plain.state_dict(), hf_names(kind)), strict=True)
    theirs.save_pretrained(str(out))
    build_tokenizer(args).pair.hf.save_pretrained(str(out))
    for name in ("preprocessor_config.json", "processor_config.json"):
        if (Path(args.model_dir) / name).is_file():
            shutil.copy(Path(args.model_dir) / name, out / name)
    from transformers import AutoModel

    back = reloaded("transformers", lambda: AutoModel.from_pretrained(str(out)).eval())
    images, ids = _probe(args)
    with torch.no_grad():
        want = model(images, ids)
        got = (
            _features(back.get_image_features(**model.image_inputs(images))),
            _features(back.get_text_features(input_ids=ids)),
        )
    for what, mine, their in zip(("image", "text"), want, got):
        compare("hf", what, mine, their, "transformers")


ADAPTER = StateDictAdapter(writes={"hf": write})
