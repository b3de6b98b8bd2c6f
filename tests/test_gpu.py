"""CUDA checks; skipped cleanly on machines without a GPU (CI never has one)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from titan_contrastive.config import parse_args
from titan_contrastive.train import Trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_trains_and_evaluates_on_cuda(tmp_path: Path) -> None:
    trainer = Trainer(parse_args([
        "--training.device=cuda", "--training.steps=3", "--training.local_batch_size=64",
        "--training.global_batch_size=128", "--metrics.log_freq=1", f"--job.dump_folder={tmp_path}",
    ]))
    assert next(trainer.model.parameters()).is_cuda
    result = trainer.train()
    assert math.isfinite(result["loss"]) and 0.0 <= result["zero_shot_top1"] <= 1.0
    assert torch.cuda.max_memory_allocated() > 0
    trainer.metrics.close()


def test_bfloat16_selective_ac_compile_on_cuda(tmp_path: Path) -> None:
    """The issue-3 GPU stack on one device: bf16 autocast + selective AC + inductor per block."""
    trainer = Trainer(parse_args([
        "--training.device=cuda", "--training.steps=3", "--training.local_batch_size=64", "--eval.enable=false",
        "--training.mixed_precision_param=bfloat16", "--activation_checkpoint.mode=selective", "--compile.enable=true",
        "--metrics.log_freq=1", "--metrics.enable_tensorboard=false", f"--job.dump_folder={tmp_path}",
    ]))
    trainer.train()
    trainer.metrics.close()
    losses = [line for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"train"' in line]
    assert len(losses) == 3 and all("NaN" not in line and "Infinity" not in line for line in losses)


def test_cuda_rng_state_round_trip() -> None:
    from titan_contrastive.components.train_state import RNGState

    state = RNGState("cuda")
    saved = state.state_dict()
    assert "cuda" in saved
    first = torch.rand(4, device="cuda")
    state.load_state_dict(saved)
    assert torch.equal(torch.rand(4, device="cuda"), first)
