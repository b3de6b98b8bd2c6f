"""A frozen guide or teacher of a qwen_vl run (`[loss] guide_model` / `teacher_model`): another Qwen-VL embedder
folder (a larger one of its family: a 7B teaching a 2B) that reads the run's batches as they are served. It must share
the run's tokenizer (its vocabulary and image token) and image processing (patch, merge and temporal patch sizes,
mean and std), so its visual tokens and ids are the run's; it embeds one vector per text, pooled as the run pools,
without adapters. A ColQwen folder (a token projection) is refused, as a ColQwen run refuses any
(`bi_encoder.colbert.refuse_for_colbert`). What it cannot read is refused in one line, naming what differs."""

from __future__ import annotations

import dataclasses

from titan_contrastive.config import ConfigError
from titan_contrastive.models.bi_encoder.folder import load_config, read_text_folder
from titan_contrastive.models.qwen_vl import colpali
from titan_contrastive.models.qwen_vl.model import QwenVLArgs
from titan_contrastive.models.qwen_vl.processor import VLProcessor

__all__ = ["read_guide"]

IMAGE_SETTINGS = ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std")
"""The image processor's settings a frozen model must share with the run to read its visual tokens."""


def _readings(processor: VLProcessor) -> dict[str, object]:
    """What a frozen model must share with the run to read its batches: its processor's tokenizer and image settings."""
    images = {name.replace("_", " "): getattr(processor.images, name) for name in IMAGE_SETTINGS}
    return {"vocabulary": processor.tokenizer.get_vocab(), "image token": processor.image_token_id, **images}


def read_guide(run: QwenVLArgs, path: str) -> tuple[QwenVLArgs, None]:
    """`ModelSpec.read_guide`: the args of the frozen model at `path` for a run of `run`'s args (its build reads the
    folder); a ConfigError for a folder that cannot read the run's batches."""
    model_dir = read_text_folder(path).model_dir
    if colpali.read_projection(model_dir):
        raise ConfigError(
            f"a ColQwen folder ({colpali.PROJECTION}: token vectors); a guide or teacher embeds one vector per text: "
            "give a Qwen-VL embedder folder"
        )
    mine = VLProcessor(run.path, run.min_pixels, run.max_pixels, run.text_length)
    ours, theirs = _readings(mine), _readings(VLProcessor(model_dir, run.min_pixels, run.max_pixels, run.text_length))
    differ = [name for name in ours if ours[name] != theirs[name]]
    if getattr(load_config(model_dir), "image_token_id", mine.image_token_id) != mine.image_token_id:
        differ.append("config image_token_id")
    if differ:
        raise ConfigError(
            f"its tokenizer or image processor differs from the run's ({', '.join(differ)}); a teacher reads the run's "
            "token ids and visual tokens: give one of the run's family (the same tokenizer and image processor)"
        )
    lora = {field.name: field.default for field in dataclasses.fields(run) if field.name.startswith("lora_")}
    frozen = {"learn_logit_scale": False, "init_logit_bias": None}  # it embeds: no temperature trains, no bias
    return dataclasses.replace(run, path=model_dir, colbert_dim=0, **frozen, **lora), None
