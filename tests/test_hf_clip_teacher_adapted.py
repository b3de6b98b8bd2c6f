"""A Hugging Face CLIP or SigLIP taught by one of another tokenizer or other image statistics
(`models/hf_clip/teacher_inputs.py`), on tiny random folders: a SigLIP teaching a CLIP (tokenizer, statistics and
length differ), a CLIP teaching a SigLIP, MetaCLIP 2's vocabulary teaching a CLIP, a SigLIP of more positions teaching
a SigLIP. The held teacher's embeddings of a served batch equal transformers' own model given what its own processor
would give it: the run's pixels un-normalized and normalized by the teacher's statistics (float64), and the text the
run's ids hold tokenized by the teacher's tokenizer at its own length, padded to it (transformers' tokenizer call).
GradCache and global-negatives steps taught by it equal the dense objective with those embeddings, and
`embed_images` writes them."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.hf_folders import image_text_folder
from tests.needs import require
from tests.test_hard_negatives import assert_step_equals_its_forwards
from tests.test_hf_clip import _tensors, clip_run
from tests.test_hf_clip_teacher import BATCH, STEPS, teacher_folder
from titan_contrastive.losses import build_objective
from titan_contrastive.losses.guide import Guide

require("hf")

CASES = {  # (the run's kind, the teacher's kind, its text-config changes)
    "siglip-teaches-clip": ("clip", "siglip", {}),
    "clip-teaches-siglip": ("siglip", "clip", {}),
    "metaclip_2-teaches-clip": ("clip", "metaclip_2", {}),
    "longer-siglip-teaches-siglip": ("siglip", "siglip", {"max_position_embeddings": 16}),
}


def _teacher(tmp: Path, case: str) -> tuple[str, Path]:
    run, kind, text = CASES[case]
    return run, teacher_folder(tmp, kind, **text)


def own_inputs(trainer, teacher: Path, image: torch.Tensor, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the teacher's own processor gives for the served batch: float64 pixels normalized by its statistics,
    and its tokenizer's ids of the text the run's ids hold, padded to its positions."""
    from transformers import AutoConfig, AutoTokenizer

    run = trainer.model_args
    processor = json.loads((teacher / "preprocessor_config.json").read_text())
    mean, std = (
        torch.tensor(processor[key], dtype=torch.float64).view(1, 3, 1, 1) for key in ("image_mean", "image_std")
    )
    run_mean, run_std = (torch.tensor(v, dtype=torch.float64).view(1, 3, 1, 1) for v in (run.image_mean, run.image_std))
    pixels = (image.double() * run_std + run_mean - mean) / std
    mine, theirs = AutoTokenizer.from_pretrained(run.model_dir), AutoTokenizer.from_pretrained(teacher)
    captions = mine.batch_decode([[t for t in row if t != mine.pad_token_id] for row in text.tolist()], True)
    length = AutoConfig.from_pretrained(teacher).text_config.max_position_embeddings
    ids = theirs(captions, padding="max_length", max_length=length, truncation=True, return_tensors="pt").input_ids
    return pixels, ids


def teacher_guide(trainer, teacher: Path, batches: list[dict], check: bool = True) -> Guide:
    """transformers' teacher (float64, eval mode) on its own inputs of the batches; `check`: the run's held teacher
    gives the same embeddings of the batches as served (float64, 1e-10), and reading them unadapted would not."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(teacher).double().eval()
    images, texts = [], []
    for batch in batches:
        image, text = trainer.step_context.inputs(batch)
        pixels, ids = own_inputs(trainer, teacher, image, text)
        with torch.no_grad():
            images.append(F.normalize(model.get_image_features(pixel_values=pixels).pooler_output, dim=-1))
            texts.append(F.normalize(model.get_text_features(input_ids=ids).pooler_output, dim=-1))
            if check:
                held = trainer.step_context.guide(image, text)
                torch.testing.assert_close(held[0].double(), images[-1], rtol=0, atol=1e-10)
                torch.testing.assert_close(held[1].double(), texts[-1], rtol=0, atol=1e-10)
    return Guide(torch.cat(images), torch.cat(texts))


@pytest.mark.parametrize("case", CASES)
def test_the_teacher_reads_the_batch_as_its_processor_would(
    tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="titan_contrastive")
    run, teacher = _teacher(tmp_path, case)
    trainer = clip_run(tmp_path, run, *BATCH, "--loss.distill=kl", f"--loss.teacher_model={teacher}")
    batch = _tensors(trainer.train_set.__getitems__(list(range(6))))
    teacher_guide(trainer, teacher, [batch])
    image, text = trainer.step_context.inputs(batch)
    pixels, ids = own_inputs(trainer, teacher, image, text)
    reads = trainer.step_context.guide.reads
    renormalized, retokenized = reads.affine is not None, reads.target is not None
    assert renormalized == (case in ("siglip-teaches-clip", "clip-teaches-siglip")) and retokenized  # each case's
    assert renormalized == ((pixels - image.double()).abs().max() > 0.01)  # else the check above proves nothing
    assert ids.shape[1] != text.shape[1] or not torch.equal(ids, text)
    assert "the teacher reads the run's captions as text" in caplog.text
    trainer.metrics.close()


@pytest.mark.parametrize("step", STEPS)
def test_a_step_taught_by_another_kind_equals_the_dense_objective(tmp_path: Path, step: str) -> None:
    """A SigLIP teaching a CLIP, the KL both ways, attention dropout on."""
    local, ga, flags = STEPS[step]
    run, teacher = _teacher(tmp_path, "siglip-teaches-clip")
    trainer = clip_run(
        tmp_path,
        run,
        f"--training.local_batch_size={local}",
        f"--training.global_batch_size={local * ga}",
        "--loss.distill=kl",
        f"--loss.teacher_model={teacher}",
        "--loss.distill_temperature=0.2",
        "--loss.distill_symmetric=true",
        *flags,
    )
    data = trainer.train_set
    microbatches = [_tensors(data.__getitems__(list(range(j * local, (j + 1) * local)))) for j in range(ga)]
    pieces = trainer.step_context.split(microbatches[0], 3) if step == "gradcache" else microbatches
    guide = teacher_guide(trainer, teacher, microbatches, check=False)
    objective = build_objective(trainer.cfg.loss).with_teacher(guide)
    assert_step_equals_its_forwards(trainer, microbatches, pieces, seed=4, objective=objective)
    trainer.metrics.close()


def test_embed_images_writes_what_the_teacher_s_processor_gives(tmp_path: Path) -> None:
    """`embed_images` with a CLIP teaching a SigLIP: each image's and caption's row equals transformers' teacher on
    its own processor's inputs of the evaluation view."""
    import pyarrow.parquet as pq

    from titan_contrastive import embed_images

    run, teacher = _teacher(tmp_path, "clip-teaches-siglip")
    trainer = clip_run(tmp_path, run, *BATCH, "--loss.distill=kl", f"--loss.teacher_model={teacher}")
    out = tmp_path / "teacher.parquet"
    argv = ["--model.name=hf_clip", "--model.flavor=folder", f"--model.path={tmp_path / f'tiny-{run}'}"]
    argv += ["--data.dataset=csv", f"--data.path={tmp_path / 'data' / 'train.csv'}", "--data.image_size=0"]
    argv += ["--data.context_length=0", "--loss.distill=kl", f"--loss.teacher_model={teacher}", "--data.augment=false"]
    assert embed_images.main(["--out", str(out), "--batch-size", "5", *argv]) == 0
    rows = pq.read_table(out).to_pylist()
    fixed, keys, _ = trainer.train_set.fixed_view(list(range(6)))
    fixed = _tensors(fixed)
    fixed["text"] = trainer.train_set.encode_text(trainer.train_set.captions(range(6)))
    guide = teacher_guide(trainer, teacher, [fixed], check=False)
    written = {(r["side"], r["text"]): torch.tensor(r["embedding"], dtype=torch.float64) for r in rows}
    for i, (key, caption) in enumerate(zip(keys, trainer.train_set.captions(range(6)))):
        torch.testing.assert_close(written["image", key], guide.queries[i], rtol=0, atol=1e-6)  # float32, as stored
        torch.testing.assert_close(written["caption", caption], guide.columns[i], rtol=0, atol=1e-6)
    trainer.metrics.close()


def test_what_a_teacher_cannot_read_is_still_one_line(tmp_path: Path) -> None:
    """SigLIP 2's patches are read as served: a SigLIP 2 teacher of other image statistics is refused."""
    from titan_contrastive.config import ConfigError

    stats = teacher_folder(tmp_path, "siglip2", seed=1)
    config = json.loads((stats / "preprocessor_config.json").read_text())
    (stats / "preprocessor_config.json").write_text(json.dumps(dict(config, image_mean=[0.4] * 3)))
    image_text_folder(tmp_path, "siglip2")
    with pytest.raises(ConfigError, match=r"a SigLIP 2 teacher reads the run's patches as they are") as err:
        clip_run(tmp_path, "siglip2", *BATCH, "--loss.distill=kl", f"--loss.teacher_model={stats}")
    assert "\n" not in str(err.value)
