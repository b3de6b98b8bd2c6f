"""Every objective through the trainer's step kinds against its dense form over the whole batch
(the forms themselves are held to the definitions in tests/test_objectives.py): global negatives
(GA 4 x 2, stream chunks of 3; and on 2 gloo ranks) and GradCache (chunks of 3) give the loss and
every parameter gradient of the dense objective, for one-way + margin + Matryoshka, siglip +
relative mask, the pairwise loss + Matryoshka and GTE's joint directions + margin + hardness
weighting; an objective registered from a user module trains in both negatives modes."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.marks import slow_ones

TOL = 1e-10

TRAINER_OPTIONS = {
    "oneway-margin-matryoshka": [
        "--loss.symmetric=false",
        "--loss.mask_margin=0.0",
        "--loss.matryoshka_dims=16,8",
        "--loss.matryoshka_weights=1,0.5",
    ],
    "siglip-relative": ["--loss.name=siglip", "--loss.mask_relative=0.5"],
    "pairwise-matryoshka": ["--loss.name=pairwise", "--loss.matryoshka_dims=16,8"],
    "gte-margin-hardness": [
        "--loss.symmetric=false",
        "--loss.joint_directions=query_to_query,doc_to_query,doc_to_doc",
        "--loss.mask_margin=0.0",
        "--loss.hardness_strength=2",
    ],
}
STEP_KINDS = {
    "global": ["--loss.negatives=global", "--loss.stream_chunk_size=3"],
    "gradcache": ["--gradcache.enabled=true", "--gradcache.chunk_sizes=3"],
}


def _dense_reference(trainer, samples: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """The run's objective (from its [loss]) in its dense form over all `samples` at once, on a
    float64 copy of the model: the loss and every parameter gradient."""
    from tests.test_trainer import full, grads
    from titan_contrastive.losses import build_objective

    reference = trainer.spec.build_model(trainer.model_args).double()
    reference.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    out = reference(samples["image"].double(), samples["text"])
    objective = build_objective(trainer.cfg.loss)
    masked = objective.false_negatives.dense(out[0], out[1], None) if hasattr(objective, "false_negatives") else None
    assert masked is None or masked.any()  # the mask takes part
    loss = objective.dense(*out)
    loss.backward()
    return loss.item(), grads(reference)


def _trainer_step(tmp: str, option: str, kind: str, local: int, ga: int) -> None:
    """One step of the trainer (P ranks x GA microbatches of `local`) against the dense reference."""
    from tests.test_trainer import assert_close, batch, grads, make_trainer

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    trainer = make_trainer(
        tmp,
        f"--training.local_batch_size={local}",
        f"--training.global_batch_size={local * ga * world}",
        *STEP_KINDS[kind],
        *TRAINER_OPTIONS[option],
    )
    steps = [batch(trainer, j * local * world, local * world) for j in range(ga)]
    mine = [{k: v[rank * local : (rank + 1) * local] for k, v in s.items()} for s in steps]
    every = {k: torch.cat([s[k] for s in steps]) for k in steps[0]}
    want_loss, want = _dense_reference(trainer, every)
    out = trainer.train_step(mine)
    assert_close(grads(trainer.model), want)
    assert abs(out["loss"] - want_loss) <= TOL * abs(want_loss)


@pytest.mark.parametrize("kind", list(STEP_KINDS))
@pytest.mark.parametrize("option", list(TRAINER_OPTIONS))
def test_step_kinds_train_the_objective_exactly(tmp_path, option: str, kind: str) -> None:
    """Global negatives (GA 4 x 2, stream chunks of 3) and GradCache (one microbatch of 8 in chunks
    of 3): the loss and every parameter gradient equal the dense objective over the whole batch."""
    local, ga = (2, 4) if kind == "global" else (8, 1)
    _trainer_step(str(tmp_path), option, kind, local, ga)


def _trainer_step_distributed(tmp: str, option: str) -> None:
    dist.init_process_group("gloo")
    _trainer_step(tmp, option, "global", 3, 2)


# two of the options on two ranks by default, the other two (each on one process above) with the slow marker
@pytest.mark.parametrize("option", slow_ones(TRAINER_OPTIONS, ["oneway-margin-matryoshka", "siglip-relative"]))
def test_global_negatives_train_the_objective_exactly_on_two_ranks(tmp_path, option: str) -> None:
    run_distributed(_trainer_step_distributed, 2, str(tmp_path), option)


USER_OBJECTIVE = '''
import dataclasses
from titan_contrastive.losses import InfoNCE, StreamResult, register_objective


@dataclasses.dataclass(frozen=True)
class Doubled:
    """Twice InfoNCE: every form, and the gradients, doubled."""

    inner: InfoNCE
    name: str = "doubled"
    has_bias = False
    needs_ids = False
    init_logit_scale = InfoNCE.init_logit_scale
    init_logit_bias = None

    def describe(self):
        return "doubled " + self.inner.describe()

    def dense(self, q, docs, scale, bias=None, ids=None):
        return 2 * self.inner.dense(q, docs, scale, bias, ids)

    def microbatch(self, q, docs, scale, bias, ids, ranks):
        return 2 * self.inner.microbatch(q, docs, scale, bias, ids, ranks)

    def streamed(self, q_own, docs, scale, bias=None, **kwargs):
        r = self.inner.streamed(q_own, docs, scale, bias, **kwargs)
        return StreamResult(2 * r.loss, 2 * r.grad_rows, 2 * r.grad_cols, 2 * r.scale_rows, None)

    def fused(self, num_queries, num_columns):
        return False


register_objective("doubled", lambda loss, masking: Doubled(InfoNCE(loss.symmetric, masking)))
'''


@pytest.mark.parametrize("negatives", ["microbatch", "global"])
def test_an_objective_from_a_user_module_is_one_registry_line(tmp_path, monkeypatch, negatives: str) -> None:
    """`job.custom_import` loads a module that registers an objective; `[loss] name` picks it and
    the step kinds run it: the logged loss is twice clip's on the same model and batch."""
    import json
    import textwrap

    from tests.test_trainer import make_trainer
    from titan_contrastive import losses

    monkeypatch.setattr(losses, "OBJECTIVES", dict(losses.OBJECTIVES))
    (tmp_path / "user_objective.py").write_text(textwrap.dedent(USER_OBJECTIVE))
    monkeypatch.syspath_prepend(str(tmp_path))
    logged = {}
    monkeypatch.delitem(sys.modules, "user_objective", raising=False)  # imported afresh: it registers again
    for name in ("clip", "doubled"):
        run = tmp_path / name
        trainer = make_trainer(
            str(run),
            "--job.custom_import=user_objective",
            f"--loss.name={name}",
            f"--loss.negatives={negatives}",
            "--training.local_batch_size=4",
            "--training.global_batch_size=8",
            "--training.steps=1",
            "--metrics.log_freq=1",
            "--eval.enable=false",
        )
        trainer.train()
        trainer.metrics.close()
        logged[name] = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    sys.modules.pop("user_objective", None)
    assert abs(logged["doubled"] - 2 * logged["clip"]) <= TOL * logged["doubled"]
