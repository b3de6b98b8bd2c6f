"""The learning-rate schedule: warmup, the stable phase of warmup-stable-decay (`decay_ratio`) and each decay
shape, against values written out from the definition; a stable run branched into its decay on resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from titan_contrastive.components.lr_scheduler import build_lr_scheduler
from titan_contrastive.config import ConfigError, parse_args
from titan_contrastive.config.manager import log_config_warnings
from titan_contrastive.train import main

TINY = [
    "--training.local_batch_size=16",
    "--eval.enable=false",
    "--metrics.log_freq=1",
    "--metrics.enable_tensorboard=false",
    "--checkpoint.enable=true",
    "--checkpoint.interval=4",
    "--checkpoint.keep_latest_k=0",
    "--lr_scheduler.warmup_steps=2",
    "--optimizer.lr=1e-3",
]


def lrs(*args: str, steps: int) -> list[float]:
    """The lr of each of `steps` optimizer steps, from the scheduler the trainer builds for `args`."""
    cfg = parse_args([f"--training.steps={steps}", *args])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, steps)
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"] / 2.0)
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize(
    "decay_type, middle",
    [("linear", [2 / 3, 1 / 3]), ("sqrt", [1 - math.sqrt(1 / 3), 1 - math.sqrt(2 / 3)]), ("cosine", [0.75, 0.25])],
)
def test_warmup_stable_decay_by_shape(decay_type: str, middle: list[float]) -> None:
    """Warmup 2 of 10 steps, decay_ratio 0.4: (s+1)/3 rising, the peak held to step 6, then 4 decay steps from
    1 to 0.1 (min_lr_factor) over progress 0, 1/3, 2/3, 1."""
    got = lrs(
        "--lr_scheduler.warmup_steps=2",
        f"--lr_scheduler.decay_type={decay_type}",
        "--lr_scheduler.decay_ratio=0.4",
        "--lr_scheduler.min_lr_factor=0.1",
        steps=10,
    )
    want = [1 / 3, 2 / 3, 1, 1, 1, 1, 1, *(0.1 + 0.9 * m for m in middle), 0.1]
    assert got == pytest.approx(want, abs=1e-12)


def test_without_decay_ratio_the_decay_starts_at_the_end_of_warmup() -> None:
    """sqrt over 1 + 4 steps after a warmup of 1: 1 - sqrt(p) at p = 0, 1/4, 1/2, 3/4, 1."""
    got = lrs("--lr_scheduler.warmup_steps=1", "--lr_scheduler.decay_type=sqrt", steps=6)
    assert got == pytest.approx([0.5, *(1 - math.sqrt(p / 4) for p in range(5))], abs=1e-12)


def test_a_decay_longer_than_the_run_after_warmup_starts_at_warmup(caplog: pytest.LogCaptureFixture) -> None:
    """decay_ratio 0.9 of 10 steps would start decaying at step 1, inside a warmup of 3: it starts at step 3,
    with a warning; a ratio that leaves a stable phase warns nothing."""
    args = ["--lr_scheduler.warmup_steps=3", "--lr_scheduler.decay_type=linear", "--lr_scheduler.decay_ratio=0.9"]
    assert lrs(*args, steps=10) == pytest.approx([0.25, 0.5, 0.75, *(1 - p / 6 for p in range(7))], abs=1e-12)
    (line,) = log_config_warnings(parse_args(["--training.steps=10", *args]))
    assert line.startswith("lr_scheduler.decay_ratio=0.9 over training.steps=10 asks for 9 decay steps")
    assert log_config_warnings(parse_args(["--training.steps=10", *args[:2], "--lr_scheduler.decay_ratio=0.5"])) == []


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lr_scheduler.decay_ratio=0"], "lr_scheduler.decay_ratio=0.0 is out of range: expected a number in (0, 1]"),
        (["--lr_scheduler.decay_ratio=1.5"], "lr_scheduler.decay_ratio=1.5 is out of range"),
        (
            ["--lr_scheduler.decay_ratio=0.2", "--lr_scheduler.decay_type=none"],
            "lr_scheduler.decay_ratio=0.2 with lr_scheduler.decay_type='none': nothing decays",
        ),
    ],
)
def test_bad_decay_ratio_is_one_line(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        parse_args(args)


def test_a_stable_run_branches_into_its_decay_on_resume(tmp_path: Path) -> None:
    """4 steps at the peak after warmup (decay_type none), checkpointed; resumed to 8 steps with decay_ratio 0.5:
    the 8 logged lrs are those of one 8-step warmup-stable-decay run, written out."""

    def run(*args: str) -> int:
        return main([f"--job.dump_folder={tmp_path}", *TINY, *args])

    assert run("--training.steps=4", "--lr_scheduler.decay_type=none") == 0
    assert run("--training.steps=8", "--lr_scheduler.decay_type=linear", "--lr_scheduler.decay_ratio=0.5") == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["lr"] for r in records if r["kind"] == "train"}
    want = [1 / 3, 2 / 3, 1, 1, 1, 2 / 3, 1 / 3, 0]
    assert [logged[s] for s in range(1, 9)] == pytest.approx([1e-3 * w for w in want], abs=1e-15)
