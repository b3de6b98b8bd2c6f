"""`[eval] patience` (`components/early_stopping.py`): the run stops once checkpoint.keep_best's metric has gone
`patience` evaluations without improving by more than `patience_threshold`.

- the count: higher is better, lower for a *loss metric, an improvement must beat the threshold, a NaN never
  improves, a metric the evaluation lacks is keep_best's one-line error, the state round-trips; on 2 gloo processes
  an improvement one rank sees counts on both;
- through the trainer: the run stops at the evaluation that exhausts the patience, saves that step and logs it; the
  count is checkpointed (a resumed run goes on counting; one resumed where it stopped trains no further), and a
  checkpoint written without the count (a run without patience) resumes with a fresh one, while a checkpoint lacking
  any other state is still refused;
- one-line config errors.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.test_trainer import make_trainer
from titan_contrastive.checkpoint import CheckpointError
from titan_contrastive.components.early_stopping import EarlyStopping
from titan_contrastive.config import ConfigError, parse_args


@pytest.mark.parametrize(
    ("metric", "threshold", "values", "stops_at"),
    [
        ("r@1", 0.0, [0.3, 0.5, 0.5, 0.4, 0.9], 4),  # a tie does not improve: 2 evaluations after step 2
        ("r@1", 0.1, [0.3, 0.45, 0.5, 0.5, 0.9], 4),  # +0.15 improves, +0.05 is not more than the threshold
        ("loss", 0.0, [2.0, 1.5, 1.6, 1.4, 1.7, 1.8], 6),  # lower is better
        ("loss", 0.0, [math.nan, 2.0, math.nan, math.nan], 4),  # a NaN never improves, even first
    ],
)
def test_the_count(metric: str, threshold: float, values: list[float], stops_at: int) -> None:
    stop = EarlyStopping(metric, 2, threshold)
    decided = [stop.update(step, {metric: value, "other": 1.0}) for step, value in enumerate(values[:stops_at], 1)]
    assert decided == [False] * (stops_at - 1) + [True] and stop.stopped and stop.waited == 2
    again = EarlyStopping(metric, 2, threshold)
    again.load_state_dict(stop.state_dict())
    assert again.state_dict() == stop.state_dict() and again.stopped


def test_the_best_and_its_step_are_kept() -> None:
    stop = EarlyStopping("loss", 3)
    for step, value in ((2, 5.0), (4, 3.0), (6, 4.0)):
        assert not stop.update(step, {"loss": value})
    assert stop.state_dict() == {"best": 3.0, "best_step": 4, "waited": 1}


def test_a_metric_the_evaluation_lacks_is_one_line() -> None:
    with pytest.raises(CheckpointError) as err:
        EarlyStopping("beir/ndcg@10", 2).update(1, {"loss": 1.0, "r@1": 0.5})
    assert str(err.value) == (
        "checkpoint.keep_best='beir/ndcg@10' is not a metric of this run's evaluation (loss, r@1); set "
        "checkpoint.keep_best to one of them"
    )


def _ranks_agree() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    stop = EarlyStopping("r@1", 1)
    stop.update(1, {"r@1": 0.5})
    assert not stop.update(2, {"r@1": 0.6 if rank == 0 else 0.5})  # rank 0 improved: both count it
    assert stop.waited == 0 and stop.best_step == 2
    assert stop.update(3, {"r@1": 0.1})
    dist.destroy_process_group()


def test_two_processes_count_alike() -> None:
    run_distributed(_ranks_agree, 2)


def _run(dump: Path, *extra: str):
    return make_trainer(
        str(dump),
        "--data.dataset=emoji",
        "--eval.batch_size=64",
        "--training.steps=12",
        "--optimizer.lr=0.05",
        "--checkpoint.enable=true",
        "--checkpoint.folder=ckpt",
        "--checkpoint.interval=4",
        "--eval.freq=1",
        "--checkpoint.keep_best=loss",
        *extra,
    )


def _evals(dump: Path) -> list[int]:
    records = map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())
    return [r["step"] for r in records if r["kind"] == "eval"]


def test_the_trainer_stops_saves_and_resumes_the_count(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dump, never = tmp_path / "run", "--eval.patience_threshold=1e9"  # no later evaluation improves on the first
    trainer = _run(dump, "--eval.patience=2", never)
    with caplog.at_level(logging.INFO, logger="titan_contrastive"):
        trainer.train()
    trainer.metrics.close()
    assert trainer.step == 3 and _evals(dump) == [1, 2, 3]
    assert sorted(p.name for p in (dump / "ckpt").glob("step-*")) == ["step-3"]  # not due, saved as the last
    assert "early stop after step 3: eval loss has not improved on" in caplog.text
    assert "(step 1) by more than 1e+09 in 2 evaluation(s) (eval.patience=2)" in caplog.text

    again = _run(dump, "--eval.patience=2", never)  # resumed where it stopped: evaluates, trains nothing
    again.train()
    again.metrics.close()
    assert again.step == 3 and again.patience.state_dict()["waited"] == 2

    longer = _run(dump, "--eval.patience=4", never)  # the count goes on: 2 more evaluations
    longer.train()
    longer.metrics.close()
    assert longer.step == 5 and longer.patience.state_dict()["best_step"] == 1


def test_a_checkpoint_without_the_count_resumes_with_a_fresh_one(tmp_path: Path) -> None:
    from titan_contrastive.checkpoint import reader

    dump = tmp_path / "run"
    first = _run(dump, "--training.steps=4")
    first.train()
    first.metrics.close()
    resumed = _run(dump, "--eval.patience=1", "--eval.patience_threshold=1e9")
    assert resumed.step == 4 and resumed.patience.state_dict() == {"best": math.nan, "best_step": 0, "waited": 0}
    resumed.train()
    resumed.metrics.close()
    assert resumed.step == 6 and resumed.patience.state_dict()["best_step"] == 5
    folder = dump / "ckpt" / "step-4"
    manifest = json.loads((folder / "manifest.json").read_text())
    lacking = {"train_state": {"step": 0, "never_saved": 0}}
    with pytest.raises(
        CheckpointError, match=r"RuntimeError: Missing key in checkpoint state_dict: train_state.never_saved"
    ):
        reader.load(lacking, folder, manifest, optional=("early_stopping",))
    state = {"train_state": {"step": 0}, "early_stopping": {"waited": torch.tensor(7)}}
    reader.load(state, folder, manifest, optional=("early_stopping",))
    assert state["train_state"]["step"] == 4 and int(state["early_stopping"]["waited"]) == 7  # its own value stays


def test_for_run_reads_the_config() -> None:
    cfg = parse_args(
        ["--checkpoint.enable=true", "--checkpoint.keep_best=loss", "--eval.freq=10", "--data.dataset=emoji"]
    )
    assert EarlyStopping.for_run(cfg) is None
    cfg.eval.patience, cfg.eval.patience_threshold = 3, 0.01
    stop = EarlyStopping.for_run(cfg)
    assert (stop.ranking.metric, stop.patience, stop.threshold) == ("loss", 3, 0.01)
    assert EarlyStopping.for_run(SimpleNamespace(eval=SimpleNamespace(patience=0))) is None


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["--eval.patience=3"],
            "eval.patience=3 stops the run when checkpoint.keep_best's metric stops improving, and",
        ),
        (["--eval.patience_threshold=0.01"], "eval.patience_threshold=0.01 with eval.patience=0: set eval.patience"),
        (["--eval.patience=-1"], "eval.patience"),
        (["--eval.patience=2", "--eval.patience_threshold=-0.1"], "eval.patience_threshold"),
    ],
)
def test_config_errors(args: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_args(["--data.dataset=emoji", *args])
    assert len(str(err.value).splitlines()) == 1 and needle in str(err.value), str(err.value)
