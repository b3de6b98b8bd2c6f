"""A frozen guide or teacher of an hf_clip run (`[loss] guide_model` / `teacher_model`): another Hugging Face CLIP,
MetaCLIP 2, SigLIP or SigLIP 2 folder that embeds each batch as it is served. It must cut images the run's way (whole
images, or SigLIP 2's patches of the run's size); its position table is resized to the run's image size as
`[data] image_size` resizes the model's. One of another tokenizer (a SigLIP teaching a CLIP, MetaCLIP 2's multilingual
vocabulary) reads the run's captions as text through its own tokenizer, at its own length; one of other image
statistics reads the run's pixels normalized again to its own (`teacher_inputs.py`). What it cannot read is refused in
one line, naming what differs."""

from __future__ import annotations

import dataclasses
import logging

from titan_contrastive.config import ConfigError
from titan_contrastive.losses.distill import log_teacher_temperature
from titan_contrastive.models.bi_encoder.folder import load_tokenizer
from titan_contrastive.models.hf_clip.model import (
    LAST_POSITION,
    HFClipArgs,
    _image_size,
    _processor,
    _statistics,
    folder_kind,
    folder_scalar,
)
from titan_contrastive.models.positions import unstretchable

__all__ = ["read_foreign", "read_guide"]

logger = logging.getLogger("titan_contrastive")


def read_guide(run: HFClipArgs, path: str) -> tuple[HFClipArgs, None]:
    """`ModelSpec.read_guide`: the args of the frozen model at `path` for a run of `run`'s args (no adapters, no patch
    dropout, its own scale and bias; its build reads the folder); a ConfigError for one that cannot read the run's
    inputs."""
    kind, model_dir, config = folder_kind(path)
    processor, file = _processor(model_dir)
    naflex = kind == "siglip2"
    if naflex != bool(run.max_num_patches):
        mine, theirs = ("SigLIP 2's patches", "whole images") if run.max_num_patches else ("whole images", "patches")
        raise ConfigError(
            f"it reads {theirs} (model_type {kind}) and the run serves {mine}; give a teacher of the run's kind "
            "(SigLIP 2 for SigLIP 2, CLIP or SigLIP otherwise)"
        )
    size, patch = run.image_size, int(config.vision_config.patch_size)
    if naflex and patch != run.patch_size:
        raise ConfigError(f"its patches are {patch} px and the run's {run.patch_size}; give one with the run's patches")
    if not naflex:
        size, patch = _image_size(path, kind, config, processor, file, run.image_size)[:2]
    stats = _statistics(processor, file)
    renormalized = stats != (run.image_mean, run.image_std)
    if renormalized and naflex:
        raise ConfigError(
            f"its processor normalizes images by mean {list(stats[0])} and std {list(stats[1])}, the run's by "
            f"{list(run.image_mean)} and {list(run.image_std)}; a SigLIP 2 teacher reads the run's patches as they "
            "are: give one with the same image statistics"
        )
    if renormalized:
        logger.info(
            f"the teacher reads the run's pixels normalized again to its own statistics (mean {list(stats[0])}, std "
            f"{list(stats[1])}; the run's mean {list(run.image_mean)}, std {list(run.image_std)})"
        )
    positions = int(config.text_config.max_position_embeddings)
    length, retokenized = _length(run, model_dir, kind, positions)
    guide = dataclasses.replace(
        run,
        path=path,
        context_length=length,
        image_size=size,
        patch_size=patch,
        whole_image=kind == "siglip",
        image_mean=stats[0],
        image_std=stats[1],
        init_logit_scale=None,
        init_logit_bias=None,
        patch_dropout=0.0,
        retokenize_from=run.model_dir if retokenized else "",
        pixels_from=(run.image_mean, run.image_std) if renormalized else (),
        **{field.name: field.default for field in dataclasses.fields(run) if field.name.startswith("lora_")},
    )
    if (scale := folder_scalar(model_dir, "logit_scale")) is not None:
        log_teacher_temperature(path, scale)
    return guide, None


def _length(run: HFClipArgs, model_dir: str, kind: str, positions: int) -> tuple[int, bool]:
    """(the teacher's caption length, whether it reads the run's captions as text): the run's ids as they are where it
    shares the run's tokenizer and can read them at the run's length (a CLIP's positions stretched as Long-CLIP
    stretches them); else its own tokenizer's ids at its own length (SigLIP: exactly its positions)."""
    mine, theirs = load_tokenizer(run.model_dir), load_tokenizer(model_dir)
    reads = {
        "vocabulary": lambda t: t.get_vocab(),
        "pad token": lambda t: t.pad_token_id,
        "padding side": lambda t: t.padding_side,
    }
    differ = [name for name, get in reads.items() if get(mine) != get(theirs)]
    if differ:
        why = f"its tokenizer differs from the run's ({', '.join(differ)})"
    elif kind in LAST_POSITION and positions != run.context_length:
        why = f"it pools the last of exactly {positions} tokens and the run's captions are {run.context_length}"
    elif run.context_length > positions and (unstretched := unstretchable(positions)):
        why = f"the run's captions are {run.context_length} tokens and its {unstretched}"
    else:
        return run.context_length, False
    logger.info(f"the teacher reads the run's captions as text: {why}; its own tokenizer cuts them to {positions}")
    return positions, True


def read_foreign(path: str, *, image_size: int, tokens: str, stats: tuple[tuple[float, ...], ...]) -> HFClipArgs:
    """The args of a frozen CLIP, MetaCLIP 2 or SigLIP folder teaching a run of another family (the clip family's
    `read_guide`) at the run's `image_size`: it reads the run's captions as text (`tokens`: the run's tokenizer, one
    of `teacher_inputs.OURS`) at its own length, and the run's pixels, normalized by `stats` (mean, std), normalized
    again to its own. A ConfigError for one that cannot read them (SigLIP 2's patches; a patch that does not divide
    the images)."""
    kind, model_dir, config = folder_kind(path)
    if kind == "siglip2":
        raise ConfigError(
            "it reads patches (model_type siglip2) and the run serves whole images; give a CLIP, MetaCLIP 2 or SigLIP "
            "folder, or train the hf_clip family on a SigLIP 2 folder"
        )
    processor, file = _processor(model_dir)
    size, patch = _image_size(path, kind, config, processor, file, image_size)[:2]
    own = _statistics(processor, file)
    positions = int(config.text_config.max_position_embeddings)
    logger.info(
        f"the teacher reads the run's captions as text ({tokens} ids); its own tokenizer cuts them to {positions}"
    )
    if own != tuple(stats):
        logger.info(f"the teacher reads the run's pixels normalized again to its own statistics (mean {list(own[0])})")
    if (scale := folder_scalar(model_dir, "logit_scale")) is not None:
        log_teacher_temperature(path, scale)
    return HFClipArgs(
        path=path,
        context_length=positions,
        image_size=size,
        patch_size=patch,
        whole_image=kind == "siglip",
        image_mean=own[0],
        image_std=own[1],
        retokenize_from=tokens,
        pixels_from=tuple(stats) if own != tuple(stats) else (),
    )
