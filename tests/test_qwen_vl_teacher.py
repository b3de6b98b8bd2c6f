"""A Qwen-VL embedder taught by a larger one (`[loss] teacher_model` on qwen_vl): the tiny random Qwen2-VL student on
the bundled emoji at mixed sizes, a teacher four times as wide and twice as deep with the same tokenizer and image
processor. GradCache chunks that divide nothing and streamed global negatives (dropout on, the KL both ways) equal the
dense objective with the held teacher's embeddings of each whole microbatch (float64, 1e-10), the student with LoRA
too; the held teacher is the folder's model, frozen, without the run's adapters; a teacher that cannot read the run's
batches, a ColQwen folder, or one for a ColQwen run, is one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.hf_folders import WORDS
from tests.needs import require
from tests.test_hard_negatives import assert_step_equals_its_forwards
from tests.test_qwen_vl import LORA, _embeddings, vl_run
from titan_contrastive.config import ConfigError
from titan_contrastive.losses import build_objective
from titan_contrastive.losses.guide import Guide

require("hf")

STEPS = {
    "gradcache-lora": (6, 1, ["--gradcache.enabled=true", "--gradcache.chunk_sizes=4", *LORA]),
    "global": (3, 2, ["--loss.negatives=global", "--loss.stream_chunk_size=5"]),
}
TAUGHT = ("--loss.distill=kl", "--loss.distill_temperature=0.1", "--loss.distill_symmetric=true")


def teacher_folder(tmp: Path, arch: str = "qwen2_vl") -> Path:
    from titan_contrastive.models.qwen_vl.random_folder import write_random_folder

    torch.manual_seed(5)
    return write_random_folder(tmp / f"teacher-{arch}", arch, "small", 0.0, WORDS)


@pytest.mark.parametrize("step", STEPS)
def test_a_qwen_vl_teacher_in_each_step_kind_equals_the_dense_objective(tmp_path: Path, step: str) -> None:
    local, ga, flags = STEPS[step]
    teacher = teacher_folder(tmp_path)
    trainer = vl_run(
        tmp_path,
        "qwen2_vl",
        f"--training.local_batch_size={local}",
        f"--training.global_batch_size={local * ga}",
        f"--loss.teacher_model={teacher}",
        *TAUGHT,
        *flags,
    )
    held = trainer.step_context.guide
    assert not held.training and not any(p.requires_grad for p in held.parameters())
    assert held.tower.config.get_text_config().hidden_size == 128 and held.args.lora_rank == 0

    def get(indices: range) -> dict:
        return {k: v for k, v in trainer.train_set.__getitems__(list(indices)).items() if isinstance(v, torch.Tensor)}

    microbatches = [get(range(j * local, (j + 1) * local)) for j in range(ga)]
    pieces = trainer.step_context.split(microbatches[0], 4) if step.startswith("gradcache") else microbatches
    with torch.no_grad():
        taught = [_embeddings(held, batch) for batch in microbatches]
    guide = Guide(torch.cat([q for q, _ in taught]), torch.cat([d for _, d in taught]))
    objective = build_objective(trainer.cfg.loss).with_teacher(guide)
    assert_step_equals_its_forwards(trainer, microbatches, pieces, seed=4, objective=objective)
    trainer.metrics.close()


def test_what_cannot_be_taught_is_one_line(tmp_path: Path) -> None:
    other = teacher_folder(tmp_path, "qwen3_vl")  # 16 px patches, the student's are 14
    differs = r"^loss.teacher_model='.*': its tokenizer or image processor differs from the run's \(patch size"
    with pytest.raises(ConfigError, match=differs) as err:
        vl_run(tmp_path, "qwen2_vl", f"--loss.teacher_model={other}", *TAUGHT)
    assert "\n" not in str(err.value)
    teacher = teacher_folder(tmp_path)
    colqwen = tmp_path / "colqwen"  # the teacher with a token projection beside it, as colpali-engine saves one
    shutil.copytree(teacher, colqwen)
    save_file({"custom_text_proj.weight": torch.zeros(8, 128)}, colqwen / "projection.safetensors")
    with pytest.raises(ConfigError, match=r"loss.teacher_model='.*': a ColQwen folder \(custom_text_proj"):
        vl_run(tmp_path, "qwen2_vl", f"--loss.teacher_model={colqwen}", *TAUGHT)
    colbert = r"loss.teacher_model=.*: model.pooling='colbert' embeds a text as its tokens"
    with pytest.raises(ConfigError, match=colbert):
        vl_run(tmp_path, "qwen2_vl", "--model.pooling=colbert", f"--loss.teacher_model={teacher}", *TAUGHT)


def test_a_frozen_model_for_a_sigmoid_run_holds_no_bias(tmp_path: Path) -> None:
    """The run learns b (the sigmoid loss); its teacher or guide, built from the run's args, embeds and holds none."""
    from titan_contrastive.models.qwen_vl.guide import read_guide

    trainer = vl_run(tmp_path, "qwen2_vl", "--loss.name=siglip")
    assert trainer.model.logit_bias.item() == -10.0 and trainer.model_args.init_logit_bias == -10.0
    frozen, _ = read_guide(trainer.model_args, str(teacher_folder(tmp_path)))
    assert frozen.init_logit_bias is None and not frozen.learn_logit_scale
    trainer.metrics.close()
