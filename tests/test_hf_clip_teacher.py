"""A Hugging Face CLIP, SigLIP or SigLIP 2 taught by a frozen one of its kind (`[loss] teacher_model` on hf_clip):
tiny random folders, the teacher wider, sharing the student's tokenizer and processor. GradCache chunks that
divide nothing and streamed global negatives (attention dropout on, the KL both ways) equal the dense objective with
the teacher's cosines of the whole batch, the teacher run by transformers' own `get_*_features` (float64); a
teacher that cannot read the run's images is one line naming what differs (one of another tokenizer or other image
statistics: tests/test_hf_clip_teacher_adapted.py)."""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.hf_folders import encoder_folder, image_text_folder
from tests.needs import require
from tests.test_hard_negatives import assert_step_equals_its_forwards
from tests.test_hf_clip import _double, _tensors, clip_run
from titan_contrastive.batching import FROZEN_QUERIES
from titan_contrastive.config import ConfigError
from titan_contrastive.losses import build_objective
from titan_contrastive.losses.guide import Guide

require("hf")

STEPS = {
    "gradcache": (7, 1, ["--gradcache.enabled=true", "--gradcache.chunk_sizes=3"]),
    "global": (3, 2, ["--loss.negatives=global", "--loss.stream_chunk_size=5"]),
}

BATCH = ("--training.local_batch_size=6", "--training.global_batch_size=6")


def teacher_folder(tmp: Path, kind: str, seed: int = 7, **text: int) -> Path:
    """The student's folder with a wider model (24, not 16) of the same kind in it, its tokenizer and processor kept;
    `text`: other text-config values."""
    from transformers import AutoConfig, AutoModel

    folder = tmp / f"teacher-{kind}-{seed}"
    shutil.copytree(image_text_folder(tmp, kind), folder)
    config = AutoConfig.from_pretrained(folder)
    for tower in (config.text_config, config.vision_config):
        tower.hidden_size, tower.intermediate_size = 24, 40
    if hasattr(config.text_config, "projection_size"):  # SigLIP's text head: to the image tower's width
        config.text_config.projection_size = 24
    for key, value in text.items():
        setattr(config.text_config, key, value)
    torch.manual_seed(seed)
    model = AutoModel.from_config(config)
    if hasattr(model, "logit_bias"):
        with torch.no_grad():
            model.logit_scale.fill_(2.0)
    model.save_pretrained(folder)
    return folder


def teacher_guide(trainer, folder: Path, batches: list[dict]) -> Guide:
    """The teacher's unit embeddings of the batches, by transformers' own model in float64, eval mode. SigLIP 2's
    images: by the run's frozen model instead, within 1e-6 of transformers', which resizes its position table to
    each grid in float32."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder).double().eval()
    images, texts, held = [], [], []
    for batch in batches:
        image, text = trainer.step_context.inputs(batch)
        pixels = _double(image) if isinstance(image, dict) else {"pixel_values": image.double()}
        with torch.no_grad():
            images.append(model.get_image_features(**pixels).pooler_output)
            texts.append(model.get_text_features(input_ids=text).pooler_output)
            held.append(trainer.step_context.guide(image, text)[0])
    images, texts = F.normalize(torch.cat(images), dim=-1), F.normalize(torch.cat(texts), dim=-1)
    if isinstance(image, dict):
        assert (torch.cat(held) - images).abs().max() <= 1e-6
        images = torch.cat(held)
    return Guide(images, texts)


@pytest.mark.parametrize("kind", ["clip", "siglip", "siglip2"])
@pytest.mark.parametrize("step", STEPS)
def test_an_hf_clip_teacher_in_each_step_kind_equals_the_dense_objective(
    tmp_path: Path, kind: str, step: str, caplog: pytest.LogCaptureFixture
) -> None:
    local, ga, flags = STEPS[step]
    caplog.set_level(logging.INFO, logger="titan_contrastive")
    teacher = teacher_folder(tmp_path, kind)
    trainer = clip_run(
        tmp_path,
        kind,
        f"--training.local_batch_size={local}",
        f"--training.global_batch_size={local * ga}",
        "--loss.distill=kl",
        f"--loss.teacher_model={teacher}",
        "--loss.distill_temperature=0.2",
        "--loss.distill_symmetric=true",
        *flags,
        *(["--loss.name=siglip"] if kind != "clip" else []),
    )
    if kind != "clip":  # the SigLIP teachers' logit_scale, 2.0 (`teacher_folder`)
        assert f"{teacher}: the teacher's own temperature is {math.exp(-2.0):.4g}" in caplog.text
    data = trainer.train_set
    microbatches = [_tensors(data.__getitems__(list(range(j * local, (j + 1) * local)))) for j in range(ga)]
    pieces = trainer.step_context.split(microbatches[0], 3) if step == "gradcache" else microbatches
    guide = teacher_guide(trainer, teacher, microbatches)
    held = trainer.step_context.guide
    assert not held.training and held.visual.transformer.config.hidden_size == 24
    assert_step_equals_its_forwards(
        trainer, microbatches, pieces, seed=4, objective=build_objective(trainer.cfg.loss).with_teacher(guide)
    )
    trainer.metrics.close()


def test_a_teacher_that_cannot_read_the_run_s_inputs_is_one_line(tmp_path: Path) -> None:
    """One of another tokenizer or other image statistics reads the run's batches adapted
    (tests/test_hf_clip_teacher_adapted.py); one of another way of cutting images, or not a CLIP, is refused."""
    siglip2 = image_text_folder(tmp_path, "siglip2")
    with pytest.raises(
        ConfigError, match=r"^loss.teacher_model='.*': it reads patches \(model_type siglip2\) and the"
    ) as err:
        clip_run(tmp_path, "clip", *BATCH, "--loss.distill=kl", f"--loss.teacher_model={siglip2}")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"loss.guide_model=.* holds a 'bert' model; hf_clip trains"):
        clip_run(tmp_path, "clip", *BATCH, "--loss.mask_margin=0", f"--loss.guide_model={encoder_folder(tmp_path)}")


@pytest.mark.parametrize(("kind", "views"), [("clip", 0), ("siglip2", 0), ("siglip2", 2)])
def test_an_hf_clip_teacher_written_ahead_teaches_as_the_running_one(tmp_path: Path, kind: str, views: int) -> None:
    """`embed_images` on the run's own config (whole images; SigLIP 2's patches), then a GradCache step taught from
    the file and one taught by the running teacher on the file's batch (the evaluation view; or with `views`, train
    crops of the file's views), each at the teacher's own temperature (`distill_temperature = 0`: from the folder, or
    kept in the file): the loss and every gradient agree to float32's precision."""
    from transformers import AutoModel

    from tests.test_trainer import assert_close, grads
    from titan_contrastive import embed_images

    teacher = teacher_folder(tmp_path, kind)
    own = AutoModel.from_pretrained(teacher).logit_scale.item()
    flags = [*STEPS["gradcache"][2], "--training.local_batch_size=7", f"--data.augment={bool(views)}"]
    flags += ["--loss.distill=kl"]
    flags += ["--loss.distill_temperature=0", "--loss.distill_symmetric=true"]  # the teacher's own, either way
    flags += ["--loss.name=siglip"] if kind != "clip" else []
    clip_run(tmp_path, kind, *flags, f"--loss.teacher_model={teacher}").metrics.close()  # writes the folder and data
    out = tmp_path / "teacher.parquet"
    run = ["--model.name=hf_clip", "--model.flavor=folder", f"--model.path={tmp_path / f'tiny-{kind}'}"]
    run += ["--data.dataset=csv", f"--data.path={tmp_path / 'data' / 'train.csv'}", "--data.image_size=0"]
    run += ["--data.context_length=0", "--loss.distill=kl", f"--loss.teacher_model={teacher}"]
    run += [f"--data.augment={bool(views)}", f"--views={views}"]
    assert embed_images.main(["--out", str(out), *run]) == 0
    trainers = [
        clip_run(tmp_path, kind, *flags, source)
        for source in (f"--loss.teacher_model={teacher}", f"--loss.teacher_embeddings={out}")
    ]
    assert trainers[1].train_set.views == views
    trainers[1].train_set.set_epoch(1)  # a view's crop is the image's, whichever epoch serves it
    batch = _tensors(trainers[1].train_set.__getitems__(list(range(7))))
    if views:  # the file's vector of each image: the teacher's of the crop served, not of the evaluation view
        held = trainers[0].step_context.guide
        dtype = next(held.parameters()).dtype

        def embedded(images) -> torch.Tensor:
            images = {k: v.to(dtype) if v.is_floating_point() else v for k, v in images.items()}
            with torch.no_grad():
                return held(images, batch["text"])[0].double()

        served = embedded(batch["image"])
        torch.testing.assert_close(batch[FROZEN_QUERIES].double(), served, rtol=1e-5, atol=1e-6)
        fixed = embedded(_tensors(trainers[1].train_set.fixed_view(range(7))[0])["image"])
        assert ((served - fixed).abs().amax(1) > 1e-3).sum() >= 5
    outs = []
    for trainer, fed in zip(trainers, ({k: v for k, v in batch.items() if not k.startswith("frozen")}, batch)):
        assert trainer.objective.distillation.temperature == pytest.approx(math.exp(-own), rel=1e-6)
        torch.manual_seed(4)
        outs.append((trainer.train_step([fed])["loss"], grads(trainer.model)))
        trainer.metrics.close()
    (model_loss, model_grads), (file_loss, file_grads) = outs
    assert abs(file_loss - model_loss) <= 1e-5 * abs(model_loss)
    keys = [name for name in model_grads if name.endswith("k_proj.bias")]  # no effect on a softmax: zero up to rounding
    assert keys and all(file_grads[k].abs().max() < 1e-12 and model_grads[k].abs().max() < 1e-12 for k in keys)
    assert_close(*({k: v for k, v in g.items() if k not in keys} for g in (file_grads, model_grads)), rel=1e-5)
