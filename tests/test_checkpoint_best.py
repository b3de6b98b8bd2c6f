"""`[checkpoint] keep_best` (`checkpoint/best.py`): the best checkpoint by an eval metric.

- the manager: each save at an evaluated step records the evaluation in its manifest; pruning to
  keep_latest_k spares the best (higher is better, lower for a *loss metric, ties to the earlier
  step, a NaN never); best.json names it, follows a rewind and a restart (read back from the
  manifests, no state of its own), on 2 gloo processes as on one; a metric the evaluation lacks is
  a one-line error before anything is written;
- through the trainer: the manifests hold the very records metrics.jsonl logged at those steps,
  best.json names the best of them, and the kept folders are the latest and the best;
- one-line config errors: no checkpoints or no eval, eval.freq not dividing the interval, nothing
  to evaluate, a BEIR metric without a BEIR folder.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.test_checkpoint import Cfg, make_run
from tests.test_trainer import make_trainer
from titan_contrastive.checkpoint import MANIFEST, CheckpointError
from titan_contrastive.checkpoint.best import BEST_FILE
from titan_contrastive.config import ConfigError, parse_args


def _best(dump: Path) -> dict:
    return json.loads((dump / "ckpt" / BEST_FILE).read_text())


def _kept(dump: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (dump / "ckpt").glob("step-*"))


@pytest.mark.parametrize(
    ("metric", "values", "best_step"),
    [
        ("r@1", [0.3, 0.7, 0.5, 0.7, 0.1], 2),  # the tie at step 4 goes to step 2
        ("loss", [float("nan"), 2.0, 1.5, 1.5, 3.0], 3),  # lower is better; a NaN never wins, even first
        ("r@1", [0.1, 0.2, 0.3, 0.4, 0.5], 5),  # the latest is the best: nothing extra kept
    ],
)
def test_pruning_spares_the_best_and_best_json_names_it(
    tmp_path: Path, metric: str, values: list[float], best_step: int
) -> None:
    run = make_run(tmp_path, Cfg(interval=1, keep_latest_k=1, keep_best=metric))
    for step, value in enumerate(values, start=1):
        run.train_state.step = step
        run.manager.save(step, evaluation={metric: value, "other": -value, "num_samples": 10})
        manifest = json.loads((tmp_path / "ckpt" / f"step-{step}" / MANIFEST).read_text())
        recorded = manifest["eval"]
        assert recorded.keys() == {metric, "other", "num_samples"}
        assert recorded[metric] == value or (math.isnan(value) and math.isnan(recorded[metric]))
        scored = [(s, v) for s, v in enumerate(values[:step], start=1) if not math.isnan(v)]
        if not scored:  # no checkpoint has a number yet: no best, nothing kept beyond the latest
            assert not (tmp_path / "ckpt" / BEST_FILE).exists() and _kept(tmp_path) == [step]
            continue
        pick = (min if metric == "loss" else max)(v for _, v in scored)
        want = next(s for s, v in scored if v == pick)  # the earliest of the best
        assert _best(tmp_path) == {
            "metric": metric,
            "step": want,
            "value": pick,
            "path": str(tmp_path / "ckpt" / f"step-{want}"),
        }
        assert _kept(tmp_path) == sorted({want, step})
    assert _best(tmp_path)["step"] == best_step


def test_best_follows_a_rewind_and_a_restart(tmp_path: Path) -> None:
    run = make_run(tmp_path, Cfg(interval=1, keep_latest_k=0, keep_best="r@1"))
    for step, value in ((1, 0.2), (2, 0.9), (3, 0.4)):
        run.train_state.step = step
        run.manager.save(step, evaluation={"r@1": value})
    run.manager.save(4)  # a save without an evaluation (a stop signal's) is no candidate
    assert "eval" not in json.loads((tmp_path / "ckpt" / "step-4" / MANIFEST).read_text())
    assert _best(tmp_path)["step"] == 2
    restarted = make_run(tmp_path, Cfg(interval=1, keep_latest_k=0, keep_best="r@1"))
    restarted.manager.save(5, evaluation={"r@1": 0.5})  # below step 2's, which a new manager reads back
    assert _best(tmp_path)["step"] == 2
    rewound = make_run(tmp_path, Cfg(interval=1, keep_latest_k=0, keep_best="r@1", load_step=1))
    assert rewound.manager.load() == 1
    assert _kept(tmp_path) == [1] and _best(tmp_path)["step"] == 1  # steps 2-5 were set aside
    rewound = make_run(tmp_path, Cfg(interval=1, keep_latest_k=0, keep_best="loss"))
    rewound.manager.save(2)
    assert not (tmp_path / "ckpt" / BEST_FILE).exists()  # no checkpoint records a loss


def _save_scored(tmp: str) -> None:
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    run = make_run(Path(tmp), Cfg(interval=1, keep_latest_k=1, keep_best="r@1"), rank=rank, dp_degree=2, fsdp=True)
    for step, value in ((1, 0.4), (2, 0.8), (3, 0.6)):
        run.train_state.step = step
        run.manager.save(step, evaluation={"r@1": value})  # every rank evaluates to the same numbers
    torch.distributed.destroy_process_group()


def test_two_processes_keep_the_best(tmp_path: Path) -> None:
    run_distributed(_save_scored, 2, str(tmp_path))
    assert _kept(tmp_path) == [2, 3] and _best(tmp_path)["step"] == 2
    manifest = json.loads((tmp_path / "ckpt" / "step-2" / MANIFEST).read_text())
    assert manifest["world_size"] == 2 and manifest["eval"] == {"r@1": 0.8}


def test_a_metric_the_evaluation_lacks_is_one_line_before_the_save(tmp_path: Path) -> None:
    run = make_run(tmp_path, Cfg(interval=1, keep_best="beir/ndcg@10"))
    with pytest.raises(CheckpointError) as err:
        run.manager.save(1, evaluation={"loss": 1.0, "image_to_text_r@1": 0.5})
    message = str(err.value)
    assert len(message.splitlines()) == 1
    assert "checkpoint.keep_best='beir/ndcg@10' is not a metric of this run's evaluation" in message
    assert "(image_to_text_r@1, loss)" in message
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_trainer_records_its_evaluations_and_keeps_the_best(tmp_path: Path) -> None:
    dump = tmp_path / "run"
    trainer = make_trainer(
        str(dump),
        "--data.dataset=emoji",
        "--eval.batch_size=64",
        "--training.steps=6",
        "--optimizer.lr=0.05",
        "--checkpoint.enable=true",
        "--checkpoint.folder=ckpt",
        "--checkpoint.interval=2",
        "--checkpoint.keep_latest_k=1",
        "--eval.freq=1",
        "--checkpoint.keep_best=loss",
    )
    trainer.train()
    trainer.metrics.close()
    evals = {
        r["step"]: r for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "eval"
    }
    assert sorted(evals) == [1, 2, 3, 4, 5, 6]
    for step in _kept(dump):
        recorded = json.loads((dump / "ckpt" / f"step-{step}" / MANIFEST).read_text())["eval"]
        assert recorded == {k: v for k, v in evals[step].items() if k not in ("kind", "step")}
    best = min((2, 4, 6), key=lambda s: (evals[s]["loss"], s))  # checkpointed steps only
    assert _best(dump)["step"] == best and _best(dump)["value"] == evals[best]["loss"]
    assert _kept(dump) == sorted({best, 6})


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--checkpoint.keep_best=loss", "--eval.freq=100"], "set checkpoint.enable=true and eval.enable=true"),
        (
            ["--checkpoint.enable=true", "--checkpoint.keep_best=loss", "--checkpoint.interval=100", "--eval.freq=30"],
            "eval.freq=30 does not divide checkpoint.interval=100: set eval.freq=100",
        ),
        (
            ["--checkpoint.enable=true", "--checkpoint.keep_best=loss", "--checkpoint.interval=100"],
            "eval.freq=0 does not divide",
        ),
        (
            ["--checkpoint.enable=true", "--checkpoint.keep_best=loss", "--eval.freq=100", "--data.dataset=csv"],
            "this run evaluates nothing; set data.val_path",
        ),
        (
            ["--checkpoint.enable=true", "--checkpoint.keep_best=beir/ndcg@10", "--eval.freq=100"],
            "is a BEIR metric and eval.beir_path is empty",
        ),
    ],
)
def test_config_errors(args: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_args(args)
    assert len(str(err.value).splitlines()) == 1 and needle in str(err.value), str(err.value)
