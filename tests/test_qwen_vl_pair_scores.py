"""What a vl_pairs query (qwen_vl, a tiny random Qwen2-VL) is scored against beyond its batch: a file without
in-batch negatives (`data.in_batch_negatives`: its queries against their own documents only) and a teacher's scores
of each row's documents (`doc_scores`, drawn with the negatives, for `loss.distill`); each through GradCache against
the objective's dense form in float64, and the errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.needs import require
from tests.test_hard_negatives import assert_grads_close
from tests.test_hf_text import grads
from tests.test_qwen_vl import REL, _dense, _embeddings, vl_run
from tests.test_qwen_vl_pairs import _vl_pairs
from tests.test_trainer import full
from titan_contrastive.config import ConfigError
from titan_contrastive.datasets.base import DataError

require("hf")


def test_a_vl_pairs_file_without_in_batch_negatives_trains_exactly(tmp_path: Path) -> None:
    """Two joined t2t files with two text negatives per row, the second without in-batch negatives: its
    queries are flagged and scored against their own documents only; GradCache equals the definition."""
    from titan_contrastive.batching import OWN_GROUP

    first, second = _vl_pairs(tmp_path / "a", negatives="text", count=3), _vl_pairs(tmp_path / "b", negatives="text")
    trainer = vl_run(
        tmp_path,
        "qwen2_vl",
        "--data.dataset=vl_pairs",
        f"--data.path={first}::{second}",
        "--data.in_batch_negatives=true,false",
        "--data.retrieval_mode=t2t",
        "--training.local_batch_size=7",
        "--gradcache.enabled=true",
        "--gradcache.chunk_sizes=4",
        sizes=(),
    )
    trainer.model.eval()
    batch = trainer.train_set.__getitems__(list(range(7)))
    batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    assert batch[OWN_GROUP].tolist() == [False] * 3 + [True] * 4
    trainer.train_step([batch])
    want_loss, want = _dense(trainer, [batch])
    unflagged, _ = _dense(trainer, [{k: v for k, v in batch.items() if k != OWN_GROUP}])
    assert abs(want_loss - unflagged) > 1e-3 * want_loss
    trainer.model.zero_grad()
    out = trainer.train_step([batch])
    assert_grads_close(grads(trainer.model), want)
    assert abs(out["loss"] - want_loss) <= REL * want_loss
    trainer.metrics.close()


def test_vl_pairs_teacher_scores_follow_the_draw_and_distil_exactly(tmp_path: Path) -> None:
    """`doc_scores` (the document's, then each of `doc_negatives'`) with 2 of 3 negatives drawn per epoch: the
    served scores are the drawn documents', and InfoNCE + KL distillation under GradCache equals the objective's
    dense form with those scores as the teacher, in float64."""
    import json

    from titan_contrastive.batching import TEACHER_SCORES
    from titan_contrastive.losses import build_objective

    table = _vl_pairs(tmp_path / "data", negatives="text")
    rows = [json.loads(line) for line in table.read_text().splitlines()]
    for i, row in enumerate(rows):
        row["doc_negatives"].append(f"a third negative {i}")
        row["doc_scores"] = [3.0 + 0.1 * i, 1.0, -0.5 - 0.1 * i, 0.2 * i]
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trainer = vl_run(
        tmp_path,
        "qwen2_vl",
        "--data.dataset=vl_pairs",
        f"--data.path={table}",
        "--data.retrieval_mode=t2t",
        "--data.negatives_per_row=2",
        "--loss.distill=kl",
        "--loss.distill_weight=0.5",
        "--training.local_batch_size=7",
        "--gradcache.enabled=true",
        "--gradcache.chunk_sizes=4",
        sizes=(),
    )
    trainer.model.eval()
    data = trainer.train_set
    for epoch in (0, 1):
        data.set_epoch(epoch)
        served = data.__getitems__(list(range(7)))[TEACHER_SCORES]
        for j in range(7):
            scores = rows[j]["doc_scores"]
            want = [scores[0]] + [scores[1 + p] for p in data.drawn(0, j)[1]]
            assert served[j].tolist() == pytest.approx(want), (epoch, j)
    data.set_epoch(0)
    batch = {k: v for k, v in data.__getitems__(list(range(7))).items() if isinstance(v, torch.Tensor)}
    trainer.train_step([batch])  # LoRA's B leaves zero
    model = trainer.spec.build_model(trainer.model_args).double()
    model.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    model.eval()
    q, d = _embeddings(model, batch)
    objective = build_objective(trainer.cfg.loss).with_teacher(batch[TEACHER_SCORES].double())
    want_loss = objective.dense(q, d, model.logit_scale.exp())
    want_loss.backward()
    out = trainer.train_step([batch])
    assert_grads_close(grads(trainer.model), grads(model))
    assert abs(out["loss"] - want_loss.item()) <= REL * want_loss.item()
    trainer.metrics.close()


def test_vl_pairs_teacher_scores_are_refused_where_they_cannot_be_read(tmp_path: Path) -> None:
    """A file without doc_scores and CoSENT are one-line errors; a row whose scores are not one finite number per
    document is a bad sample, substituted and counted."""
    import json

    from titan_contrastive.datasets.bad_samples import BAD_SAMPLES

    table = _vl_pairs(tmp_path / "data", negatives="text")
    for extra, message in [
        ((), "loss.distill reads a teacher's scores of each row's documents from a doc_scores column"),
        (("--loss.distill=cosent",), "loss.distill='cosent' ranks scored text pairs"),
    ]:
        with pytest.raises((DataError, ConfigError), match=message):
            vl_run(tmp_path, "qwen2_vl", "--data.dataset=vl_pairs", f"--data.path={table}",
                   "--data.retrieval_mode=t2t", "--loss.distill=kl", *extra, sizes=())  # fmt: skip
    rows = [json.loads(line) for line in table.read_text().splitlines()]
    for i, row in enumerate(rows):
        row["doc_scores"] = [1.0, 0.5] if i == 2 else [1.0, 0.5, float(i)]
    scored = tmp_path / "data" / "scored.jsonl"
    scored.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trainer = vl_run(
        tmp_path / "scored", "qwen2_vl", "--data.dataset=vl_pairs", f"--data.path={scored}",
        "--data.retrieval_mode=t2t", "--loss.distill=kl", "--training.local_batch_size=4", sizes=(),
    )  # fmt: skip
    batch = trainer.train_set.__getitems__([2])
    (bad,) = batch[BAD_SAMPLES]
    assert bad.reason == "bad_scores" and batch["teacher_scores"].tolist() == [[1.0, 0.5, 3.0]]  # row 3's
    trainer.metrics.close()
