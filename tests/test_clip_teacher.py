"""A CLIP taught by a frozen CLIP (`[loss] teacher_model` on the clip family, as open_clip's `--distill-model`):
the teacher read from any checkpoint `init_from` reads, at the run's input sizes. Every step kind's loss and
parameter gradients equal the dense objective over the whole batch with the teacher's cosines of it, the teacher
built independently by `load_clip` (float64, residual and patch dropout on, chunks that divide nothing, 1, 2 and 4
gloo processes); the sum equals open_clip's `DistillClipLoss` but for the teacher's entropy, with the same
gradients; the teacher is the model `init_from` would start from; a guide's cosines decide the masks (GISTEmbed); what
it cannot read is one line."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.test_export import BYTE, step_folder
from tests.test_hard_negatives import assert_step_equals_its_forwards
from tests.test_siglip import open_clip_loss_module
from tests.test_trainer import REL, assert_close, full, grads, make_trainer
from titan_contrastive.config import ConfigError
from titan_contrastive.losses import build_objective
from titan_contrastive.losses.guide import Guide
from titan_contrastive.models.clip import clip_flavors, load_clip
from titan_contrastive.models.clip.state_dict_adapter import write_open_clip

# Another architecture than the student's debug flavor (width, depth, embedding size, a 7 px patch grid), reading
# the same 28 px Fashion-MNIST images and byte-tokenized captions.
TEACHER = dataclasses.replace(BYTE, image_size=28, patch_size=7, context_length=32, embed_dim=24)


@pytest.fixture
def teacher(tmp_path: Path) -> Path:
    return step_folder(tmp_path / "teacher", TEACHER, seed=3)[0]


@pytest.fixture
def dropout_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(clip_flavors, "debug", dataclasses.replace(clip_flavors["debug"], dropout=0.1))


def teacher_guide(trainer, folder: Path, batches: list[dict]) -> Guide:
    """The teacher's unit embeddings of the batches' images and captions, built by `load_clip` in float64."""
    model = load_clip(folder).double()
    inputs = [trainer.step_context.inputs(b) for b in batches]
    with torch.no_grad():
        images, texts = model(torch.cat([i[0] for i in inputs]).double(), torch.cat([i[1] for i in inputs]))[:2]
    return Guide(images, texts)


SYMMETRIC = "--loss.distill_symmetric=true"  # each caption's softmax over the images distilled too, as open_clip does
KINDS = {  # local batch, accumulation steps, flags
    "accumulate-kl-beside": (6, 1, ["--loss.distill_weight=0.5", "--loss.distill_temperature=0.05"]),
    "gradcache-patch-dropout": (
        7,
        1,
        ["--gradcache.enabled=true", "--gradcache.chunk_sizes=3", "--model.patch_dropout=0.5", SYMMETRIC],
    ),
    "global-siglip": (
        3,
        2,
        ["--loss.negatives=global", "--loss.stream_chunk_size=5", "--loss.name=siglip", "--loss.distill_weight=2"],
    ),
    "global-kl-alone": (
        3,
        2,
        ["--loss.negatives=global", "--loss.stream_chunk_size=4", "--loss.contrastive_weight=0", SYMMETRIC],
    ),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_clip_teacher_in_every_step_kind_equals_the_dense_objective(
    tmp_path: Path, teacher: Path, dropout_on: None, kind: str
) -> None:
    local, ga, flags = KINDS[kind]
    trainer = make_trainer(
        str(tmp_path / "run"),
        f"--training.local_batch_size={local}",
        f"--training.global_batch_size={local * ga}",
        "--loss.distill=kl",
        f"--loss.teacher_model={teacher}",
        "--loss.distill_temperature=0.1",
        *flags,
    )
    assert "the frozen teacher's cosines" in trainer.gradient_step.describe()
    microbatches = [trainer.train_set.__getitems__(list(range(j * local, (j + 1) * local))) for j in range(ga)]
    pieces = trainer.step_context.split(microbatches[0], 3) if kind.startswith("gradcache") else microbatches
    taught = build_objective(trainer.cfg.loss).with_teacher(teacher_guide(trainer, teacher, microbatches))
    assert_step_equals_its_forwards(trainer, microbatches, pieces, seed=4, objective=taught)
    trainer.metrics.close()


def test_temperature_zero_is_the_teacher_s_own(tmp_path: Path, teacher: Path, dropout_on: None) -> None:
    """`distill_temperature = 0`: the teacher's 1 / exp(logit_scale), read here by `load_clip`; GradCache 3 over 7
    against the dense objective at that temperature."""
    tau = math.exp(-load_clip(teacher).logit_scale.item())
    assert abs(tau - 1) > 0.1  # `step_folder` perturbs the scale: the test would not tell the default from it
    trainer = make_trainer(
        str(tmp_path / "run"),
        "--training.local_batch_size=7",
        "--gradcache.enabled=true",
        "--gradcache.chunk_sizes=3",
        "--loss.distill=kl",
        f"--loss.teacher_model={teacher}",
        "--loss.distill_temperature=0",
    )
    assert f"at tau {tau:g}" in trainer.gradient_step.describe()
    batch = trainer.train_set.__getitems__(list(range(7)))
    loss = dataclasses.replace(trainer.cfg.loss, distill_temperature=tau)
    taught = build_objective(loss).with_teacher(teacher_guide(trainer, teacher, [batch]))
    assert_step_equals_its_forwards(trainer, [batch], trainer.step_context.split(batch, 3), seed=4, objective=taught)
    trainer.metrics.close()


def test_a_clip_guide_decides_the_masks(tmp_path: Path, teacher: Path, dropout_on: None) -> None:
    """GISTEmbed on image-text: the margin mask on the guide's cosines (`guide_model`), GradCache 3 over 7, against
    the dense objective with the guide's mask, which is not the model's own."""
    trainer = make_trainer(
        str(tmp_path / "run"),
        "--training.local_batch_size=7",
        "--gradcache.enabled=true",
        "--gradcache.chunk_sizes=3",
        f"--loss.guide_model={teacher}",
        "--loss.mask_margin=-0.1",
    )
    batch = trainer.train_set.__getitems__(list(range(7)))
    guide = teacher_guide(trainer, teacher, [batch])
    objective = build_objective(trainer.cfg.loss)
    with torch.no_grad():
        q, d = trainer.step_context.encode(batch)[:2]
    by_guide = objective.false_negatives.guided(guide).dense(q.double(), d.double(), None)
    by_model = objective.false_negatives.dense(q.double(), d.double(), None)
    assert by_guide is not None and by_guide.any() and not by_guide.all() and (by_guide != by_model).any()
    pieces = trainer.step_context.split(batch, 3)
    assert_step_equals_its_forwards(trainer, [batch], pieces, seed=4, objective=objective.with_guide(guide))
    trainer.metrics.close()


def test_the_sum_is_open_clips_distill_clip_loss_but_for_the_teachers_entropy(
    tmp_path: Path, teacher: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """open_clip's DistillClipLoss softmaxes the teacher's logits at its own scale, both ways, and adds the mean
    cross-entropy of the student's log-softmax to the contrastive loss; ours is that KL (`distill_symmetric`, tau the
    teacher's 1 / scale): the same gradients, the loss lower by the teacher's mean entropy over both directions."""
    DistillClipLoss = open_clip_loss_module().DistillClipLoss

    tutor = load_clip(teacher).double()
    caplog.set_level(logging.INFO, logger="titan_contrastive")
    scale = tutor.logit_scale.exp().item()
    trainer = make_trainer(
        str(tmp_path / "run"),
        "--training.local_batch_size=8",
        "--loss.distill=kl",
        f"--loss.teacher_model={teacher}",
        f"--loss.distill_temperature={1 / scale!r}",
        SYMMETRIC,
    )
    assert f"the teacher's own temperature is {1 / scale:.4g} (1 / exp(logit_scale))" in caplog.text
    batch = trainer.train_set.__getitems__(list(range(8)))
    student = trainer.spec.build_model(trainer.model_args).double()
    student.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    images, texts = trainer.step_context.inputs(batch)
    zi, zt, t = student(images.double(), texts)[:3]
    with torch.no_grad():
        ti, tt, ts = tutor(images.double(), texts)[:3]
    contrastive, distill = DistillClipLoss()(zi, zt, t, ti, tt, ts)
    (contrastive + distill).backward()
    targets = torch.softmax(ts * ti @ tt.T, 1), torch.softmax(ts * tt @ ti.T, 1)
    entropy = sum(-(p * p.log()).sum(1).mean() for p in targets) / 2
    out = trainer.train_step([batch])
    assert abs(out["loss"] - (contrastive + distill - entropy).item()) <= REL * out["loss"]
    assert_close(grads(trainer.model), grads(student))
    trainer.metrics.close()


def test_the_teacher_is_the_model_init_from_would_start_from(tmp_path: Path) -> None:
    """An open_clip checkpoint at 16 px and 40 positions teaches a run at 28 px and 32: its position tables fitted
    as `[model] init_from` fits them, every weight as a run started from it holds."""
    small = dataclasses.replace(TEACHER, image_size=16, patch_size=4, context_length=40)
    src = step_folder(tmp_path / "small", small, seed=5)[0]
    (tmp_path / "oc").mkdir()
    write_open_clip(str(src), tmp_path / "oc")
    taught = make_trainer(str(tmp_path / "run"), "--loss.distill=kl", f"--loss.teacher_model={tmp_path / 'oc'}")
    started = make_trainer(str(tmp_path / "init"), f"--model.init_from={tmp_path / 'oc'}", "--data.context_length=32")
    guide = taught.step_context.guide
    assert not guide.training and not any(p.requires_grad for p in guide.parameters())
    theirs = started.model.state_dict()
    assert guide.visual.positional_embedding.shape == (1 + 7 * 7, 32) and guide.text.positional_embedding.shape[0] == 32
    assert all(torch.equal(w, theirs[k]) for k, w in guide.state_dict().items())
    taught.metrics.close()
    started.metrics.close()


def test_a_teacher_that_cannot_read_the_run_s_inputs_is_one_line(tmp_path: Path) -> None:
    wrong = {
        "vocabulary of 49408": dataclasses.replace(TEACHER, vocab_size=49408, eos_id=49407),
        "images of 3": dataclasses.replace(TEACHER, in_channels=3),
        "patch size 8 does not divide the run's 28 px": dataclasses.replace(TEACHER, image_size=32, patch_size=8),
        "20 learnt text positions are too few": dataclasses.replace(TEACHER, context_length=20),
    }
    for i, (why, args) in enumerate(wrong.items()):
        folder = step_folder(tmp_path / f"t{i}", args)[0]
        with pytest.raises(ConfigError, match=rf"^loss.teacher_model='{folder}': .*{why}") as err:
            make_trainer(str(tmp_path / "run"), "--loss.distill=kl", f"--loss.teacher_model={folder}")
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"loss.guide_model='.*': .* not a checkpoint this project reads"):
        make_trainer(str(tmp_path / "run"), "--loss.mask_margin=0", f"--loss.guide_model={tmp_path}")


def _on_ranks(tmp: str, teacher: str, local: int, ga: int, layout: list[str]) -> None:
    """Each rank's step from one seed, against the dense objective over every rank's microbatches encoded in order
    from that seed, taught by the teacher's embeddings of all of them."""
    clip_flavors["debug"] = dataclasses.replace(clip_flavors["debug"], dropout=0.1)  # this rank's process only
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    trainer = make_trainer(
        tmp,
        f"--training.local_batch_size={local}",
        f"--training.global_batch_size={local * ga * world}",
        "--loss.negatives=global",
        "--loss.stream_chunk_size=5",
        "--loss.distill=kl",
        f"--loss.teacher_model={teacher}",
        "--loss.distill_temperature=0.1",
        SYMMETRIC,
        *layout,
    )
    steps = [trainer.train_set.__getitems__(list(range(j * local * world, (j + 1) * local * world))) for j in range(ga)]
    mine = [{k: v[rank * local : (rank + 1) * local] for k, v in s.items()} for s in steps]
    reference = trainer.spec.build_model(trainer.model_args).double().train()
    reference.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    torch.manual_seed(11)
    out = trainer.train_step(mine)
    parts, order = [], []
    for r in range(world):
        torch.manual_seed(11)
        for s in steps:
            rows = {k: v[r * local : (r + 1) * local] for k, v in s.items()}
            images, texts = trainer.step_context.inputs(rows)
            parts.append(reference(images.double(), texts))
            order.append(rows)
    taught = build_objective(trainer.cfg.loss).with_teacher(teacher_guide(trainer, Path(teacher), order))
    loss = taught.dense(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), parts[0][2])
    loss.backward()
    assert_close(grads(trainer.model), grads(reference))
    assert abs(out["loss"] - loss.item()) <= REL * loss.item()
    trainer.metrics.close()


DDP = ["--parallelism.data_parallel_replicate_degree=-1", "--parallelism.data_parallel_shard_degree=1"]


@pytest.mark.parametrize(
    "world, local, ga, layout",
    [(2, 3, 2, []), pytest.param(4, 2, 3, DDP, marks=pytest.mark.slow)],
    ids=["fsdp2", "ddp4"],
)
def test_global_negatives_on_ranks_gather_the_teacher_s_embeddings(
    tmp_path: Path, teacher: Path, world: int, local: int, ga: int, layout: list[str]
) -> None:
    run_distributed(_on_ranks, world, str(tmp_path / "run"), str(teacher), local, ga, layout)
