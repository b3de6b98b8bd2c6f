"""Weights in and out of the model families, whatever the family: the one error for a checkpoint
that cannot be read or written as asked, weight files read without running code, a state dict
loaded into a built model with one-line errors, and our own step folders (`read_ours`).

Nothing read here runs code: safetensors files hold none, `.bin`/`.pt` files load with
`torch.load(weights_only=True)`, configs are JSON. A damaged file (empty, truncated, not the
format its name says) is a one-line error naming it, and so are integer tensors where the
weights are floating point (they would otherwise be cast to float without a word). A family's
formats (its `StateDictAdapter`: clip's Hugging Face and open_clip conversions, the bi_encoder's
sentence-transformers / transformers / PEFT folders) are built on these.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from titan_contrastive.checkpoint import reader
from titan_contrastive.checkpoint.stateful import without_frozen
from titan_contrastive.models.registry import get_model_spec

__all__ = ["WeightsError", "load_state", "load_weights", "read_json", "read_ours"]


class WeightsError(ValueError):
    """A checkpoint that cannot be read or written as asked; one line naming the key and the fix."""


def read_json(file: Path) -> dict[str, Any]:
    """A JSON object from `file`, or a one-line WeightsError."""
    try:
        config = json.loads(file.read_text())
    except ValueError as e:  # not JSON, or not UTF-8
        raise WeightsError(f"{file}: not a readable JSON file ({' '.join(str(e).split())})") from None
    if not isinstance(config, dict):
        raise WeightsError(f"{file}: holds a JSON {type(config).__name__}, not an object")
    return config


def _floating_only(state: dict[str, Tensor], file: Path) -> dict[str, Tensor]:
    """`state`, unless a weight is not floating point (HF's integer `position_ids` buffers aside): loading
    it would cast it to float without a word."""
    wrong = [
        f"{k} is {v.dtype}" for k, v in state.items() if not v.is_floating_point() and not k.endswith("position_ids")
    ]
    if wrong:
        raise WeightsError(
            f"{file}: {', '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}; a model's weights are "
            "floating point, these are not: a damaged, quantized or foreign checkpoint"
        )
    return state


def load_weights(file: Path) -> dict[str, Tensor]:
    """The floating-point state dict in a `.safetensors`, `.bin` or `.pt` file (an open_clip training
    checkpoint's `state_dict` entry too; a DDP `module.` prefix removed), read without running code."""
    if file.stat().st_size == 0:
        raise WeightsError(f"{file}: an empty file (0 bytes); download or export it again")
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            weights = load_file(str(file))
        except Exception as e:  # noqa: BLE001 - safetensors' own error type: a truncated or damaged file
            raise WeightsError(
                f"{file}: not a readable safetensors file ({' '.join(str(e).split())}); it is damaged or "
                "truncated: download or export it again"
            ) from None
        return _floating_only(weights, file)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a TorchScript archive (OpenAI's own .pt) or a damaged file
        raise WeightsError(
            f"{file}: not a state dict ({type(e).__name__}); OpenAI's TorchScript .pt files are not read: "
            "use open_clip's or Hugging Face's conversion of them"
        ) from None
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise WeightsError(f"{file}: holds a {type(state).__name__} that is not a state dict of tensors")
    return _floating_only({k.removeprefix("module."): v for k, v in state.items()}, file)


def read_ours(folder: Path) -> tuple[str, Any, torch.nn.Module]:
    """(family, args, model) of one of our step folders, any family: the manifest names the family
    and its args; DCP consolidates the FSDP shards straight into the built model's tensors.
    Through `checkpoint.reader`: verified against the manifest first, read without running code."""
    folder = Path(folder).expanduser()
    try:
        manifest = reader.verify(folder)
    except reader.CheckpointError as e:
        raise WeightsError(str(e)) from None
    model = manifest.get("model")
    if not model:
        raise WeightsError(
            f"{folder}/manifest.json names no model (written by an older version); rebuild it with the run's "
            "config instead, or save it again with this version"
        )
    try:
        spec = get_model_spec(model["family"])
        args = dataclasses.replace(next(iter(spec.flavors.values())), **model["args"])
    except (KeyError, TypeError) as e:  # a manifest of another version, or edited
        raise WeightsError(
            f"{folder}/manifest.json: its model entry does not describe a model this version builds "
            f"({type(e).__name__}: {e})"
        ) from None
    built = spec.build_model(args)
    state = built.state_dict()
    if manifest.get("config", {}).get("lora", {}).get("enable"):  # it holds what trained (checkpoint.stateful)
        state = without_frozen(built, state)
    try:  # in place: state_dict() holds the parameters themselves
        reader.load({"model": state}, folder, manifest, what=f"reading checkpoint {folder}")
    except reader.CheckpointError as e:
        raise WeightsError(str(e)) from None
    return model["family"], args, built


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
        raise WeightsError(
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
        raise WeightsError(
            f"{source}: {', '.join(not_float[:3])}, where the model has floating-point weights: a damaged, "
            "quantized or foreign checkpoint"
        )
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(state[name])
