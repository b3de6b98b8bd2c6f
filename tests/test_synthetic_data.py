"""`data.dataset = "synthetic"`: generated JPEG records that cost what real ones cost, at any size."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from titan_contrastive.datasets.synthetic import POOL, SyntheticSource, _pool
from titan_contrastive.train import main


def test_records_are_jpegs_of_the_pool_with_their_own_captions() -> None:
    source = SyntheticSource(1000, 72, seed=3)
    _pool.cache_clear()  # built again, not the process's cached pool
    again = SyntheticSource(1000, 72, seed=3)
    assert len(source) == 1000 and source.num_negatives == 0 and source.losses == []
    first = source.read(5)
    assert first == again.read(5) and again._jpegs is not source._jpegs  # every rank and worker builds the same pool
    image = Image.open(io.BytesIO(first.image))
    assert image.format == "JPEG" and image.size == (72, 72)
    assert first.caption.startswith("a photo of ") and first.caption.endswith("sample 5")
    assert source.read(5 + POOL).image == first.image and source.read(5 + POOL).caption != first.caption
    assert len({source.read(i).image for i in range(POOL)}) == POOL
    noisy = np.asarray(image, dtype=np.float32)  # not a flat drawing: neighbouring pixels differ like a photo's
    assert np.abs(np.diff(noisy, axis=1)).mean() > 3
    assert SyntheticSource(10, 72, seed=4).read(0).image != SyntheticSource(10, 72, seed=3).read(0).image


def test_the_trainer_runs_a_batch_larger_than_a_bundled_set(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The emoji set (1,706 samples) refuses a global batch of 2,048; synthetic data serves it (one
    step of clip/debug, crops of 16 px, captions cut to 16 tokens, microbatches of 512), and refuses a held-out path."""
    args = [
        "--data.dataset=synthetic",
        "--data.synthetic_samples=3000",
        "--data.image_size=16",
        "--data.context_length=16",
        "--model.flavor=debug",
        "--training.local_batch_size=512",
        "--training.global_batch_size=2048",
        "--training.steps=1",
        "--loss.negatives=global",
        "--metrics.log_freq=1",
        "--metrics.enable_tensorboard=false",
        "--eval.enable=false",
    ]
    assert main([*args, f"--job.dump_folder={tmp_path / 'run'}"]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 1 and np.isfinite(train[0]["loss"]) and train[0]["skipped_steps"] == 0
    capsys.readouterr()
    assert main([*args, "--data.val_path=held_out.csv", f"--job.dump_folder={tmp_path / 'bad'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.val_path='held_out.csv'" in err[0] and "synthetic" in err[0], err


def test_the_gpu_config_trains_on_the_cpu_with_a_small_model(tmp_path: Path) -> None:
    """train_configs/clip_vit_b32_gpu.toml as shipped but for what a CPU cannot hold (the model, the
    sizes, CUDA, bf16, workers): global negatives over 3 microbatches of synthetic pairs, logged."""
    config = Path(__file__).resolve().parents[1] / "train_configs" / "clip_vit_b32_gpu.toml"
    args = [f"--job.config_file={config}", "--model.flavor=debug", "--data.image_size=32"]
    args += ["--training.device=cpu", "--training.mixed_precision_param=float32", "--data.num_workers=0"]
    args += ["--training.local_batch_size=16", "--training.global_batch_size=48", "--data.synthetic_samples=96"]
    args += ["--data.context_length=40", "--training.steps=2", "--metrics.log_freq=1"]
    assert main([*args, "--metrics.enable_tensorboard=false", f"--job.dump_folder={tmp_path}"]) == 0
    train = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2] and all(np.isfinite(r["loss"]) for r in train)


def test_uint8_pixels_normalized_on_the_device_equal_the_workers_floats(tmp_path: Path) -> None:
    """A GPU run's file data leaves the loader as uint8 (`pixels_on_device`) and the step normalizes
    it: the model's inputs are the float path's to the bit, in the same memory layout, and so are
    the embeddings. (On CPU the trainer keeps normalizing in the workers; here the switch is forced.)"""
    import torch

    from titan_contrastive.config import parse_args
    from titan_contrastive.train import Trainer

    trainer = Trainer(
        parse_args(
            [
                "--data.dataset=synthetic",
                "--data.synthetic_samples=64",
                "--data.image_size=32",
                "--training.local_batch_size=8",
                "--training.steps=1",
                "--eval.enable=false",
                "--metrics.enable_tensorboard=false",
                f"--job.dump_folder={tmp_path}",
            ]
        )
    )
    data, ctx = trainer.train_set, trainer.step_context
    assert ctx.device_transforms == {} and not data.uint8_pixels  # CPU: floats from the workers
    floats = data.__getitems__(list(range(8)))
    data.serve_uint8()
    raw = data.__getitems__(list(range(8)))
    assert floats["image"].dtype == torch.float32 and raw["image"].dtype == torch.uint8
    assert raw["image"].element_size() * 4 == floats["image"].element_size()  # a quarter of the bytes
    assert torch.equal(raw["text"], floats["text"])
    ctx.device_transforms = {"image": data.normalize.apply}
    got, want = ctx.inputs(raw), ctx.inputs(floats)
    assert torch.equal(got[0], want[0]) and got[0].stride() == want[0].stride() and torch.equal(got[1], want[1])
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(ctx.encode(raw), ctx.encode(floats)))
    ctx.device_transforms = {}  # without the transform the step would feed raw bytes: the test's control
    assert not torch.equal(ctx.inputs(raw)[0], want[0])
    trainer.metrics.close()


def test_build_data_sends_uint8_pixels_when_they_are_normalized_on_the_device() -> None:
    import torch

    from titan_contrastive.config import parse_args
    from titan_contrastive.datasets import build_dataset
    from titan_contrastive.datasets.build import build_data

    cfg = parse_args(
        [
            "--data.dataset=synthetic",
            "--data.synthetic_samples=32",
            "--data.image_size=32",
            "--training.local_batch_size=8",
        ]
    )
    common = dict(family_tokenizer=lambda: None, prepare=lambda ds: None, build_bundled=build_dataset)
    for on_device, dtype in ((False, torch.float32), (True, torch.uint8)):
        bundle = build_data(cfg, **common, dp_rank=0, dp_degree=1, pin_memory=False, pixels_on_device=on_device)
        assert set(bundle.device_transforms) == ({"image"} if on_device else set())
        assert next(iter(bundle.loader))["image"].dtype == dtype
    bundled = parse_args(
        ["--data.dataset=emoji", "--training.local_batch_size=8"]
    )  # in-memory sets resize floats in the loader: unchanged
    bundle = build_data(bundled, **common, dp_rank=0, dp_degree=1, pin_memory=False, pixels_on_device=True)
    assert bundle.device_transforms == {} and next(iter(bundle.loader))["image"].dtype == torch.float32


def test_the_workers_keep_a_whole_step_of_microbatches_ready() -> None:
    """A step of k microbatches per rank: the workers prefetch k batches (at least PyTorch's two each, at
    most MAX_PREFETCH), so they load the next step while the current one computes (a 64-microbatch step
    on 14 workers otherwise waited for most of its data on the H100); no workers, no prefetching."""
    from titan_contrastive.config import parse_args
    from titan_contrastive.datasets import build_dataset
    from titan_contrastive.datasets.build import build_data

    common = dict(family_tokenizer=lambda: None, prepare=lambda ds: None, build_bundled=build_dataset)
    cases = ((3, 40, 1, 4), (3, 8, 1, 2), (2, 64, 2, 4), (1, 64, 1, 8), (0, 40, 1, None))  # 16 batches: at most 8
    for workers, global_batch, dp, factor in cases:
        cfg = parse_args(
            [
                "--data.dataset=synthetic",
                "--data.synthetic_samples=64",
                "--data.image_size=32",
                f"--data.num_workers={workers}",
                "--training.local_batch_size=4",
            ]
        )
        bundle = build_data(cfg, **common, dp_rank=0, dp_degree=dp, pin_memory=False, global_batch_size=global_batch)
        assert bundle.loader.dataloader.prefetch_factor == factor, (workers, global_batch, dp)
    assert next(iter(bundle.loader))["image"].shape == (4, 3, 32, 32)
