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
  It is read as a resume reads it (`checkpoint.reader`): verified against its manifest (sizes,
  SHA-256) and unpickled without running code; a DCP folder without a manifest is refused.

Nothing read here runs code: safetensors files hold none, `.bin`/`.pt` files load with
`torch.load(weights_only=True)`, configs are JSON. A damaged file (empty, truncated, not the
format its name says) is a one-line error naming it, and so are integer tensors where the
weights are floating point (they would otherwise be cast to float without a word).

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
    if (folder / "config.json").is_file() and any(
        (folder / f).is_file() for f in ("model.safetensors", "pytorch_model.bin")
    ):
        return "hf"
    # without a manifest: refused by read_ours
    if (folder / "manifest.json").is_file() or (folder / ".metadata").is_file():
        return "ours"
    raise InteropError(
        f"{path}: not a checkpoint this project reads; give a Hugging Face CLIP folder (config.json + "
        "model.safetensors), an open_clip state dict (.safetensors/.bin/.pt, open_clip_config.json beside it) "
        "or a step-N folder of one of our runs (with manifest.json)"
    )


def _read_json(file: Path) -> dict[str, Any]:
    try:
        config = json.loads(file.read_text())
    except ValueError as e:  # not JSON, or not UTF-8
        raise InteropError(f"{file}: not a readable JSON file ({' '.join(str(e).split())})") from None
    if not isinstance(config, dict):
        raise InteropError(f"{file}: holds a JSON {type(config).__name__}, not an object")
    return config


def _floating_only(state: dict[str, Tensor], file: Path) -> dict[str, Tensor]:
    """`state`, unless a weight is not floating point (HF's integer `position_ids` buffers aside): loading
    it would cast it to float without a word."""
    wrong = [
        f"{k} is {v.dtype}" for k, v in state.items() if not v.is_floating_point() and not k.endswith("position_ids")
    ]
    if wrong:
        raise InteropError(
            f"{file}: {', '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}; the weights of a CLIP model are "
            "floating point, these are not: a damaged, quantized or foreign checkpoint"
        )
    return state


def _load_weights(file: Path) -> dict[str, Tensor]:
    if file.stat().st_size == 0:
        raise InteropError(f"{file}: an empty file (0 bytes); download or export it again")
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            weights = load_file(str(file))
        except Exception as e:  # noqa: BLE001 - safetensors' own error type: a truncated or damaged file
            raise InteropError(
                f"{file}: not a readable safetensors file ({' '.join(str(e).split())}); it is damaged or "
                "truncated: download or export it again"
            ) from None
        return _floating_only(weights, file)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a TorchScript archive (OpenAI's own .pt) or a damaged file
        raise InteropError(
            f"{file}: not a state dict ({type(e).__name__}); OpenAI's TorchScript .pt files are not read: "
            "use open_clip's or Hugging Face's conversion of them"
        ) from None
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise InteropError(f"{file}: holds a {type(state).__name__} that is not a state dict of tensors")
    return _floating_only({k.removeprefix("module."): v for k, v in state.items()}, file)


def _read_open_clip(path: Path) -> tuple[CLIPArgs, dict[str, Tensor]]:
    file = path if path.is_file() else next(path / f for f in openclip.WEIGHT_FILES if (path / f).is_file())
    weights = _load_weights(file)
    config_file = file.parent / openclip.CONFIG_FILE
    config = _read_json(config_file) if config_file.is_file() else None
    try:
        args = openclip.args_from_open_clip(config, weights)
    except KeyError as e:
        raise InteropError(
            f"{file}: no {e} in the weights or {openclip.CONFIG_FILE}; not an open_clip CLIP checkpoint"
        ) from None
    return args, openclip.from_open_clip_state_dict(weights, args.in_channels)


def _read_hf(folder: Path) -> tuple[CLIPArgs, dict[str, Tensor]]:
    config = _read_json(folder / "config.json")
    if config.get("model_type") not in (None, "clip"):
        raise InteropError(
            f"{folder}/config.json: model_type={config.get('model_type')!r}; only CLIP models (model_type 'clip') load "
            "here"
        )
    args = args_from_hf_config(config)
    weights = _load_weights(
        next(folder / f for f in ("model.safetensors", "pytorch_model.bin") if (folder / f).is_file())
    )
    return args, from_hf_state_dict(weights, args)


def read_ours(folder: Path) -> tuple[str, Any, torch.nn.Module]:
    """(family, args, model) of one of our step folders, any family: the manifest names the family
    and its args; DCP consolidates the FSDP shards straight into the built model's tensors.
    Through `checkpoint.reader`: verified against the manifest first, read without running code."""
    from titan_contrastive.checkpoint import reader
    from titan_contrastive.models import get_model_spec

    folder = Path(folder).expanduser()
    try:
        manifest = reader.verify(folder)
    except reader.CheckpointError as e:
        raise InteropError(str(e)) from None
    model = manifest.get("model")
    if not model:
        raise InteropError(
            f"{folder}/manifest.json names no model (written by an older version); rebuild it with the run's "
            "config instead, or save it again with this version"
        )
    try:
        spec = get_model_spec(model["family"])
        args = dataclasses.replace(next(iter(spec.flavors.values())), **model["args"])
    except (KeyError, TypeError) as e:  # a manifest of another version, or edited
        raise InteropError(
            f"{folder}/manifest.json: its model entry does not describe a model this version builds "
            f"({type(e).__name__}: {e})"
        ) from None
    built = spec.build_model(args)
    state = built.state_dict()
    if manifest.get("config", {}).get("lora", {}).get("enable"):  # it holds what trained (checkpoint.stateful)
        from titan_contrastive.checkpoint.stateful import without_frozen

        state = without_frozen(built, state)
    try:  # in place: state_dict() holds the parameters themselves
        reader.load({"model": state}, folder, manifest, what=f"reading checkpoint {folder}")
    except reader.CheckpointError as e:
        raise InteropError(str(e)) from None
    return model["family"], args, built


def _read_ours(folder: Path) -> tuple[CLIPArgs, dict[str, Tensor]]:
    family, args, model = read_ours(folder)
    if family != "clip":
        raise InteropError(
            f"{folder}: a {family} checkpoint; this reads clip-family ones (export a bi_encoder with "
            "--to sentence-transformers)"
        )
    return args, model.state_dict()


def read_checkpoint(path: str | Path) -> tuple[CLIPArgs, dict[str, Tensor]]:
    """(architecture, our-layout state dict) of a checkpoint in any format `detect_format` knows."""
    folder = Path(path).expanduser()
    readers = {"hf": _read_hf, "open_clip": _read_open_clip, "ours": _read_ours}
    return readers[detect_format(folder)](folder)


def load_state(model: torch.nn.Module, state: dict[str, Tensor], source: str) -> None:
    """`model.load_state_dict(state)` with a one-line error naming the first mismatched keys (or integer
    tensors for floating-point weights)."""
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
        for k in sorted(set(own) & set(state))
        if state[k].shape != own[k].shape
    ]
    if missing or unexpected or shapes:
        raise InteropError(
            f"{source}: missing {missing[:3]}, unexpected {unexpected[:3]}, mis-shaped {shapes[:3]}; the model "
            "built from the config does not match the checkpoint: set data.image_size, data.context_length "
            "and data.tokenizer to the checkpoint's (or leave model.init_from empty)"
        )
    not_float = [
        f"{k} is {state[k].dtype}"
        for k in sorted(own)
        if own[k].is_floating_point() and not state[k].is_floating_point()
    ]
    if not_float:  # copy_ would cast them to float without a word
        raise InteropError(
            f"{source}: {', '.join(not_float[:3])}, where the model has floating-point weights: a damaged, "
            "quantized or foreign checkpoint"
        )
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(state[name])


def load_clip(path: str | Path) -> CLIP:
    """The clip model of a checkpoint (any format above), in eval mode on the CPU."""
    args, state = read_checkpoint(path)
    model = CLIP(dataclasses.replace(args, dropout=0.0))
    load_state(model, state, str(path))
    return model.eval()
