"""A CLIP of the clip family taught by a Hugging Face folder of another kind (`[loss] teacher_model` = a SigLIP or
MetaCLIP 2 folder; `hf_clip.guide.read_foreign`): the teacher is the hf_clip family's model, reading the run's byte
or CLIP BPE ids as text through its own tokenizer and the run's pixels (OpenAI's statistics) normalized again to its
own. On a CSV of RGB pictures at 32 px (the teachers' 16 px positions resized): the held teacher equals transformers'
model on what its own processor gives (float64: 1e-10 for the captions, 1e-6 for the images, whose positions
transformers resizes in float32), a GradCache step equals the dense objective with those embeddings, and what it
cannot read is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.hf_folders import image_text_folder
from tests.needs import require
from tests.test_hard_negatives import assert_step_equals_its_forwards
from tests.test_image_teacher_ahead import write_csv_data
from tests.test_trainer import make_trainer
from titan_contrastive.config import ConfigError
from titan_contrastive.datasets.image_transforms import OPENAI_MEAN, OPENAI_STD
from titan_contrastive.datasets.tokenizer import ByteTokenizer
from titan_contrastive.losses import build_objective
from titan_contrastive.losses.guide import Guide
from titan_contrastive.models.hf_clip import HFClip

require("hf")


def _run(tmp: Path, teacher: Path, *extra: str):
    data = [f for f in write_csv_data(tmp) if not f.startswith(("--data.csv_negative_keys", "--data.image_size"))]
    flags = ["--data.image_size=32", "--loss.distill=kl", "--loss.distill_temperature=0.2", "--loss.symmetric=true"]
    return make_trainer(str(tmp / "run"), *data, *flags, f"--loss.teacher_model={teacher}", *extra)


def own_guide(trainer, teacher: Path, batch: dict) -> Guide:
    """transformers' teacher (float64, eval mode, its positions interpolated to the run's 32 px) on what its processor
    gives for the batch: the pixels
    un-normalized from OpenAI's statistics and normalized by its own, the captions' text through its tokenizer."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    image, text = trainer.step_context.inputs(batch)
    processor = json.loads((teacher / "preprocessor_config.json").read_text())
    mean, std = (torch.tensor(processor[k], dtype=torch.float64).view(1, 3, 1, 1) for k in ("image_mean", "image_std"))
    run_mean, run_std = (torch.tensor(v, dtype=torch.float64).view(1, 3, 1, 1) for v in (OPENAI_MEAN, OPENAI_STD))
    pixels = (image.double() * run_std + run_mean - mean) / std
    length = AutoConfig.from_pretrained(teacher).text_config.max_position_embeddings
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    captions = ByteTokenizer().decode(text)
    ids = tokenizer(captions, padding="max_length", max_length=length, truncation=True, return_tensors="pt").input_ids
    model = AutoModel.from_pretrained(teacher).double().eval()
    with torch.no_grad():
        images = model.get_image_features(pixel_values=pixels, interpolate_pos_encoding=True).pooler_output
        images = F.normalize(images, dim=-1)
        texts = F.normalize(model.get_text_features(input_ids=ids).pooler_output, dim=-1)
    return Guide(images, texts)


@pytest.mark.parametrize("kind", ["siglip", "metaclip_2"])
def test_a_hugging_face_teacher_of_another_kind_teaches_a_clip(tmp_path: Path, kind: str) -> None:
    teacher = image_text_folder(tmp_path, kind)
    if kind == "metaclip_2":  # OpenAI's statistics, as MetaCLIP 2's: its pixels are the run's
        processor = json.loads((teacher / "preprocessor_config.json").read_text())
        stats = {"image_mean": list(OPENAI_MEAN), "image_std": list(OPENAI_STD)}
        (teacher / "preprocessor_config.json").write_text(json.dumps(processor | stats))
    trainer = _run(tmp_path, teacher, "--gradcache.enabled=true", "--gradcache.chunk_sizes=3")
    held = trainer.step_context.guide
    assert isinstance(held, HFClip) and held.reads.target is not None
    assert (held.reads.affine is not None) == (kind == "siglip")
    batch = trainer.train_set.__getitems__(list(range(7)))
    guide = own_guide(trainer, teacher, batch)
    with torch.no_grad():
        got = held(*trainer.step_context.inputs(batch))
    assert (got[0].double() - guide.queries).abs().max() <= 1e-6  # transformers resizes its float32 table
    torch.testing.assert_close(got[1].double(), guide.columns, rtol=0, atol=1e-10)
    guide = Guide(got[0].double(), guide.columns)  # the images' targets by the run's teacher, as for SigLIP 2's
    pieces = trainer.step_context.split(batch, 3)
    objective = build_objective(trainer.cfg.loss).with_teacher(guide)
    assert_step_equals_its_forwards(trainer, [batch], pieces, seed=4, objective=objective)
    trainer.metrics.close()


def test_what_it_cannot_read_is_one_line(tmp_path: Path) -> None:
    siglip2 = image_text_folder(tmp_path, "siglip2")
    with pytest.raises(ConfigError, match=r"^loss.teacher_model='.*': it reads patches \(model_type siglip2\)") as err:
        _run(tmp_path, siglip2)
    assert "\n" not in str(err.value)
    siglip = image_text_folder(tmp_path, "siglip")
    (tmp_path / "odd").mkdir()
    data = write_csv_data(tmp_path / "odd")  # 28 px images
    with pytest.raises(ConfigError, match=r"data.image_size=28: .* reads images in 8 px patches") as err:
        make_trainer(str(tmp_path / "odd" / "run"), *data, "--loss.distill=kl", f"--loss.teacher_model={siglip}")
    assert "\n" not in str(err.value)
