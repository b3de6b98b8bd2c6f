"""The hf_clip family: a Hugging Face CLIP or SigLIP folder (tiny, random, built here) trained as an
image-text dual encoder. Every step kind (GradCache chunks that divide nothing, accumulation, streamed
global negatives), both objectives, negative captions, LoRA, a locked tower, `unlocked_layers` and FSDP2
on 2 gloo ranks equal the dense objective written from its definition in float64. Its inputs against
transformers' processor, the exports and the command line: `tests/test_hf_clip_interop.py`."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed, write_once
from tests.hf_folders import IMAGE_TEXT, WORDS, image_text_folder
from tests.marks import slow_ones
from tests.needs import require
from tests.test_hard_negatives import assert_grads_close, assert_step_equals_its_forwards
from tests.test_hf_text import grads
from tests.test_trainer import full
from tests.test_trainer import make_trainer as base_trainer
from titan_contrastive.losses import InfoNCE, Sigmoid

require("hf")

REL = 1e-10
SIZES = [(16, 16), (20, 30), (30, 20), (24, 24), (17, 40), (40, 40), (16, 25), (33, 18), (21, 21), (50, 30)]
# (local batch, accumulation steps, options): chunks of 3 over 7 divide nothing
KINDS = {
    "gradcache": (7, 1, ["--gradcache.enabled=true", "--gradcache.chunk_sizes=3"]),
    "accumulate": (3, 2, []),
    "global": (3, 2, ["--loss.negatives=global", "--loss.stream_chunk_size=5"]),
}
LORA = ("--lora.enable=true", "--lora.rank=4", "--lora.alpha=8")
DORA = (*LORA, "--lora.use_dora=true", "--lora.use_rslora=true")


def pictures(root: Path, negatives: int = 0) -> Path:
    """RGB PNGs of different sizes and shapes, each with a caption of the folder's words (a TSV); `negatives`:
    that many negative captions per picture too (columns neg_0, neg_1, ...)."""
    from PIL import Image

    g = np.random.default_rng(0)
    (root / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (h, w) in enumerate(SIZES * 3):
        Image.fromarray(g.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / "img" / f"{i}.png")
        captions = [" ".join(g.choice(WORDS, size=int(g.integers(1, 14)))) for _ in range(1 + negatives)]
        rows.append([f"img/{i}.png", *captions])
    with open(root / "train.csv", "w", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(["filepath", "title", *(f"neg_{j}" for j in range(negatives))])
        writer.writerows(rows)
    return root / "train.csv"


def clip_run(tmp: Path, kind: str, *extra: str, dropout: float = 0.1):
    """A trainer of the hf_clip family on `kind`'s tiny folder and the pictures' CSV."""
    folder = write_once(tmp / f"tiny-{kind}", lambda: image_text_folder(tmp, kind, dropout))
    table = write_once(tmp / "data" / "train.csv", lambda: pictures(tmp / "data"))
    return base_trainer(
        str(tmp / f"run-{kind}"),
        "--model.name=hf_clip",
        "--model.flavor=folder",
        f"--model.path={folder}",
        "--data.dataset=csv",
        f"--data.path={table}",
        "--data.image_size=0",
        "--data.context_length=0",
        "--eval.enable=false",
        *extra,
    )


def _tensors(batch: dict) -> dict:
    """The batch's tensors (SigLIP 2's `image`: a dict of them)."""
    return {k: v for k, v in batch.items() if isinstance(v, (torch.Tensor, dict))}


def _double(images):
    """float64 images, or SigLIP 2's patches in float64 beside their mask and grids."""
    if isinstance(images, dict):
        return {k: v.double() if v.is_floating_point() else v for k, v in images.items()}
    return images.double()


def _rows(images, rows: slice):
    return {k: v[rows] for k, v in images.items()} if isinstance(images, dict) else images[rows]


def _dense(trainer, problems: list[dict], objective) -> tuple[float, dict[str, torch.Tensor]]:
    """The objective from its definition on a float64 copy: the mean over `problems` of the loss over
    each whole problem's embeddings, made by transformers' own `get_*_features` path."""
    model = trainer.spec.build_model(trainer.model_args).double()
    model.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    model.eval()
    losses = []
    for batch in problems:
        out = model(_double(batch["image"]), batch["text"])
        losses.append(objective.dense(*out))
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.item(), grads(model)


def _step(tmp: Path, kind: str, step: str, *extra: str, objective=None) -> None:
    """One step of `step` (dropout off) against the dense objective over the whole global batch; a warm-up
    step first (LoRA's B starts at zero)."""
    local, ga, args = KINDS[step]
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    trainer = clip_run(
        tmp,
        kind,
        f"--training.local_batch_size={local}",
        f"--training.global_batch_size={local * ga * world}",
        *args,
        *extra,
    )
    trainer.model.eval()
    data = trainer.train_set
    mine = [
        _tensors(
            data.__getitems__(list(range(j * local * world + rank * local, j * local * world + (rank + 1) * local)))
        )
        for j in range(ga)
    ]
    problems = (
        [_tensors(data.__getitems__(list(range(j * local * world, (j + 1) * local * world)))) for j in range(ga)]
        if step == "accumulate"
        else [_tensors(data.__getitems__(list(range(local * ga * world))))]
    )
    trainer.train_step(mine)
    want_loss, want = _dense(trainer, problems, objective or InfoNCE())
    out = trainer.train_step(mine)
    trains = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert_grads_close({n: g for n, g in grads(trainer.model).items() if n in trains}, {n: want[n] for n in trains})
    assert abs(out["loss"] - want_loss) <= REL * abs(want_loss)
    trainer.metrics.close()


@pytest.mark.parametrize("kind", IMAGE_TEXT)
@pytest.mark.parametrize("step", KINDS)
def test_every_step_kind_equals_the_dense_objective(tmp_path: Path, kind: str, step: str) -> None:
    _step(tmp_path, kind, step)


@pytest.mark.parametrize("step", ["gradcache", "global"])
def test_siglip_with_its_sigmoid_loss_and_bias(tmp_path: Path, step: str) -> None:
    """The sigmoid loss starts from the folder's scale and bias, and trains both exactly."""
    _step(tmp_path, "siglip", step, "--loss.name=siglip", objective=Sigmoid())
    trainer = clip_run(tmp_path / "again", "siglip", "--loss.name=siglip", "--training.local_batch_size=4")
    assert trainer.model.logit_scale.item() == pytest.approx(2.3) and trainer.model.logit_bias.item() == -3.0
    assert trainer.model.logit_bias.requires_grad
    trainer.metrics.close()


@pytest.mark.parametrize("kind", slow_ones(IMAGE_TEXT, ["siglip", "metaclip_2"]))  # as test_two_ranks_fsdp2
def test_lora_and_a_locked_image_tower(tmp_path: Path, kind: str) -> None:
    """LoRA on both towers' attention (DoRA with rsLoRA over global negatives); and LiT's locked image tower (run
    without a graph, replayed)."""
    _step(tmp_path, kind, "gradcache", *LORA)
    _step(tmp_path / "dora", kind, "global", *DORA)
    _step(tmp_path / "lit", kind, "gradcache", "--model.freeze=image")


def test_activation_checkpointing(tmp_path: Path) -> None:
    _step(tmp_path, "clip", "gradcache", "--activation_checkpoint.mode=full")


@pytest.mark.slow
@pytest.mark.parametrize("kind", IMAGE_TEXT)
def test_compiled_layers(tmp_path: Path, kind: str) -> None:
    """torch.compile on each transformers layer (aot_eager: the graphs without inductor's C++ build)."""
    _step(tmp_path, kind, "global", "--compile.enable=true", "--compile.backend=aot_eager")


@pytest.mark.parametrize("kind", IMAGE_TEXT)
def test_gradcache_replays_the_dropout_of_both_towers(tmp_path: Path, kind: str) -> None:
    trainer = clip_run(
        tmp_path, kind, "--training.local_batch_size=7", "--gradcache.enabled=true", "--gradcache.chunk_sizes=3"
    )
    assert trainer.model.training
    batch = _tensors(trainer.train_set.__getitems__(list(range(7))))
    chunks = [{k: _rows(v, s) for k, v in batch.items()} for s in (slice(0, 3), slice(3, 6), slice(6, 7))]
    assert_step_equals_its_forwards(trainer, [batch], chunks, seed=5)
    torch.manual_seed(5)
    on = trainer.model(_rows(batch["image"], slice(3)), batch["text"][:3])
    off = trainer.model.eval()(_rows(batch["image"], slice(3)), batch["text"][:3])
    assert not torch.allclose(on[0], off[0]) and not torch.allclose(on[1], off[1])  # dropout is on in both towers
    trainer.metrics.close()


@pytest.mark.parametrize("step", ["gradcache", "global"])
def test_negative_captions_equal_the_definition(tmp_path: Path, step: str) -> None:
    """Two negative captions per picture: each image against the batch's captions and every image's
    negatives as columns, each caption against the images; the step equals that objective in float64."""
    from titan_contrastive.batching import NEGATIVES, with_negatives
    from titan_contrastive.losses import split_documents
    from titan_contrastive.losses.base import columns

    table = pictures(tmp_path / "negatives", negatives=2)
    local, ga, args = KINDS[step]
    trainer = clip_run(
        tmp_path,
        "clip",
        f"--data.path={table}",
        "--data.csv_negative_keys=neg_0,neg_1",
        f"--training.local_batch_size={local}",
        f"--training.global_batch_size={local * ga}",
        *args,
    )
    trainer.model.eval()
    mine = [_tensors(trainer.train_set.__getitems__(list(range(j * local, (j + 1) * local)))) for j in range(ga)]
    assert mine[0][NEGATIVES].shape[:2] == (local, 2)
    every = _tensors(trainer.train_set.__getitems__(list(range(local * ga))))
    trainer.train_step(mine)
    model = trainer.spec.build_model(trainer.model_args).double()
    model.load_state_dict(trainer.model.state_dict())
    model.eval()
    texts = with_negatives(every["text"], every[NEGATIVES], None)
    images, docs, scale = model(every["image"].double(), texts)
    loss = InfoNCE().dense(images, columns(*split_documents(docs.reshape(len(images), 3, -1))), scale)
    loss.backward()
    out = trainer.train_step(mine)
    assert_grads_close(grads(trainer.model), grads(model))
    assert abs(out["loss"] - loss.item()) <= REL * loss.item()
    trainer.metrics.close()


def _ranks(tmp: str, kind: str, steps: tuple[str, ...], *extra: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for step in steps:
        _step(Path(tmp) / step, kind, step, *extra)


def _folders(tmp: Path, kind: str, steps: tuple[str, ...]) -> None:
    """Each step's folder and pictures, written before the ranks start (they would race to write them)."""
    for step in steps:
        image_text_folder(tmp / step, kind)
        pictures(tmp / step / "data")


# CLIP's and SigLIP 2's towers and losses by default, SigLIP's and MetaCLIP 2's (their families' other members) slow
@pytest.mark.parametrize("kind", slow_ones(IMAGE_TEXT, ["siglip", "metaclip_2"]))
def test_two_ranks_fsdp2(tmp_path: Path, kind: str) -> None:
    """FSDP2 over both towers' layers on 2 gloo ranks: GradCache and global negatives."""
    steps = ("gradcache", "global")
    _folders(tmp_path, kind, steps)
    run_distributed(_ranks, 2, str(tmp_path), kind, steps)


@pytest.mark.slow
def test_four_ranks_ddp_with_lora(tmp_path: Path) -> None:
    steps = ("global", "gradcache")
    _folders(tmp_path, "siglip", steps)
    layout = ("--parallelism.data_parallel_shard_degree=1", "--parallelism.data_parallel_replicate_degree=4")
    run_distributed(_ranks, 4, str(tmp_path), "siglip", steps, *layout, *LORA)


def test_siglip2_positions_resize_as_interpolate_does() -> None:
    """SigLIP 2's position table resized to each image's grid in float64 equals `F.interpolate` (bilinear,
    antialiased) of the table, up and down, square or not, in one batch; the padding rows take the first."""
    import torch.nn.functional as F

    from titan_contrastive.models.hf_clip.naflex import resized_positions

    table = torch.randn(25, 3, dtype=torch.float64)
    shapes = torch.tensor([[5, 5], [3, 7], [8, 2], [1, 1], [2, 13], [4, 4]])
    got = resized_positions(table, shapes, 30)
    square = table.reshape(5, 5, 3).permute(2, 0, 1)[None]
    for row, (h, w) in enumerate(shapes.tolist()):
        want = F.interpolate(square, size=(h, w), mode="bilinear", align_corners=False, antialias=True)
        want = want[0].reshape(3, -1).T
        assert torch.allclose(got[row, : h * w], want, rtol=0, atol=1e-14)
        assert torch.allclose(got[row, h * w :], got[row, :1].expand(30 - h * w, -1), rtol=0, atol=1e-14)


@pytest.mark.parametrize("kind", IMAGE_TEXT)
def test_unlocked_layers_of_a_locked_image_tower(tmp_path: Path, kind: str) -> None:
    """`unlocked_layers = 1` leaves the image tower's last layer and what follows it training (CLIP's final
    norm and projection; SigLIP's final norm and pooling head), nothing before it."""
    trainer = clip_run(
        tmp_path, kind, "--model.freeze=image", "--model.unlocked_layers=1", "--training.local_batch_size=4"
    )
    trains = {n for n, p in trainer.model.named_parameters() if p.requires_grad and n.startswith("visual.")}
    layers = {n.split(".")[4] for n in trains if ".encoder.layers." in n}
    after = {n.rsplit(".", 1)[0] for n in trains if ".encoder.layers." not in n}
    assert layers == {"1"}
    if kind in ("clip", "metaclip_2"):
        assert after == {"visual.transformer.post_layernorm", "visual.projection"}
    else:
        head = {m for m in after if m.startswith("visual.transformer.head")}
        assert head and after - head == {"visual.transformer.post_layernorm"}
    assert not getattr(trainer.model.visual, "frozen", False)  # not locked: it runs with a graph
    trainer.metrics.close()
