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
