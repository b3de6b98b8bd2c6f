"""Distillation from a teacher's scores through the trainer (`[loss] distill`): all-MiniLM-L6-v2
trains on a pairs file with two hard negatives per row and a `label` column of teacher scores.
Each step kind's loss and every parameter gradient equal the distilled objective's dense form over
the whole batch with the teacher's scores of those rows (float64, <= 1e-10), with dropout off and
on; the scores read from every file format and as margins; bad scores and settings are one-line
errors before any step."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.needs import needs, require
from tests.test_hard_negatives import (
    REL,
    WORDS,
    assert_grads_close,
    assert_step_equals_its_forwards,
    dense_reference,
    make_trainer,
    pairs_file,
)
from tests.test_trainer import full, grads
from titan_contrastive.batching import TEACHER_SCORES, with_negatives
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.pair_rows import read_rows
from titan_contrastive.losses import build_objective, split_documents
from titan_contrastive.losses.base import columns
from titan_contrastive.losses.guide import Guide


def scores(i: int) -> list[float]:
    """Row i's teacher scores: the positive usually first, one row where a negative outranks it."""
    return [4.0 - 0.25 * i, 1.0 + 0.5 * (i % 3), (6.0 if i == 4 else -1.0) - 0.1 * i]


def scored_pairs_file(tmp: Path, column: str = "label") -> Path:
    path = tmp / "pairs.jsonl"
    with open(path, "w") as f:
        for i, (query, pos, *negs) in enumerate(WORDS):
            row = {"query": query, "positive": pos, **{f"negative_{j}": n for j, n in enumerate(negs)}}
            f.write(json.dumps({**row, column: scores(i)}) + "\n")
    return path


KINDS = {  # local batch, accumulation steps, options
    "accumulate-kl": (6, 1, ["--loss.distill=kl", "--loss.distill_weight=0.5"]),
    "gradcache-margin-mse-alone": (
        6,
        1,
        [
            "--gradcache.enabled=true",
            "--gradcache.chunk_sizes=4",
            "--loss.distill=margin_mse",
            "--loss.contrastive_weight=0",
        ],
    ),
    "global-kl-matryoshka-mask": (
        3,
        2,
        [
            "--loss.negatives=global",
            "--loss.stream_chunk_size=5",
            "--loss.symmetric=false",
            "--loss.mask_margin=0.0",
            "--loss.matryoshka_dims=384,64",
            "--loss.distill=kl",
            "--loss.distill_temperature=2",
            "--loss.contrastive_weight=0.3",
        ],
    ),
}


def _step(tmp: Path, kind: str) -> None:
    """One step of `kind` (dropout off) against the dense reference with the teacher's scores; P
    ranks x GA microbatches."""
    local, ga, extra = KINDS[kind]
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    trainer = make_trainer(
        tmp, f"--training.local_batch_size={local}", f"--training.global_batch_size={local * ga * world}", *extra
    )
    assert "distillation" in trainer.gradient_step.describe()
    trainer.model.eval()
    data = trainer.train_set
    steps = [data.__getitems__(list(range(j * local * world, (j + 1) * local * world))) for j in range(ga)]
    mine = [{k: v[rank * local : (rank + 1) * local] for k, v in s.items()} for s in steps]
    every = {k: torch.cat([s[k] for s in steps]) for k in steps[0]}
    want_scores = torch.tensor([scores(i) for i in range(len(every["query"]))], dtype=torch.float32)
    assert torch.equal(every[TEACHER_SCORES], want_scores)
    want_loss, want = dense_reference(trainer, every, teacher=every[TEACHER_SCORES].double())
    out = trainer.train_step(mine)
    assert_grads_close(grads(trainer.model), want)
    assert abs(out["loss"] - want_loss) <= REL * want_loss
    trainer.metrics.close()


@needs("hf")
@pytest.mark.parametrize("kind", list(KINDS))
def test_distillation_in_every_step_kind_equals_the_dense_objective(tmp_path: Path, kind: str) -> None:
    scored_pairs_file(tmp_path)
    _step(tmp_path, kind)


@needs("hf")
def test_distillation_under_gradcache_with_dropout_on(tmp_path: Path) -> None:
    """The chunks' dropout masks replayed: the step equals the distilled objective over the same forwards."""
    scored_pairs_file(tmp_path)
    trainer = make_trainer(
        tmp_path, "--training.local_batch_size=7", "--gradcache.enabled=true", "--gradcache.chunk_sizes=3",
        "--loss.distill=margin_mse", "--loss.symmetric=false",
    )  # fmt: skip
    trainer.model.train()
    batch = trainer.train_set.__getitems__(list(range(7)))
    objective = build_objective(trainer.cfg.loss).with_teacher(batch[TEACHER_SCORES].double())
    assert_step_equals_its_forwards(trainer, [batch], trainer.step_context.split(batch, 3), seed=3, objective=objective)


@needs("hf")
def test_a_distilled_run_trains_logs_and_evaluates_on_its_own_scored_file(tmp_path: Path) -> None:
    """Two global-negatives steps and the evaluation on the same scored file held out (its scores left
    unread there: evaluation's loss is the contrastive objective's, on the positives)."""
    path = scored_pairs_file(tmp_path, column="scores")
    trainer = make_trainer(
        tmp_path, "--training.local_batch_size=6", "--training.steps=2", "--loss.negatives=global",
        "--loss.distill=margin_mse", "--eval.enable=true", f"--data.val_path={path}", "--eval.batch_size=5",
        "--metrics.log_freq=1",
    )  # fmt: skip
    assert trainer.eval_objective.describe() == "clip loss (InfoNCE, symmetric)"
    trainer.train()
    trainer.metrics.close()
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in logged if row["kind"] == "train"]
    (evaluated,) = [row for row in logged if row["kind"] == "eval"]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert evaluated["num_samples"] == len(WORDS) and 0 <= evaluated["query_to_doc_r@1"] <= 1


MODEL_KINDS = {  # local batch, accumulation steps, options (the teacher model given by the test)
    "accumulate-kl-no-negatives-own-mask": (  # the margin mask on the model's own cosines: the teacher only teaches
        6,
        1,
        ["--data.hard_negatives=false", "--loss.distill_temperature=0.05", "--loss.mask_margin=-0.3"],
    ),
    "gradcache-kl-alone": (
        6,
        1,
        [
            "--gradcache.enabled=true",
            "--gradcache.chunk_sizes=4",
            "--loss.contrastive_weight=0",
            "--loss.symmetric=false",
        ],
    ),
    "global-kl-guide-matryoshka": (  # the same frozen model guides the masks and teaches
        3,
        2,
        [
            "--loss.negatives=global",
            "--loss.stream_chunk_size=5",
            "--loss.symmetric=false",
            "--loss.mask_margin=-0.05",
            "--loss.matryoshka_dims=384,64",
            "--loss.distill_temperature=0.1",
            "--loss.guide_model=<teacher>",
        ],
    ),
}


def taught_reference(trainer, samples: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """The dense objective over all samples at once, its KL targets the frozen teacher's cosines of
    them over every column (and its masks the same model's, when it also guides)."""
    model = trainer.spec.build_model(trainer.model_args).double()
    model.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    model.train(trainer.model.training)
    docs = with_negatives(samples["doc"], samples["neg"], model.pad_id) if "neg" in samples else samples["doc"]
    q, d, scale = model(samples["query"], docs)
    width = len(d) // len(q)
    cols = columns(*split_documents(d.reshape(len(q), width, -1)))
    with torch.no_grad():
        gq, gd = trainer.step_context.guide(samples["query"], docs)[:2]
    teacher = Guide(gq, columns(*split_documents(gd.reshape(len(q), width, -1))))
    objective = build_objective(trainer.cfg.loss).with_teacher(teacher)
    objective = objective.with_guide(teacher) if trainer.cfg.loss.guide_model else objective
    if trainer.cfg.loss.mask_margin is not None and not trainer.cfg.loss.guide_model:  # the model's own mask ...
        masking = objective.inner.false_negatives
        by_model, by_teacher = masking.dense(q, cols, None), masking.guided(teacher).dense(q, cols, None)
        assert by_model.any() and (by_model != by_teacher).any()  # ... which the teacher's would not be
    loss = objective.dense(q, cols, scale)
    loss.backward()
    return loss.item(), grads(model)


@needs("hf")
@pytest.mark.parametrize("kind", list(MODEL_KINDS))
def test_a_teacher_models_kl_in_every_step_kind_equals_the_dense_objective(
    tmp_path: Path, guide_dir: Path, kind: str
) -> None:
    """all-MiniLM-L6-v2 taught by a perturbed MiniLM over every column (no scores in the data)."""
    pairs_file(tmp_path)
    local, ga, extra = MODEL_KINDS[kind]
    trainer = make_trainer(
        tmp_path,
        f"--training.local_batch_size={local}",
        f"--training.global_batch_size={local * ga}",
        "--loss.distill=kl",
        f"--loss.teacher_model={guide_dir}",
        *[flag.replace("<teacher>", str(guide_dir)) for flag in extra],
    )
    assert "the frozen teacher's cosines" in trainer.gradient_step.describe()
    assert "over every column" in trainer.gradient_step.describe()
    trainer.model.eval()
    steps = [trainer.train_set.__getitems__(list(range(j * local, (j + 1) * local))) for j in range(ga)]
    assert TEACHER_SCORES not in steps[0]
    every = {k: torch.cat([s[k] for s in steps]) for k in steps[0]}
    want_loss, want = taught_reference(trainer, every)
    out = trainer.train_step(steps)
    assert_grads_close(grads(trainer.model), want)
    assert abs(out["loss"] - want_loss) <= REL * want_loss
    trainer.metrics.close()


@needs("hf")
def test_a_teacher_model_is_refused_where_it_cannot_work(tmp_path: Path, guide_dir: Path) -> None:
    from tests.test_trainer import make_trainer as clip_trainer
    from titan_contrastive.config import ConfigError

    pairs_file(tmp_path)
    batch = ("--training.local_batch_size=6", "--training.global_batch_size=6")
    teacher = f"--loss.teacher_model={guide_dir}"
    with pytest.raises(ConfigError, match=r"loss.teacher_model=.* loss.distill is empty: set loss.distill=kl"):
        make_trainer(tmp_path, teacher)
    with pytest.raises(ConfigError, match=r"loss.distill=margin_mse reads the data.s scores"):
        make_trainer(tmp_path, teacher, "--loss.distill=margin_mse")
    with pytest.raises(ConfigError, match=r"a run holds one frozen model; give both the same folder"):
        make_trainer(
            tmp_path, *batch, teacher, "--loss.distill=kl", f"--loss.guide_model={tmp_path}", "--loss.mask_margin=0"
        )
    with pytest.raises(ConfigError, match=r"loss.teacher_model=.* model_type='bert'; only CLIP models .* load here"):
        clip_trainer(str(tmp_path / "clip"), teacher, "--loss.distill=kl")  # a clip run's teacher is a CLIP
    with pytest.raises(ConfigError, match=r"loss.teacher_model=.* the vlm family takes no frozen guide or teacher"):
        clip_trainer(str(tmp_path / "vlm"), "--model.name=vlm", "--data.dataset=emoji", teacher, "--loss.distill=kl")
    own = "--loss.distill_temperature=0"  # a text embedder keeps no temperature of its own; the data's scores neither
    with pytest.raises(
        ConfigError, match=rf"^loss.distill_temperature=0 .* loss.teacher_model='{guide_dir}' keeps none"
    ):
        make_trainer(tmp_path, *batch, teacher, "--loss.distill=kl", own)
    with pytest.raises(ConfigError, match=r"^loss.distill_temperature=0 .* reads the data's scores, which have none"):
        make_trainer(tmp_path, *batch, "--loss.distill=kl", own)


def _step_distributed(tmp: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    _step(Path(tmp), "global-kl-matryoshka-mask")


@needs("hf")
@pytest.mark.slow  # ~15 s; the objective's forms run on 2 and 4 processes in test_distill.py
def test_distillation_under_global_negatives_on_two_ranks(tmp_path: Path) -> None:
    """FSDP2 on 2 gloo processes: each rank's teacher scores are gathered into the global problem's."""
    scored_pairs_file(tmp_path)
    run_distributed(_step_distributed, 2, str(tmp_path))


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_teacher_scores_from_every_format_and_as_margins(tmp_path: Path, fmt: str) -> None:
    rows = [dict(query=q, positive=p, negative=n, score=[3.0, 1.5]) for q, p, n, _ in WORDS[:4]]
    rows[1]["score"] = [1.0]  # neither 1 + k scores nor (for kl) k margins: a bad row
    path = tmp_path / f"pairs.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "csv":
        lines = ["query,positive,negative,score"] + [
            f'{r["query"]},{r["positive"]},{r["negative"]},"{r["score"]}"' for r in rows
        ]
        path.write_text("\n".join(lines) + "\n")
    else:
        require("data")
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    got = read_rows(str(path), max_bad_fraction=0.5, teacher="kl")
    assert got.scores == [[3.0, 1.5]] * 3 and got.skipped == {"bad_scores": 1}
    assert [r[0] for r in got.texts] == [WORDS[i][0] for i in (0, 2, 3)]
    margins = read_rows(str(path), max_bad_fraction=0.5, teacher="margin_mse")  # one number: the margin T_0 - T_1
    assert margins.scores[1] == [0.0, -1.0] and margins.skipped == {}


def test_bad_teacher_data_is_a_clear_error(tmp_path: Path) -> None:
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps(dict(query="q", positive="p", negative="n")) + "\n")
    with pytest.raises(DataError, match=r"loss.distill=kl: .* label, labels, score or scores, or .* \(found: none\)"):
        read_rows(str(plain), teacher="kl")
    both = tmp_path / "both.jsonl"
    both.write_text(json.dumps(dict(query="q", positive="p", negative="n", label=[1, 0], score=[1, 0])) + "\n")
    with pytest.raises(DataError, match=r"\(found: label, score\)"):
        read_rows(str(both), teacher="kl")
    scored = tmp_path / "scored.jsonl"
    scored.write_text(json.dumps(dict(query="q", positive="p", negative="n", label=1.0)) + "\n")
    with pytest.raises(DataError, match="scored pairs train with loss.distill=cosent"):
        read_rows(str(scored))  # one number per row: a scored pair's label
    scored.write_text(json.dumps(dict(query="q", positive="p", negative="n", label=[1, 0])) + "\n")
    assert read_rows(str(scored)) == ([["q", "p", "n"]], None, None, {}, None, None)  # a teacher's list, left unread
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps(dict(query="q", positive="p", negative="n", label="[1, 0]")) + "\n")
    assert read_rows(str(text), teacher="kl").scores == [[1.0, 0.0]]
    for bad in ("[1, NaN]", "[1, true]", "high"):
        text.write_text(json.dumps(dict(query="q", positive="p", negative="n", label=bad)) + "\n")
        with pytest.raises(DataError, match="bad_scores"):
            read_rows(str(text), teacher="kl")


@needs("hf")
@pytest.mark.parametrize(
    "options, match",
    [
        (["--data.hard_negatives=false"], "data.hard_negatives=false serves none"),
        (["--data.dataset=wordnet"], "data.dataset='wordnet' does not serve"),
    ],
)
def test_distillation_settings_the_data_cannot_serve_are_refused(tmp_path: Path, options, match) -> None:
    scored_pairs_file(tmp_path)
    with pytest.raises(DataError, match=match):
        make_trainer(tmp_path, "--loss.distill=kl", *options)


@needs("hf")
def test_rows_without_hard_negatives_are_refused(tmp_path: Path) -> None:
    (tmp_path / "pairs.jsonl").write_text(
        "".join(json.dumps(dict(query=q, positive=p, label=[1.0])) + "\n" for q, p, *_ in WORDS)
    )
    with pytest.raises(DataError, match="the rows hold none"):
        make_trainer(tmp_path, "--loss.distill=kl")
