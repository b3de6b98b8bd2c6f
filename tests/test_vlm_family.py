"""The vlm family on real mixed-resolution data: packing, the packed-patch tower, GradCache in the trainer.

Packing is checked against the plain image pipeline (the same pixels), the tower against itself
one image at a time (padding must not leak), and the trainer's chunked paths against unchunked and
dense float64 references (rel err <= 1e-10), with chunks that do not divide the batch.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from tests.dist_utils import run_distributed
from tests.test_trainer import DDP, REL, assert_close, full, grads, make_trainer
from titan_contrastive.config import ConfigError
from titan_contrastive.datasets import DataError, build_dataset
from titan_contrastive.datasets.packing import unpatchify
from titan_contrastive.grad_cache import split_vlm_inputs
from titan_contrastive.losses import InfoNCE
from titan_contrastive.models import get_flavor_args
from titan_contrastive.models.vlm import VLMEmbedder

SIZES = [16, 24, 32]
VLM = ["--model.name=vlm", "--data.dataset=emoji", "--data.image_sizes=16,24,32", "--eval.batch_size=200"]


@pytest.fixture(scope="module")
def emoji_pair() -> tuple:
    packed = build_dataset("emoji", "train", seed=3)
    packed.pack_patches(8, SIZES)
    return packed, build_dataset("emoji", "train", seed=3)


def test_packing_serves_the_plain_pixels_at_mixed_sizes(emoji_pair: tuple) -> None:
    packed, plain = emoji_pair
    indices = list(range(40))
    batch, images = packed.__getitems__(indices), plain.__getitems__(indices)["image"]
    grid = batch["image_grid_thw"]
    assert grid.shape == (40, 3) and batch["pixel_values"].shape == (int(grid.prod(1).sum()), 3 * 8 * 8)
    assert set((grid[:, 1] * 8).tolist()) == set(SIZES)  # all three resolutions occur
    for image, got, (_, h, _) in zip(images, unpatchify(batch["pixel_values"], grid, 3, 8), grid.tolist()):
        want = (
            F.interpolate(image[None], size=(h * 8, h * 8), mode="bilinear", antialias=h * 8 < 32)[0]
            if h * 8 != 32
            else image
        )
        assert torch.equal(got, want)
    assert packed.image_shape == (3, 32, 32) and packed.image_sizes == SIZES


def test_packing_is_a_function_of_the_sample_not_the_batch(emoji_pair: tuple) -> None:
    packed, _ = emoji_pair
    whole, halves = packed.__getitems__(list(range(16))), [packed.__getitems__(list(range(s, s + 8))) for s in (0, 8)]
    for key in whole:
        assert torch.equal(whole[key], torch.cat([h[key] for h in halves])), key
    packed.set_epoch(1)
    assert not torch.equal(packed.__getitems__(list(range(16)))["image_grid_thw"], whole["image_grid_thw"])
    packed.set_epoch(0)
    test = build_dataset("emoji", "test")
    test.pack_patches(8, SIZES)
    assert (test.__getitems__(list(range(6)))["image_grid_thw"][:, 1] * 8).tolist() == SIZES * 2  # cycled by index


def test_bad_packing_sizes_are_one_line_errors() -> None:
    ds = build_dataset("emoji", "train")
    with pytest.raises(
        DataError, match=r"^data.image_sizes=\[20, 32\]: \[20\] are not positive multiples of the model's patch size 8"
    ):
        ds.pack_patches(8, [20, 32])
    with pytest.raises(
        DataError,
        match=r"^fashion_mnist images are 28 px, not a multiple of the model's patch size 8; set data.image_sizes",
    ):
        build_dataset("fashion_mnist", "test").pack_patches(8)


@pytest.fixture(scope="module")
def model() -> VLMEmbedder:
    torch.manual_seed(0)
    args = get_flavor_args("vlm", "debug").update_from_data(image_shape=(3, 32, 32), vocab_size=259, context_length=32)
    return VLMEmbedder(args).double()


def test_num_params_and_flops(model: VLMEmbedder, emoji_pair: tuple) -> None:
    args = model.args
    assert sum(p.numel() for p in model.parameters()) == args.num_params()
    packed, _ = emoji_pair
    one = packed.__getitems__([next(i for i in range(50) if packed.__getitems__([i])["image_grid_thw"][0, 1] == 4)])
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(one["pixel_values"].double(), one["image_grid_thw"], one["text"])
    assert counter.get_total_flops() * 3 == args.flops_per_sample()  # a largest-resolution image


def test_an_image_embedding_does_not_depend_on_its_batch(model: VLMEmbedder, emoji_pair: tuple) -> None:
    """Padding to the largest image in the batch is masked: batched == one image at a time."""
    packed, _ = emoji_pair
    batch = packed.__getitems__(list(range(12)))
    together = model.visual(batch["pixel_values"].double(), batch["image_grid_thw"])
    alone = torch.cat(
        [model.visual(c["pixel_values"].double(), c["image_grid_thw"]) for c in split_vlm_inputs(batch, 1)]
    )
    assert len(set(batch["image_grid_thw"][:, 1].tolist())) == 3
    assert (together - alone).abs().max() <= 1e-12


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda px, g: (px[:-1], g), r"image_grid_thw gives \d+ patches but pixel_values has \d+ rows"),
        (lambda px, g: (px[:, :10], g), r"pixel_values must be \[total_patches, 192\] \(C·p·p\), got \[\d+, 10\]"),
        (lambda px, g: (px, g.float()), r"image_grid_thw must be integer \[num_images, 3\]"),
        (
            lambda px, g: (px, torch.tensor([[2, 2, 2]] * len(g))),
            r"rows must be \(1, h, w\) with 1 <= h, w <= max_grid=4",
        ),
    ],
)
def test_bad_packed_inputs_are_one_line_errors(model: VLMEmbedder, emoji_pair: tuple, change, message: str) -> None:
    batch = emoji_pair[0].__getitems__([0, 1, 2])
    with pytest.raises(ValueError, match=message):
        model.visual(*change(batch["pixel_values"].double(), batch["image_grid_thw"]))


def _batch(trainer, start: int, size: int) -> dict[str, torch.Tensor]:
    return trainer.train_set.__getitems__(list(range(start, start + size)))


def test_trainer_gradcache_on_packed_batches_equals_unchunked(tmp_path: Path) -> None:
    """Microbatches of 7 mixed-resolution images forwarded in chunks of 3 (split on image boundaries)."""
    args = [*VLM, "--training.local_batch_size=7", "--training.global_batch_size=14"]
    plain = make_trainer(str(tmp_path / "plain"), *args)
    cached = make_trainer(str(tmp_path / "cached"), *args, "--gradcache.enabled=true", "--gradcache.chunk_sizes=3")
    cached.model.load_state_dict(plain.model.state_dict())
    micro = [_batch(plain, 0, 7), _batch(plain, 7, 7)]
    want, got = plain.train_step(micro), cached.train_step(micro)
    assert_close(grads(cached.model), grads(plain.model))
    assert abs(got["loss"] - want["loss"]) <= REL * want["loss"]


def test_trainer_global_negatives_with_gradcache_equal_one_dense_batch(tmp_path: Path) -> None:
    trainer = make_trainer(
        str(tmp_path),
        *VLM,
        "--training.local_batch_size=5",
        "--training.global_batch_size=10",
        "--loss.negatives=global",
        "--gradcache.enabled=true",
        "--gradcache.chunk_sizes=4",
    )
    init = copy.deepcopy(trainer.model.state_dict())
    whole = _batch(trainer, 0, 10)
    out = trainer.train_step(split_vlm_inputs(whole, 5))
    got = grads(trainer.model)
    trainer.model.load_state_dict(init)
    trainer.optimizer.zero_grad(set_to_none=True)
    img, txt, scale = trainer.model(whole["pixel_values"].double(), whole["image_grid_thw"], whole["text"])
    loss = InfoNCE().dense(img, txt, scale)
    loss.backward()
    assert_close(got, grads(trainer.model))
    assert abs(out["loss"] - loss.item()) <= REL * loss.item()


def _dp_vlm_gradcache(tmp: str, layout: list[str]) -> None:
    """Each rank forwards its 5 packed samples in chunks of 2; a step of all ranks is one problem."""
    import torch.distributed as dist

    # joins the process group
    trainer = make_trainer(
        tmp,
        *VLM,
        "--training.local_batch_size=5",
        "--training.global_batch_size=20",
        "--gradcache.enabled=true",
        "--gradcache.chunk_sizes=2",
        *layout,
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    ga = trainer.ga_steps
    reference = trainer.spec.build_model(trainer.model_args).double()
    reference.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    steps = [_batch(trainer, j * 5 * world, 5 * world) for j in range(ga)]
    trainer.train_step([split_vlm_inputs(s, 5)[rank] for s in steps])
    for s in steps:
        img, txt, scale = reference(s["pixel_values"].double(), s["image_grid_thw"], s["text"])
        (InfoNCE().dense(img, txt, scale) / ga).backward()
    assert_close(grads(trainer.model), grads(reference))


@pytest.mark.parametrize(
    "world, layout",
    [(2, []), (2, DDP), pytest.param(4, [], marks=pytest.mark.slow)],
    ids=["2-fsdp2", "2-ddp", "4-fsdp2"],
)
def test_data_parallel_vlm_gradcache_matches_dense(tmp_path: Path, world: int, layout: list[str]) -> None:
    run_distributed(_dp_vlm_gradcache, world, str(tmp_path), layout)


def test_training_and_eval_run_on_packed_data(tmp_path: Path) -> None:
    trainer = make_trainer(
        str(tmp_path),
        *VLM,
        "--training.local_batch_size=16",
        "--training.dtype=float32",
        "--gradcache.enabled=true",
        "--gradcache.chunk_sizes=6",
    )
    results = trainer.train()
    assert results["num_samples"] == 200 and np.isfinite(results["loss"]) and 0 <= results["image_to_text_r@5"] <= 1


def test_image_sizes_need_a_packed_family(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"^data.image_sizes=\[16, 32\]: mixed resolutions need a family that reads packed patches"
    ):
        make_trainer(str(tmp_path), "--data.dataset=emoji", "--data.image_sizes=16,32")
