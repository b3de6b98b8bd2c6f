"""The clip family's checkpoints in and out: Hugging Face CLIP folders, open_clip and our own.

`read_checkpoint(path) -> (CLIPArgs, state dict)` detects the format:
- a Hugging Face transformers CLIP folder (`config.json` + `model.safetensors` or
  `pytorch_model.bin`): the architecture from its config, weights converted (`clip.hf`);
- an open_clip checkpoint: a state-dict file (`.safetensors`, `.bin`, `.pt`; an open_clip training
  checkpoint's `state_dict` too) or a folder holding `open_clip_model.safetensors`, with
  `open_clip_config.json` beside it when there is one (`clip.openclip`);
- one of our checkpoints (a `step-N` folder of DCP files with its `manifest.json`): the
  architecture from the manifest's `model` entry, the weights consolidated from however many
  FSDP shards wrote them (`models.weights.read_ours`: verified against its manifest, read without
  running code); a DCP folder without a manifest is refused.

`load_clip(path)` builds the model from that: `encode_image(pixel_values)` and
`encode_text(input_ids)` return L2-normalized embeddings. `[model] init_from` starts a training
run from the same weights.

Export (`ADAPTER.writes`): `hf`, what `transformers.CLIPModel.from_pretrained(DIR)` and
`CLIPTokenizerFast.from_pretrained(DIR)` load (config, safetensors, CLIP's BPE tokenizer files
built by transformers from the vocabulary this package ships, and for an RGB model the image
processor's `preprocessor_config.json`: the folder the hf_clip family fine-tunes); `open_clip`, the layout
`open_clip.create_model("local-dir:DIR")` reads. Each is loaded back (open_clip itself where it
imports, else this module's reader of its format) and its image and text embeddings on fixed
probes compared with the source's (`models.export_check`): random pixels and token rows laid out
as our tokenizers write them (BOS, ids, EOS, padding).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from titan_contrastive.losses.distill import log_teacher_temperature
from titan_contrastive.models.clip import openclip
from titan_contrastive.models.clip.args import CLIPArgs
from titan_contrastive.models.clip.hf import (
    args_from_hf_config,
    from_hf_state_dict,
    hf_config_from_args,
    to_hf_state_dict,
)
from titan_contrastive.models.clip.model import CLIP
from titan_contrastive.models.export_check import PROBE_TEXTS, compare, refuse, reloaded
from titan_contrastive.models.positions import fit_positions
from titan_contrastive.models.registry import StateDictAdapter
from titan_contrastive.models.weights import WeightsError, load_state, load_weights, read_json, read_ours

__all__ = ["ADAPTER", "detect_format", "load_clip", "probe_ids", "probe_images", "read_checkpoint", "read_guide"]


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
    raise WeightsError(
        f"{path}: not a checkpoint this project reads; give a Hugging Face CLIP folder (config.json + "
        "model.safetensors), an open_clip state dict (.safetensors/.bin/.pt, open_clip_config.json beside it) "
        "or a step-N folder of one of our runs (with manifest.json)"
    )


def _claims(path: Path) -> bool:
    try:
        return detect_format(path) != "ours"
    except WeightsError:
        return False


def _read_open_clip(path: Path) -> tuple[CLIPArgs, dict[str, Tensor]]:
    file = path if path.is_file() else next(path / f for f in openclip.WEIGHT_FILES if (path / f).is_file())
    weights = load_weights(file)
    config_file = file.parent / openclip.CONFIG_FILE
    config = read_json(config_file) if config_file.is_file() else None
    try:
        args = openclip.args_from_open_clip(config, weights)
    except KeyError as e:
        raise WeightsError(
            f"{file}: no {e} in the weights or {openclip.CONFIG_FILE}; not an open_clip CLIP checkpoint"
        ) from None
    return args, openclip.from_open_clip_state_dict(weights, args.in_channels)


def _read_hf(folder: Path) -> tuple[CLIPArgs, dict[str, Tensor]]:
    config = read_json(folder / "config.json")
    if config.get("model_type") not in (None, "clip"):
        raise WeightsError(
            f"{folder}/config.json: model_type={config.get('model_type')!r}; only CLIP models (model_type 'clip') load "
            "here"
        )
    args = args_from_hf_config(config)
    weights = load_weights(
        next(folder / f for f in ("model.safetensors", "pytorch_model.bin") if (folder / f).is_file())
    )
    return args, from_hf_state_dict(weights, args)


def _read_ours(folder: Path) -> tuple[CLIPArgs, dict[str, Tensor]]:
    family, args, model = read_ours(folder)
    if family != "clip":
        raise WeightsError(
            f"{folder}: a {family} checkpoint; this reads clip-family ones (export a bi_encoder with "
            "--to sentence-transformers)"
        )
    return args, model.state_dict()


def read_checkpoint(path: str | Path) -> tuple[CLIPArgs, dict[str, Tensor]]:
    """(architecture, our-layout state dict) of a checkpoint in any format `detect_format` knows."""
    folder = Path(path).expanduser()
    readers = {"hf": _read_hf, "open_clip": _read_open_clip, "ours": _read_ours}
    return readers[detect_format(folder)](folder)


def read_guide(run: CLIPArgs, path: str) -> tuple[CLIPArgs, dict[str, Tensor]]:
    """`ModelSpec.read_guide`: (args, weights) of a frozen guide or teacher (`[loss] guide_model` / `teacher_model`)
    from any checkpoint `[model] init_from` reads (a Hugging Face CLIP folder, an open_clip checkpoint, a step folder
    of a clip run): its own towers at the run's input sizes, so it reads the run's pixels and token ids, its position
    tables fitted as `init_from` fits them. A Hugging Face folder of another kind (SigLIP, MetaCLIP 2) or another
    vocabulary is the hf_clip family's model instead, reading the run's captions as text and its pixels normalized
    again (`hf_clip.guide.read_foreign`). A ValueError (one line) where it cannot read them."""
    if (foreign := _foreign(run, path)) is not None:
        return foreign, None
    theirs, state = read_checkpoint(path)
    for name, unit in (("vocab_size", "a vocabulary of"), ("in_channels", "images of")):
        if getattr(theirs, name) != getattr(run, name):
            raise ValueError(
                f"its {'text' if name == 'vocab_size' else 'image'} tower takes {unit} {getattr(theirs, name)} "
                f"and the run's data gives {getattr(run, name)}; a teacher reads the run's "
                f"{'token ids' if name == 'vocab_size' else 'pixels'}, so give one trained on the same "
                f"{'tokenizer (data.tokenizer)' if name == 'vocab_size' else 'kind of images'}"
            )
    if run.image_size % theirs.patch_size:
        raise ValueError(
            f"its patch size {theirs.patch_size} does not divide the run's {run.image_size} px images; give a "
            "teacher whose patch size divides data.image_size"
        )
    sized = dataclasses.replace(
        theirs,
        image_size=run.image_size,
        context_length=run.context_length,
        eos_id=run.eos_id,
        dropout=0.0,
        patch_dropout=0.0,
    )
    fitted = fit_positions(state, sized)
    if (scale := state.get("logit_scale")) is not None:
        log_teacher_temperature(path, float(scale))
    return sized, fitted


def _foreign(run: CLIPArgs, path: str) -> Any:
    """The hf_clip args of a Hugging Face teacher folder this family's towers cannot be: a MetaCLIP 2, SigLIP or
    SigLIP 2 folder, or a CLIP of another vocabulary than the run's; None for any other checkpoint (`read_checkpoint`
    reads it, or says why not)."""
    from titan_contrastive.datasets.image_transforms import OPENAI_MEAN, OPENAI_STD
    from titan_contrastive.datasets.tokenizer import ByteTokenizer
    from titan_contrastive.models.weights import read_json

    folder = Path(path).expanduser()
    if detect_format(folder) != "hf":
        return None
    from titan_contrastive.models.hf_clip.guide import read_foreign
    from titan_contrastive.models.hf_clip.model import KINDS

    config = read_json(folder / "config.json")
    vocab = (config.get("text_config") or {}).get("vocab_size", run.vocab_size)
    kind = config.get("model_type")
    if kind not in KINDS or (kind == "clip" and vocab == run.vocab_size):  # not one, or init_from reads it
        return None

    tokens = {ByteTokenizer.vocab_size: "byte", 49408: "clip_bpe"}.get(run.vocab_size)
    if tokens is None or run.in_channels != 3:
        has = f"ids of a {run.vocab_size}-token vocabulary" if tokens is None else f"{run.in_channels}-channel images"
        raise ValueError(
            f"a teacher of another kind reads the run's captions as text and its pixels as RGB, and the run serves "
            f"{has}; train on RGB images with data.tokenizer=byte or clip_bpe"
        )
    return read_foreign(str(folder), image_size=run.image_size, tokens=tokens, stats=(OPENAI_MEAN, OPENAI_STD))


def _built(args: CLIPArgs, state: dict[str, Tensor], source: str) -> CLIP:
    model = CLIP(dataclasses.replace(args, dropout=0.0))
    load_state(model, state, source)
    return model.eval()


def load_clip(path: str | Path) -> CLIP:
    """The clip model of a checkpoint (any format above), in eval mode on the CPU."""
    args, state = read_checkpoint(path)
    return _built(args, state, str(path))


# ------------------------------------------------------------------ export


def probe_images(args: CLIPArgs) -> Tensor:
    """Three fixed random images of the model's shape."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, args.in_channels, args.image_size, args.image_size, generator=g)


def probe_ids(args: CLIPArgs) -> Tensor:
    """Token rows laid out as our tokenizers write them: PROBE_TEXTS through the model's tokenizer
    when it is one of ours (byte: BOS 1, bytes + 3, EOS 2, PAD 0; CLIP BPE: 49406, ..., 49407, 0),
    then random ids with EOS at the second, middle and last position and 0-padding after it."""
    from titan_contrastive.datasets.tokenizer import ByteTokenizer

    length, vocab = args.context_length, args.vocab_size
    rows = []
    if vocab == ByteTokenizer.vocab_size and args.eos_id == ByteTokenizer.EOS and length >= 3:
        rows.append(ByteTokenizer(length).encode(PROBE_TEXTS))
    elif vocab == 49408 and args.eos_id in (-1, 49407):
        from titan_contrastive.datasets.clip_bpe import ClipBpeTokenizer

        rows.append(ClipBpeTokenizer(length).encode(PROBE_TEXTS))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (3, length), generator=g)
    for row, end in enumerate((min(1, length - 1), length // 2, length - 1)):
        ids[row, end] = args.eos_id if args.eos_id >= 0 else vocab - 1
        ids[row, end + 1 :] = 0
    return torch.cat([*rows, ids])


def _check(
    to: str, args: CLIPArgs, ours: CLIP, library: str, image: Callable[[Tensor], Any], text: Callable[[Tensor], Any]
) -> None:
    images, ids = probe_images(args), probe_ids(args)
    with torch.no_grad():
        compare(to, "image", ours.encode_image(images), image(images), library)
        compare(to, "text", ours.encode_text(ids), text(ids), library)


def write_hf_tokenizer(out: Path, context_length: int) -> None:
    """CLIP's BPE as transformers' CLIPTokenizerFast files (vocab.json + merges.txt -> its converter)."""
    from transformers import CLIPTokenizerFast

    from titan_contrastive.datasets.clip_bpe import vocab_and_merges

    vocab, merges = vocab_and_merges()
    ids = {t: i for i, t in enumerate(vocab)}
    CLIPTokenizerFast(vocab=ids, merges=merges, model_max_length=context_length).save_pretrained(str(out))


def write_hf_image_processor(out: Path, args: CLIPArgs) -> None:
    """`preprocessor_config.json`: CLIP's resize and centre crop to the model's size, and OpenAI's mean and std,
    which image files are normalized with here (a run on the bundled sets has the byte tokenizer: not exported)."""
    from transformers.models.clip import CLIPImageProcessorPil

    from titan_contrastive.datasets.image_transforms import OPENAI_MEAN, OPENAI_STD

    size = args.image_size
    processor = CLIPImageProcessorPil(
        size={"shortest_edge": size},
        crop_size={"height": size, "width": size},
        image_mean=list(OPENAI_MEAN),
        image_std=list(OPENAI_STD),
    )
    processor.save_pretrained(str(out))


def write_open_clip(src: str, out: Path, tower: str = "") -> None:
    """`src` as open_clip's folder layout, checked with open_clip (or, where it does not import, our reader)."""
    from safetensors.torch import save_file

    args, state = read_checkpoint(src)
    (out / openclip.CONFIG_FILE).write_text(json.dumps(openclip.open_clip_config(args), indent=1))
    save_file(openclip.to_open_clip_state_dict(state, rgb=True), str(out / openclip.WEIGHT_FILES[0]))
    ours = _built(args, state, src)
    try:
        import open_clip
    except Exception:  # noqa: BLE001 - not installed, or its torchvision does not import: our reader of its format
        theirs = reloaded("this project's open_clip reader", lambda: load_clip(out))
        _check("open_clip", args, ours, "this project's open_clip reader", theirs.encode_image, theirs.encode_text)
        return
    # the model, not transforms
    model = reloaded("open_clip", lambda: open_clip.create_model(f"local-dir:{out}", device="cpu").eval())
    # a grayscale image as open_clip's RGB
    rgb = (lambda x: x.expand(-1, 3, -1, -1)) if args.in_channels == 1 else (lambda x: x)
    _check(
        "open_clip",
        args,
        ours,
        "open_clip",
        lambda x: model.encode_image(rgb(x), normalize=True),
        lambda ids: model.encode_text(ids, normalize=True),
    )


def write_hf(src: str, out: Path, tower: str = "") -> None:
    """`src` as a transformers CLIPModel folder (with CLIP's tokenizer where the vocabulary is CLIP's)."""
    from transformers import CLIPModel

    args, state = read_checkpoint(src)
    model = CLIPModel(hf_config_from_args(args))
    # position_ids buffers are the model's own
    result = model.load_state_dict(to_hf_state_dict(state, args), strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("position_ids")]
    if missing or result.unexpected_keys:
        refuse(f"{src}: transformers' CLIPModel lacks {result.unexpected_keys[:3]} and wants {missing[:3]}")
    model.save_pretrained(str(out), safe_serialization=True)
    if args.vocab_size == 49408:  # CLIP's vocabulary: ship its tokenizer (the byte tokenizer has no HF equivalent)
        write_hf_tokenizer(out, args.context_length)
    if args.in_channels == 3:
        write_hf_image_processor(out, args)
    theirs = reloaded("transformers", lambda: CLIPModel.from_pretrained(str(out)).eval())

    def features(output: Any) -> Tensor:
        return F.normalize(getattr(output, "pooler_output", output), dim=-1)

    _check(
        "hf",
        args,
        _built(args, state, src),
        "transformers",
        lambda x: features(theirs.get_image_features(pixel_values=x)),
        lambda ids: features(theirs.get_text_features(input_ids=ids)),
    )


ADAPTER = StateDictAdapter(
    read=read_checkpoint, claims=_claims, fit=fit_positions, writes={"hf": write_hf, "open_clip": write_open_clip}
)
