"""The trainer's side of an evaluation set's tests (`[eval] *_path`, `components/*_eval.py`): a short run of the tiny
encoder folder that evaluates the set after every step and keeps the best checkpoint by one of its metrics, and the
one-line refusal of that keep_best in a run without the set."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.test_hf_text import folder_run

FLAGS = ["--training.local_batch_size=6", "--training.steps=2", "--eval.enable=true", "--eval.freq=1"]
FLAGS += ["--checkpoint.enable=true", "--checkpoint.interval=1"]


def keep_best_run(tmp_path: Path, key: str, path: Path | str, metric: str, *extra: str) -> list[dict[str, Any]]:
    """The evaluation records (those holding `metric`) of a 2-step run (`test_hf_text.folder_run`) with
    `--eval.{key}={path}` and `checkpoint.keep_best={metric}`; asserts there are two, that best.json names the metric
    and one of the steps, and that the same keep_best without the set is keep_best's one-line ConfigError naming
    `eval.{key}`."""
    from titan_contrastive.config import ConfigError

    flags = [*FLAGS, f"--checkpoint.keep_best={metric}"]
    trainer = folder_run(tmp_path, "encoder", *flags, f"--eval.{key}={path}", *extra)
    trainer.train()
    trainer.metrics.close()
    dump = tmp_path / "run-encoder"
    evals = [r for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines()) if metric in r]
    best = json.loads((dump / "checkpoint" / "best.json").read_text())
    assert len(evals) == 2 and best["metric"] == metric and best["step"] in (1, 2), (evals, best)
    refusal = rf"^checkpoint.keep_best={re.escape(repr(metric))} is an? [\w ]+ metric and eval.{key} is empty; set it$"
    with pytest.raises(ConfigError, match=refusal):
        folder_run(tmp_path / "without-the-set", "encoder", *flags, "--eval.beir_path=bundled")
    return evals
