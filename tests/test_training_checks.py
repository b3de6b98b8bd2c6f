"""What a run checks about its own settings before and while it trains: the logit scale (a fixed one
is kept as set, a learned one clamped; an init out of range is one line), a contrastive problem of
one pair, a warmup longer than the run, and `model.init_from` on resume (not read: the checkpoint's
weights replace it, so a requeued job whose staged weights are gone still resumes).

The trainer in this process (`train.main`, `Trainer`), clip/debug, a step or two each.
"""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path

import pytest
import torch

from titan_contrastive.config import ConfigError, parse_args
from titan_contrastive.config.manager import log_config_warnings
from titan_contrastive.train import Trainer, main

TINY = [
    "--training.local_batch_size=8",
    "--eval.enable=false",
    "--metrics.enable_tensorboard=false",
    "--metrics.log_freq=1",
]


def run(dump: Path, *args: str) -> int:
    given = {arg.split("=", 1)[0] for arg in args}  # a key in both: args' value, given once
    return main([f"--job.dump_folder={dump}", *(arg for arg in TINY if arg.split("=", 1)[0] not in given), *args])


def one_error_line(capsys: pytest.CaptureFixture) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


# ------------------------------------------------------------------ the logit scale


def test_a_fixed_logit_scale_above_the_clamp_is_kept_and_a_learned_one_clamped(tmp_path: Path) -> None:
    """learn_logit_scale=false, init 5 (temperature 148.4) used to be clamped to log 100 from step 1 on."""
    trainer = Trainer(
        parse_args(
            [
                f"--job.dump_folder={tmp_path / 'fixed'}",
                *TINY,
                "--training.steps=2",
                "--loss.learn_logit_scale=false",
                "--loss.init_logit_scale=5",
            ]
        )
    )
    trainer.train()
    trainer.metrics.close()
    assert trainer.model.logit_scale.item() == 5.0
    learned = Trainer(parse_args([f"--job.dump_folder={tmp_path / 'learned'}", *TINY, "--training.steps=1"]))
    with torch.no_grad():
        learned.model.logit_scale.fill_(6.0)  # past the clamp, as a large lr could take it
    learned.train()
    learned.metrics.close()
    assert learned.model.logit_scale.item() == pytest.approx(math.log(100.0))


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--loss.init_logit_scale=5"],
            "loss.init_logit_scale=5.0 is out of range for a learned scale: expected a number in [0, 4.6052] "
            "(the clamp applied after every step, temperature exp(t') <= 100); to train at exp(5.0) = 148.4 "
            "set loss.learn_logit_scale=false",
        ),
        (["--loss.init_logit_scale=-1"], "loss.init_logit_scale=-1.0 is out of range for a learned scale"),
        (
            ["--loss.init_logit_scale=100", "--loss.learn_logit_scale=false"],
            "loss.init_logit_scale=100.0 is out of range: expected a number in [-9.2103, 9.2103] (a fixed temperature "
            "exp(t') between 1e-4 and 1e4; beyond, the logits overflow float16 or no longer tell pairs apart)",
        ),
    ],
)
def test_init_logit_scale_out_of_range_is_one_line(args: list[str], message: str) -> None:
    """An init of 100 used to fail only at step 1, as a non-finite loss advising a lower lr."""
    with pytest.raises(ConfigError) as error:
        parse_args(args)
    assert str(error.value) == message or str(error.value).startswith(message)
    assert parse_args(["--loss.init_logit_scale=5", "--loss.learn_logit_scale=false"]).loss.init_logit_scale == 5.0


# ------------------------------------------------------------------ batch and schedule


def test_a_contrastive_problem_of_one_pair_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """local_batch_size=1 on one process: the clip loss and its gradient were exactly 0, silently."""
    assert run(tmp_path, "--training.steps=2", "--training.local_batch_size=1") == 2
    line = one_error_line(capsys)
    assert (
        "training.local_batch_size=1 with loss.negatives=microbatch on 1 process: each contrastive problem holds one "
        "pair, whose loss and gradient carry no negatives (clip: exactly 0); raise training.local_batch_size"
    ) in line
    assert not (tmp_path / "metrics.jsonl").exists()
    # one problem over the global batch of 4: fine
    assert (
        run(
            tmp_path,
            "--training.steps=1",
            "--training.local_batch_size=1",
            "--training.global_batch_size=4",
            "--loss.negatives=global",
        )
        == 0
    )


def test_warmup_longer_than_the_run_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A warning, not an error: a smoke run of a config (--training.steps=2, warmup 20) is legitimate."""
    with caplog.at_level(logging.INFO, logger="titan_contrastive"):
        assert run(tmp_path, "--training.steps=2", "--lr_scheduler.warmup_steps=20") == 0
    assert (
        "warning: lr_scheduler.warmup_steps=20 >= training.steps=2: the lr rises for the whole run, reaching 0.095 x "
        "optimizer.lr at the last step, and never decays"
    ) in caplog.text
    assert log_config_warnings(parse_args(["--training.steps=21", "--lr_scheduler.warmup_steps=20"])) == []


# ------------------------------------------------------------------ init_from on resume


def test_resume_does_not_read_init_from(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A requeued job whose staged init weights are gone used to fail (exit 2) re-reading them, and
    an init_from changed on resume was logged as 'applied'."""
    assert run(tmp_path / "pretrain", "--training.steps=1", "--checkpoint.enable=true") == 0
    staged = tmp_path / "staged" / "step-1"
    shutil.copytree(tmp_path / "pretrain" / "checkpoint" / "step-1", staged)
    job = [f"--model.init_from={staged}", "--checkpoint.enable=true", "--checkpoint.interval=1"]
    assert run(tmp_path / "run", "--training.steps=1", *job) == 0
    shutil.rmtree(tmp_path / "staged")
    with caplog.at_level(logging.INFO, logger="titan_contrastive"):
        assert run(tmp_path / "run", "--training.steps=2", *job) == 0
    assert "resumed from checkpoint step-1" in caplog.text
    assert f"model.init_from='{staged}' not read: resuming checkpoint step-1, whose weights replace it" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="titan_contrastive"):
        assert run(tmp_path / "run", "--training.steps=3", *job[1:], "--model.init_from=elsewhere/step-9") == 0
    assert f"(changed since step-2: '{staged}' -> 'elsewhere/step-9'; not applied)" in caplog.text
    assert "applied: model.init_from" not in caplog.text
