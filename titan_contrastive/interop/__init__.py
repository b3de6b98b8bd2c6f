"""Checkpoints in and out of the clip family: Hugging Face CLIP folders and this project's own.

`read_checkpoint(path) -> (CLIPArgs, state dict)` detects the format:
- a Hugging Face transformers CLIP folder (`config.json` + `model.safetensors` or
  `pytorch_model.bin`): the architecture from its config, weights converted (`hf_clip`);
- an open_clip checkpoint: a state-dict file (`.safetensors`, `.bin`, `.pt`; an open_clip training
  checkpoint's `state_dict` too) or a folder holding `open_clip_model.safetensors`, with
  `open_clip_config.json` beside it when there is one (`openclip`);
- one of our checkpoints (a `step-N` folder of DCP files with its `manifest.json`): the
  architecture from the manifest's `model` entry, the weights consolidated from however many
  FSDP shards wrote them (DCP reads them into one plain state dict, no process group needed).

`load_clip(path)` builds the model from that: `encode_image(pixel_values)` and
`encode_text(input_ids)` return L2-normalized embeddings. `[model] init_from` starts a training
run from the same weights.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from titan_contrastive.interop import openclip
from titan_contrastive.interop.hf_clip import InteropError, args_from_hf_config, from_hf_state_dict
from titan_contrastive.models.clip.args import CLIPArgs
from titan_contrastive.models.clip.model import CLIP

__all__ = ["InteropError", "detect_format", "load_clip", "load_state", "read_checkpoint", "read_ours"]


def detect_format(path: str | Path) -> str:
    """`hf`, `open_clip` or `ours`; anything else is a one-line error naming what was expected."""
    folder = Path(path).expanduser()
    if folder.is_file() and folder.suffix in (".safetensors", ".bin", ".pt", ".pth"):
        return "open_clip"
    if any((folder / f).is_file() for f in openclip.WEIGHT_FILES):
        return "open_clip"
    if (folder / "config.json").is_file() and any((folder / f).is_file() for f in ("model.safetensors", "pytorch_model.bin")):
        return "hf"
    if (folder / "manifest.json").is_file():
        return "ours"
    raise InteropError(f"{path}: not a checkpoint this project reads; give a Hugging Face CLIP folder (config.json + "
                       "model.safetensors), an open_clip state dict (.safetensors/.bin/.pt, open_clip_config.json beside it) "
                       "or a step-N folder of one of our runs (with manifest.json)")


def _load_weights(file: Path) -> dict[str, Tensor]:
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(file))
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a TorchScript archive (OpenAI's own .pt) or a damaged file
        raise InteropError(f"{file}: not a state dict ({type(e).__name__}); OpenAI's TorchScript .pt files are not read: "
                           "use open_clip's or Hugging Face's conversion of them") from None
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    return {k.removeprefix("module."): v for k, v in state.items()}


def _read_open_clip(path: Path) -> tuple[CLIPArgs, dict[str, Tensor]]:
    file = path if path.is_file() else next(path / f for f in openclip.WEIGHT_FILES if (path / f).is_file())
    weights = _load_weights(file)
    config_file = file.parent / openclip.CONFIG_FILE
    config = json.loads(config_file.read_text()) if config_file.is_file() else None
    try:
        args = openclip.args_from_open_clip(config, weights)
    except KeyError as e:
        raise InteropError(f"{file}: no {e} in the weights or {openclip.CONFIG_FILE}; not an open_clip CLIP checkpoint") from None
    return args, openclip.from_open_clip_state_dict(weights)


def _read_hf(folder: Path) -> tuple[CLIPArgs, dict[str, Tensor]]:
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") not in (None, "clip"):
        raise InteropError(f"{folder}/config.json: model_type={config.get('model_type')!r}; only CLIP models (model_type 'clip') load here")
    args = args_from_hf_config(config)
    weights = _load_weights(next(folder / f for f in ("model.safetensors", "pytorch_model.bin") if (folder / f).is_file()))
    return args, from_hf_state_dict(weights, args)


def read_ours(folder: Path) -> tuple[str, Any, torch.nn.Module]:
    """(family, args, model) of one of our step folders, any family: the manifest names the family
    and its args; DCP consolidates the FSDP shards straight into the built model's tensors."""
    import torch.distributed.checkpoint as dcp

    from titan_contrastive.models import get_model_spec

    manifest = json.loads((folder / "manifest.json").read_text())
    model = manifest.get("model")
    if not model:
        raise InteropError(f"{folder}/manifest.json names no model (written before 2026-11-24); rebuild it with the run's "
                           "config instead, or save it again with this version")
    spec = get_model_spec(model["family"])
    args = dataclasses.replace(next(iter(spec.flavors.values())), **model["args"])
    built = spec.build_model(args)
    dcp.load({"model": built.state_dict()}, checkpoint_id=str(folder))  # in place: state_dict() holds the parameters themselves
    return model["family"], args, built


def _read_ours(folder: Path) -> tuple[CLIPArgs, dict[str, Tensor]]:
    family, args, model = read_ours(folder)
    if family != "clip":
        raise InteropError(f"{folder}: a {family} checkpoint; this reads clip-family ones (export a bi_encoder with "
                           "--to sentence-transformers)")
    return args, model.state_dict()


def read_checkpoint(path: str | Path) -> tuple[CLIPArgs, dict[str, Tensor]]:
    """(architecture, our-layout state dict) of a checkpoint in any format `detect_format` knows."""
    folder = Path(path).expanduser()
    readers = {"hf": _read_hf, "open_clip": _read_open_clip, "ours": _read_ours}
    return readers[detect_format(folder)](folder)


def load_state(model: torch.nn.Module, state: dict[str, Tensor], source: str) -> None:
    """`model.load_state_dict(state)` with a one-line error naming the first mismatched keys."""
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    shapes = [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in sorted(set(own) & set(state))
              if state[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        raise InteropError(f"{source}: missing {missing[:3]}, unexpected {unexpected[:3]}, mis-shaped {shapes[:3]}; the model "
                           "built from the config does not match the checkpoint: set data.image_size, data.context_length "
                           "and data.tokenizer to the checkpoint's (or leave model.init_from empty)")
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(state[name])


def load_clip(path: str | Path) -> CLIP:
    """The clip model of a checkpoint (any format above), in eval mode on the CPU."""
    args, state = read_checkpoint(path)
    model = CLIP(dataclasses.replace(args, dropout=0.0))
    load_state(model, state, str(path))
    return model.eval()
