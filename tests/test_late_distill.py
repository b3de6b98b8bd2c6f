"""Distillation under late interaction (`losses/distill.py` over `losses/late_interaction.py`'s MaxSim: PyLate's
Distillation and a ColBERT margin MSE): contrastive_weight x InfoNCE over MaxSim + weight x the term over each
query's own documents, each logit t MaxSim(q_i, d_j) (over query i's token count where normalized), written here
one pair at a time. Every form against it in float64 (<= 1e-10): dense, streamed with chunks that divide nothing,
the step's microbatch loss, on 1, 2 and 4 gloo processes; padded tokens on both sides; the KL with and without
PyLate's min-max scaling (also under a dot-product student); margin MSE; CoSENT."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import TWO_AND_FOUR, run_distributed
from tests.needs import needs
from tests.objective_forms import assert_distributed_forms, assert_forms, wanted
from tests.test_late_interaction import DIM, K, maxsim, problem
from tests.test_late_interaction import reference as late_reference
from tests.test_objectives import N, leaves
from tests.test_objectives import problem as dot_problem
from titan_contrastive.config import ConfigError, JobConfig
from titan_contrastive.losses import Distillation, Distilled, InfoNCE, build_objective
from titan_contrastive.losses.late_interaction import LateInteraction, late_interaction


def teacher_of(k: int, seed: int = 0) -> torch.Tensor:
    """A cross-encoder's logits, roughly: [N, 1 + k], the positive usually first; two rows tied, for CoSENT."""
    gen = torch.Generator().manual_seed(70 + seed)
    scores = 3 * torch.randn(N, 1 + k, generator=gen, dtype=torch.float64)
    scores[:, 0] += 2.0
    scores[5, 0] = scores[2, 0]
    return scores


def pair_logits(i: int, q, cols, scale, k: int, dim: int, normalize: bool) -> torch.Tensor:
    """Query i's logits over its own documents, its positive (column i) then its k hard negatives; `dim` 0 reads
    one vector per text (the dot product)."""
    own = [i, *range(len(q) + i * k, len(q) + (i + 1) * k)]
    if not dim:
        return torch.stack([scale * (q[i] @ cols[j]) for j in own])
    count = int((q[i].view(-1, dim) != 0).any(1).sum()) if normalize else 1
    return torch.stack([scale * maxsim(q[i], cols[j], dim) / count for j in own])


def reference_term(case: dict, q, p, n, scale, teacher, dim: int = DIM) -> torch.Tensor:
    """The distillation term from its definition, one query at a time (CoSENT: over every pair of the problem)."""
    cols, k = (p if n is None else torch.cat([p, n])), 0 if n is None else len(n) // len(q)
    rows = [pair_logits(i, q, cols, scale, k, dim, case["normalize"]) for i in range(len(q))]
    if case["kind"] == "cosent":
        s, t = torch.cat(rows), teacher.flatten()
        terms = [s[a] - s[b] for a in range(len(s)) for b in range(len(s)) if t[a] < t[b]]
        return torch.logsumexp(torch.stack([s.new_zeros(()), *terms]), 0)
    total = 0.0
    for i, logits in enumerate(rows):
        if case["kind"] == "margin_mse":
            margins = [(logits[0] - logits[j]) - (teacher[i, 0] - teacher[i, j]) for j in range(1, 1 + k)]
            total = total + sum(m**2 for m in margins) / k
            continue
        if case["minmax"]:
            logits = (logits - logits.min()) / (logits.max() - logits.min() + 1e-8)
        target = torch.softmax(teacher[i] / case["tau"], 0)
        log_student = logits - torch.logsumexp(logits, 0)
        total = total + sum(target[j] * (torch.log(target[j]) - log_student[j]) for j in range(1 + k))
    return total / len(q)


def _case(kind, w, cw, tau=1.0, k=K, minmax=False, normalize=False, symmetric=False) -> dict:
    name = f"{kind}-w{w}-cw{cw}-tau{tau}-k{k}{'-minmax' if minmax else ''}{'-norm' if normalize else ''}"
    return dict(kind=kind, w=w, cw=cw, tau=tau, k=k, minmax=minmax, normalize=normalize, symmetric=symmetric, name=name)


CASES = [
    _case("kl", 0.7, 1.0),
    _case("kl", 1.0, 0.0, minmax=True),  # PyLate's Distillation
    _case("kl", 0.5, 0.3, tau=2.0, minmax=True, normalize=True, symmetric=True),
    _case("margin_mse", 1.0, 0.0),
    _case("margin_mse", 0.7, 1.0, k=1, normalize=True),
    _case("cosent", 1.0, 0.0, k=0),
    _case("cosent", 0.5, 1.0, symmetric=True),
]


def objective_of(case: dict, dim: int = DIM) -> Distilled:
    distillation = Distillation(case["kind"], case["w"], case["tau"], minmax=case["minmax"])
    distilled = Distilled(InfoNCE(case["symmetric"]), distillation, case["cw"])
    return late_interaction(distilled, dim, case["normalize"]) if dim else distilled


def _want(case: dict, seed: int):
    problem_ = problem(case["k"], seed)
    teacher = teacher_of(case["k"], seed)
    rq, rp, rn, rs = leaves(*problem_[:4])
    loss = case["w"] * reference_term(case, rq, rp, rn, rs, teacher)
    if case["cw"]:
        loss = loss + case["cw"] * late_reference(rq, rp, rn, rs, case["symmetric"], normalize=case["normalize"])
    return problem_, teacher, (loss.detach(), *wanted(loss, rq, rp, rn, rs))


def test_the_terms_move_the_gradient() -> None:
    """Else a form that dropped the term, the min-max scaling or the normalization would pass: each variant's
    gradient of the queries is far from every other's."""
    q, p, n, scale, _, _ = problem(K)
    teacher = teacher_of(K)
    kl = _case("kl", 1.0, 0.0)
    grads = []
    for case in (kl, dict(kl, minmax=True), dict(kl, normalize=True), _case("margin_mse", 1, 0)):
        rq = q.clone().requires_grad_()
        grads.append(torch.autograd.grad(reference_term(case, rq, p, n, scale, teacher), rq)[0])
    assert min((a - b).norm() / a.norm() for i, a in enumerate(grads) for b in grads[i + 1 :]) > 0.1


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_every_form_matches_the_definition(case: dict) -> None:
    problem_, teacher, want = _want(case, 0)
    assert_forms(objective_of(case), problem_, want, teacher)


def test_minmax_under_a_dot_product_student() -> None:
    """The min-max scaling is the KL's, whatever scores the pairs: a single-vector student too."""
    case = _case("kl", 0.8, 0.0, tau=0.5, minmax=True)
    problem_ = dot_problem({"k": K}, 2)
    teacher = teacher_of(K, 2)
    rq, rp, rn, rs = leaves(*problem_[:4])
    loss = case["w"] * reference_term(case, rq, rp, rn, rs, teacher, dim=0)
    assert_forms(objective_of(case, dim=0), problem_, (loss.detach(), *wanted(loss, rq, rp, rn, rs)), teacher)


def _distributed() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for case in CASES:
        problem_, teacher, want = _want(case, 1)
        assert_distributed_forms(objective_of(case), problem_, want, case["name"], teacher)


@pytest.mark.parametrize("world", TWO_AND_FOUR)
def test_distributed_forms_match_the_definition(world: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_distributed(_distributed, world)


def test_late_interaction_keeps_the_term_and_refuses_what_reads_one_vector() -> None:
    kl = Distillation("kl", 0.5, minmax=True)
    converted = late_interaction(Distilled(InfoNCE(True), kl, 0.0), 8, normalize=True)
    assert converted == Distilled(LateInteraction(8, True, True), kl, 0.0)
    with pytest.raises(ValueError, match=r"^loss.teacher_model scores every column by one vector per text"):
        late_interaction(Distilled(InfoNCE(False), Distillation("kl", model="loss.teacher_model")), 8)
    with pytest.raises(ValueError, match=r"^loss.cosent_similarity=angle reads one vector per text"):
        late_interaction(Distilled(InfoNCE(False), Distillation("cosent", similarity="angle")), 8)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"distill_minmax": True}, r"^loss.distill_minmax=true scales .* loss.distill is empty: set loss.distill=kl"),
        (
            {"distill": "margin_mse", "distill_minmax": True},
            r"^loss.distill_minmax=true .* and loss.distill=margin_mse",
        ),
        (
            {"distill": "kl", "distill_minmax": True, "teacher_model": "some/folder"},
            r"^loss.distill_minmax=true .* and loss.teacher_model scores every column",
        ),
    ],
)
def test_minmax_refusals_name_the_field(overrides: dict, message: str) -> None:
    loss = JobConfig().loss
    for key, value in overrides.items():
        setattr(loss, key, value)
    with pytest.raises(ConfigError, match=message):
        build_objective(loss)


# ------------------------------------------------------------------ through the trainer: ColBERT on MiniLM

TRAINER_KINDS = {  # local batch, accumulation steps, options
    "accumulate-kl-minmax-alone": (
        6,
        1,
        ["--loss.distill=kl", "--loss.distill_minmax=true", "--loss.contrastive_weight=0"],
    ),
    "gradcache-margin-mse": (
        6,
        1,
        ["--gradcache.enabled=true", "--gradcache.chunk_sizes=4", "--loss.distill=margin_mse"],
    ),
    "global-kl-normalized": (
        3,
        2,
        [
            "--loss.negatives=global",
            "--loss.stream_chunk_size=5",
            "--loss.symmetric=false",
            "--loss.distill=kl",
            "--loss.distill_weight=0.5",
            "--loss.distill_temperature=2",
            "--loss.maxsim_normalize=true",
        ],
    ),
}
COLBERT = ["--model.pooling=colbert", "--model.colbert_dim=8", "--data.doc_context_length=12"]


def _trainer_reference(trainer, every: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """cw x InfoNCE over MaxSim + w x the term, from the definitions over all samples with their teacher scores, on a
    copy of the model in the trainer's mode."""
    from tests.test_trainer import full, grads
    from titan_contrastive.batching import TEACHER_SCORES, with_negatives
    from titan_contrastive.losses import split_documents

    loss_cfg = trainer.cfg.loss
    model = trainer.spec.build_model(trainer.model_args).double()
    model.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    model.train(trainer.model.training)
    q, d, scale = model(every["query"], with_negatives(every["doc"], every["neg"], model.pad_id))
    p, n = split_documents(d.reshape(len(q), 3, -1))
    case = _case(loss_cfg.distill, 1.0, 0.0, loss_cfg.distill_temperature, 2, loss_cfg.distill_minmax)
    case["normalize"] = loss_cfg.maxsim_normalize
    teacher = every[TEACHER_SCORES].double()
    loss = loss_cfg.distill_weight * reference_term(case, q, p, n, scale, teacher, dim=8)
    if loss_cfg.contrastive_weight:
        contrastive = late_reference(q, p, n, scale, loss_cfg.symmetric, 8, loss_cfg.maxsim_normalize)
        loss = loss + loss_cfg.contrastive_weight * contrastive
    loss.backward()
    return loss.item(), grads(model)


def _trainer_step(tmp, kind: str) -> None:
    from tests.test_hard_negatives import step_against

    trainer = step_against(tmp, TRAINER_KINDS[kind], *COLBERT, reference=_trainer_reference)
    assert "late interaction" in trainer.gradient_step.describe() and "distillation" in trainer.gradient_step.describe()


@needs("hf")
@pytest.mark.parametrize("kind", list(TRAINER_KINDS))
def test_every_step_kind_equals_the_definition(tmp_path: Path, kind: str) -> None:
    """MiniLM as ColBERT (a new 8-wide projection) on pairs with two hard negatives and a teacher's scores each."""
    from tests.test_distill_trainer import scored_pairs_file

    scored_pairs_file(tmp_path)
    _trainer_step(tmp_path, kind)


def _trainer_distributed(tmp: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    _trainer_step(Path(tmp), "global-kl-normalized")


@pytest.mark.slow  # the objective's forms on 1, 2 and 4 processes stay in the default suite
@needs("hf")
def test_global_negatives_on_two_ranks(tmp_path: Path) -> None:
    from tests.test_distill_trainer import scored_pairs_file

    scored_pairs_file(tmp_path)
    run_distributed(_trainer_distributed, 2, str(tmp_path))
