"""`data.in_batch_negatives` through the trainer: all-MiniLM-L6-v2 (float64) trains on two pairs files joined with
`::`, the second without in-batch negatives (FlagEmbedding's `no_in_batch_neg` file), so its queries are scored
against their own positive and two hard negatives only. Each step kind's loss and every parameter gradient equal the
objective's dense form over the whole batch with those queries flagged (<= 1e-10), with dropout off and on, and on
two gloo ranks; the data serves the flags by source; bad settings are one-line errors before any compute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.marks import slow_ones
from tests.needs import needs
from tests.test_hard_negatives import (
    WORDS,
    assert_step_equals_its_forwards,
    dense_reference,
    make_trainer,
    step_against,
)
from tests.test_trainer import make_trainer as base_trainer
from titan_contrastive.batching import OWN_GROUP
from titan_contrastive.config import ConfigError, parse_args
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.mixing import in_batch_per_source
from titan_contrastive.losses import InfoNCE, build_objective
from titan_contrastive.losses.base import own_documents_only
from titan_contrastive.steps import check_own_documents

FLAGS = "--data.in_batch_negatives=true,false"
KINDS = {  # local batch, accumulation steps, options
    "accumulate": (6, 1, []),
    "gradcache-oneway": (6, 1, ["--gradcache.enabled=true", "--gradcache.chunk_sizes=4", "--loss.symmetric=false"]),
    "gradcache-tokens-duplicates": (
        6,
        1,
        ["--gradcache.enabled=true", "--gradcache.chunk_tokens=60", "--loss.mask_duplicates=true"],
    ),
    "global-oneway": (3, 2, ["--loss.negatives=global", "--loss.stream_chunk_size=5", "--loss.symmetric=false"]),
    "global-siglip-margin": (
        3,
        2,
        ["--loss.negatives=global", "--loss.stream_chunk_size=5", "--loss.name=siglip", "--loss.mask_margin=0.0"],
    ),
}


def two_files(tmp: Path) -> str:
    """WORDS' first 3 rows in general.jsonl, the rest in classes.jsonl; `data.path` joining them."""
    for name, rows in (("general", WORDS[:3]), ("classes", WORDS[3:])):
        with open(tmp / f"{name}.jsonl", "w") as f:
            for query, pos, *negs in rows:
                f.write(
                    json.dumps({"query": query, "positive": pos, **{f"negative_{i}": n for i, n in enumerate(negs)}})
                )
                f.write("\n")
    return f"--data.path={tmp / 'general.jsonl'}::{tmp / 'classes.jsonl'}"


def flagged_reference(trainer, samples: dict):
    """The dense reference with the flags, after checking they change it (else a step ignoring them would pass)."""
    assert samples[OWN_GROUP].any() and not samples[OWN_GROUP].all()
    loss, want = dense_reference(trainer, samples)
    unflagged, _ = dense_reference(trainer, {k: v for k, v in samples.items() if k != OWN_GROUP})
    assert abs(loss - unflagged) > 1e-3 * loss
    return loss, want


@needs("hf")
@pytest.mark.parametrize("kind", slow_ones(KINDS, ["gradcache-oneway"]))  # one-way: global-oneway by default
def test_queries_without_in_batch_negatives_in_every_step_kind_exactly(tmp_path: Path, kind: str) -> None:
    trainer = step_against(tmp_path, KINDS[kind], two_files(tmp_path), FLAGS, reference=flagged_reference)
    assert trainer.train_set.__getitems__(list(range(12)))[OWN_GROUP].tolist() == [False] * 3 + [True] * 9


def _step_distributed(tmp: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    step_against(Path(tmp), KINDS["global-oneway"], two_files(Path(tmp)), FLAGS, reference=flagged_reference)


@needs("hf")
@pytest.mark.slow  # 17 s; the objectives' forms run on 2 and 4 processes in test_own_documents.py
def test_queries_without_in_batch_negatives_on_two_ranks(tmp_path: Path) -> None:
    """FSDP2 on 2 gloo processes: each rank's flags are gathered into the global problem's."""
    run_distributed(_step_distributed, 2, str(tmp_path))


@needs("hf")
def test_queries_without_in_batch_negatives_with_dropout_on(tmp_path: Path) -> None:
    """GradCache chunks of 5 with MiniLM's dropout on: each chunk's replayed dropout, the flagged problem exact."""
    trainer = make_trainer(
        tmp_path,
        two_files(tmp_path),
        FLAGS,
        "--training.local_batch_size=12",
        "--training.global_batch_size=12",
        "--gradcache.enabled=true",
        "--gradcache.chunk_sizes=5",
    )
    assert trainer.model.training
    batch = trainer.train_set.__getitems__(list(range(12)))
    chunks = trainer.step_context.split(batch, 5)
    objective = own_documents_only(InfoNCE(), batch[OWN_GROUP])
    assert_step_equals_its_forwards(trainer, [batch], chunks, seed=5, objective=objective)
    trainer.metrics.close()


@needs("hf")
def test_in_batch_negatives_settings_are_one_line_errors(tmp_path: Path) -> None:
    path, sizes = two_files(tmp_path), ["--training.local_batch_size=6", "--training.global_batch_size=6"]
    for options, message in [
        (["--data.in_batch_negatives=false"], r"1 value\(s\) for the 2 source\(s\) in data.path"),
        ([FLAGS, "--data.hard_negatives=false"], "data.hard_negatives=false serves none: set data.hard_negatives=true"),
        (
            [FLAGS, "--loss.name=pairwise"],
            "loss.name='pairwise' ranks each query against the other queries' positives: use clip",
        ),
        (
            [FLAGS, "--loss.symmetric=false", "--loss.joint_directions=query_to_query"],
            r"loss.joint_directions=\['query_to_query'\] adds the other queries and documents",
        ),
    ]:
        with pytest.raises((ConfigError, DataError), match=message) as err:
            make_trainer(tmp_path, path, *sizes, *options)
        assert "\n" not in str(err.value)
        assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*.distcp"))
    bare = tmp_path / "bare.jsonl"
    bare.write_text("".join(json.dumps({"query": q, "positive": p}) + "\n" for q, p, *_ in WORDS))
    with pytest.raises(DataError, match="serves none .* give those rows hard negatives"):
        make_trainer(tmp_path, f"--data.path={bare}::{bare}", FLAGS)
    with pytest.raises(DataError, match="a query without in-batch negatives is scored against its own hard negatives"):
        base_trainer(str(tmp_path / "csv"), "--data.dataset=synthetic", "--data.in_batch_negatives=false")


def test_a_teacher_of_every_column_and_a_family_s_own_loss_are_refused() -> None:
    cfg = parse_args([FLAGS, "--loss.teacher_embeddings=teacher.safetensors", "--loss.distill=kl"])
    objective = build_objective(cfg.loss)
    with pytest.raises(ConfigError, match="loss.teacher_embeddings distills over every column of the batch"):
        check_own_documents(cfg, objective, objective.inner)
    with pytest.raises(ConfigError, match="the family computes its own loss"):
        check_own_documents(parse_args([FLAGS]), None, None)


def test_a_file_named_as_flagembedding_s_no_in_batch_neg_files_is_pointed_out(caplog) -> None:
    parts = ["retrieval.jsonl", "data/amazon_no_in_batch_neg.jsonl"]
    with caplog.at_level("WARNING", logger="titan_contrastive"):
        assert in_batch_per_source([], parts) == [True, True]
        assert in_batch_per_source([True, False], parts) == [True, False]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith("data/amazon_no_in_batch_neg.jsonl is named as FlagEmbedding names the files")
    assert "data.in_batch_negatives=[] leaves them to its queries: give this source false" in warning
