"""The vae family in the trainer: masked mixed-size data, the exact global-batch pixel loss under
accumulation and data parallelism (every mode against a dense float64 v0 reference), errors, eval."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.test_trainer import DDP, REL, assert_close, full, grads, make_trainer
from titan_contrastive.components.pixel_loss import compute_pixel_loss_v0
from titan_contrastive.config import ConfigError
from titan_contrastive.datasets import build_dataset
from titan_contrastive.models.vae import AutoEncoder, vae_flavors

VAE = ["--model.name=vae", "--data.dataset=emoji", "--data.image_sizes=8,16,24", "--eval.batch_size=100"]
MODES = ["v0", "chunked", "per_chunk_backward"]


@pytest.mark.parametrize("flavor", ["debug", "sd"])
@pytest.mark.parametrize("change", [{}, {"mid_attention": True, "num_res_blocks": 3, "extra_decoder_blocks": 0}])
def test_num_params_is_the_module_count(flavor: str, change: dict) -> None:
    args = dataclasses.replace(vae_flavors[flavor], in_channels=1, **change)
    with torch.device("meta"):
        assert args.num_params() == sum(p.numel() for p in AutoEncoder(args).parameters())


def test_masked_layout_serves_minus_one_to_one_images_with_masks() -> None:
    ds = build_dataset("emoji", "train", seed=1)
    ds.serve_masked(4, [8, 16, 24])
    batch = ds.__getitems__(list(range(30)))
    image, mask = batch["image"], batch["mask"]
    assert image.shape == (30, 3, 24, 24) and mask.shape == (30, 1, 24, 24)
    sides = mask[:, 0].sum(dim=(1, 2)).sqrt()
    assert set(sides.tolist()) == {8.0, 16.0, 24.0}
    assert torch.equal(image * (1 - mask), torch.zeros_like(image))  # padding is zero
    assert image.min() >= -1 and image.max() <= 1 and image.min() < -0.9


def dense_reference(model: AutoEncoder, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """v0 on all microbatches of all ranks at once: Σ numerators / Σ denominators."""
    images = torch.cat([b["image"] for b in batches]).double()
    masks = torch.cat([b["mask"] for b in batches]).double()
    return compute_pixel_loss_v0(model.encoder(images), images, masks, model.decoder)


@pytest.mark.parametrize("mode", MODES)
def test_accumulation_equals_one_dense_batch(tmp_path: Path, mode: str) -> None:
    """GA 3 over microbatches of 4 with unequal mask sizes == the masked mean of all 12 at once."""
    trainer = make_trainer(
        str(tmp_path),
        *VAE,
        "--training.local_batch_size=4",
        "--training.global_batch_size=12",
        f"--pixel_loss.mode={mode}",
        "--pixel_loss.adaptive=false",
        "--pixel_loss.chunk_size=3",
    )
    init = copy.deepcopy(trainer.model.state_dict())
    micro = [trainer.train_set.__getitems__(list(range(s, s + 4))) for s in (0, 4, 8)]
    # unequal denominators: a plain mean of means would be wrong
    assert len({float(m["mask"].sum()) for m in micro}) > 1
    out = trainer.train_step(micro)
    got = grads(trainer.model)
    trainer.model.load_state_dict(init)
    trainer.optimizer.zero_grad(set_to_none=True)
    loss = dense_reference(trainer.model, micro)
    loss.backward()
    assert_close(got, grads(trainer.model))
    assert abs(out["loss"] - loss.item()) <= REL * loss.item()


def _dp_vae(tmp: str, mode: str, layout: list[str]) -> None:
    import torch.distributed as dist

    trainer = make_trainer(
        tmp,
        *VAE,
        "--training.local_batch_size=3",
        "--training.global_batch_size=12",
        f"--pixel_loss.mode={mode}",
        "--pixel_loss.adaptive=false",
        "--pixel_loss.chunk_size=2",
        *layout,
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = AutoEncoder(trainer.model_args).double()
    reference.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    steps = [
        trainer.train_set.__getitems__(list(range(j * 3 * world, (j + 1) * 3 * world))) for j in range(trainer.ga_steps)
    ]
    out = trainer.train_step([{k: v[rank * 3 : (rank + 1) * 3] for k, v in s.items()} for s in steps])
    loss = dense_reference(reference, steps)
    loss.backward()
    assert_close(grads(trainer.model), grads(reference))
    assert abs(out["loss"] - loss.item()) <= REL * loss.item()


@pytest.mark.parametrize(
    "world, mode, layout",
    [
        (2, "per_chunk_backward", DDP),
        (2, "chunked", []),
        pytest.param(4, "per_chunk_backward", DDP, marks=pytest.mark.slow),  # the default suite's time
        pytest.param(4, "v0", [], marks=pytest.mark.slow),
    ],
    ids=["2-ddp-per_chunk", "2-fsdp2-chunked", "4-ddp-per_chunk", "4-fsdp2-v0"],
)
def test_data_parallel_matches_dense(tmp_path: Path, world: int, mode: str, layout: list[str]) -> None:
    run_distributed(_dp_vae, world, str(tmp_path), mode, layout)


def _config_error(tmp: str, extra: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_trainer(tmp, *VAE, *extra)


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--pixel_loss.mode=per_chunk_backward"],
            r"pixel_loss.mode=per_chunk_backward runs the decoder's backward inside the forward, which FSDP2",
        ),
        (["--loss.name=clip"], r"loss.name='clip': the vae family trains with 'pixel'"),
        (
            ["--gradcache.enabled=true", *DDP],
            r"model.name=vae trains with the pixel loss; loss.negatives=global and gradcache.enabled",
        ),
    ],
)
def test_config_errors(tmp_path: Path, extra: list[str], message: str) -> None:
    if "FSDP2" in message:  # FSDP2 needs more than one process
        run_distributed(_config_error, 2, str(tmp_path), extra, message)
    else:
        _config_error(str(tmp_path), extra, message)


def test_train_and_evaluate_write_a_reconstruction_grid(tmp_path: Path) -> None:
    trainer = make_trainer(
        str(tmp_path), *VAE, "--training.local_batch_size=8", "--training.dtype=float32", "--training.steps=4"
    )
    results = trainer.train()
    assert results["num_samples"] == 200 and 0 < results["loss"] < 1 and results["psnr_db"] > 0
    assert (tmp_path / "reconstructions_step4.png").stat().st_size > 1000
