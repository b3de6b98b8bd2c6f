"""Distillation from a teacher's scores (`losses/distill.py`): contrastive_weight x the objective +
weight x (KL to the teacher's softmax, or margin MSE) over each query's own documents, in every form.
Each form against a reference written from the definition one query at a time (plus the contrastive
reference of tests/test_objectives.py), in float64 (<= 1e-10): dense, streamed with chunks that divide
nothing, the microbatch loss; streamed and microbatch on 2 and 4 gloo processes (the teacher's scores
gathered from every rank's local rows)."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import TWO_AND_FOUR, run_distributed
from tests.test_guide import guide_of
from tests.test_objectives import CASES, N, _close, leaves, objective_of, problem, reference
from titan_contrastive.config import ConfigError, JobConfig
from titan_contrastive.losses import Distillation, Distilled, Matryoshka, MicrobatchLoss, Ranks, build_objective
from titan_contrastive.losses.guide import Guide


def teacher_of(k: int, seed: int = 0) -> torch.Tensor:
    """A cross-encoder's logits, roughly: [N, 1 + k], the positive usually but not always first."""
    gen = torch.Generator().manual_seed(50 + seed)
    scores = 3 * torch.randn(N, 1 + k, generator=gen, dtype=torch.float64)
    scores[:, 0] += 2.0
    return scores


def reference_term(kind: str, tau: float, q, p, n, scale, teacher) -> torch.Tensor:
    """The distillation term from its definition, one query at a time."""
    k = len(n) // len(q)
    total = 0.0
    for i in range(len(q)):
        logits = torch.stack([scale * (q[i] @ d) for d in [p[i], *n[i * k : (i + 1) * k]]])
        if kind == "kl":
            target = torch.softmax(teacher[i] / tau, 0)
            log_student = logits - torch.logsumexp(logits, 0)
            total = total + sum(target[j] * (torch.log(target[j]) - log_student[j]) for j in range(1 + k))
        else:
            margins = [(logits[0] - logits[j]) - (teacher[i, 0] - teacher[i, j]) for j in range(1, 1 + k)]
            total = total + sum(m**2 for m in margins) / k
    return total / len(q)


def reference_total(case: dict, dcase: dict, q, p, n, scale, bias, ids, teacher) -> torch.Tensor:
    """cw x the contrastive reference + w x the term, at each Matryoshka prefix by its weight."""
    total = dcase["cw"] * reference(case, q, p, n, scale, bias, ids) if dcase["cw"] else 0.0
    for m, w in case["matryoshka"] or [(q.shape[1], 1.0)]:
        qm, pm, nm = (F.normalize(z[:, :m], dim=1) if case["matryoshka"] else z for z in (q, p, n))
        total = total + w * dcase["w"] * reference_term(dcase["kind"], dcase["tau"], qm, pm, nm, scale, teacher)
    return total


def distilled_of(case: dict, dcase: dict):
    inner = objective_of(dict(case, matryoshka=None))
    objective = Distilled(inner, Distillation(dcase["kind"], dcase["w"], dcase["tau"]), dcase["cw"])
    if case["matryoshka"]:
        dims, weights = zip(*case["matryoshka"])
        objective = Matryoshka(objective, dims, weights)
    return objective


BASE = {c["name"]: c for c in CASES}
DCASES = [  # the contrastive objective, the term, its weight, the objective's weight, tau, hard negatives
    ("clip-oneway-k2-none-full", "kl", 0.7, 1.0, 1.0, 2),
    ("clip-oneway-k2-none-full", "kl", 1.0, 0.0, 0.5, 2),
    ("clip-oneway-k2-none-full", "margin_mse", 0.7, 1.0, 1.0, 2),
    ("clip-oneway-k2-none-full", "margin_mse", 1.0, 0.0, 1.0, 1),
    ("clip-sym-k2-all-full", "kl", 0.5, 0.3, 2.0, 2),
    ("clip-sym-k2-margin-mat", "margin_mse", 0.2, 1.0, 1.0, 2),
    ("clip-oneway-k2-margin-mat", "kl", 1.0, 0.0, 1.0, 2),
    ("siglip-sym-k2-relative-full", "kl", 0.7, 1.0, 1.0, 2),
    ("siglip-sym-k2-none-full", "margin_mse", 1.0, 0.0, 1.0, 2),
    ("clip-gte-k2-all-full", "kl", 0.7, 1.0, 1.0, 2),
    ("clip-oneway-hard-all-k2-all-full", "margin_mse", 0.7, 1.0, 1.0, 1),
]


def _dcase(name, kind, w, cw, tau, k) -> tuple[dict, dict]:
    case = dict(BASE[name], k=k)
    return case, dict(kind=kind, w=w, cw=cw, tau=tau, name=f"{name}-{kind}-w{w}-cw{cw}-tau{tau}-k{k}")


PAIRS = [_dcase(*d) for d in DCASES]


def test_the_cases_exist_and_the_term_moves_the_loss() -> None:
    """Else a form that dropped the term (or the objective) would pass."""
    case, dcase = PAIRS[0]
    q, p, n, scale, bias, ids = problem(case)
    term = reference_term("kl", 1.0, q, p, n, scale, teacher_of(2))
    assert term > 0.05 and abs(reference_term("margin_mse", 1.0, q, p, n, scale, teacher_of(2))) > 0.05
    assert reference_term("kl", 1.0, q, p, n, scale, teacher_of(2, seed=1)) != term


@pytest.mark.parametrize("pair", PAIRS, ids=[d["name"] for _, d in PAIRS])
def test_dense_streamed_and_microbatch_match_the_definition(pair) -> None:
    case, dcase = pair
    q, p, n, scale, bias, ids = problem(case)
    teacher = teacher_of(case["k"])
    rq, rp, rn, rs, rb = leaves(q, p, n, scale, bias)
    want_loss = reference_total(case, dcase, rq, rp, rn, rs, rb, ids, teacher)
    want_q, want_p, want_n, want_s = torch.autograd.grad(want_loss, (rq, rp, rn, rs))
    objective = distilled_of(case, dcase).with_teacher(teacher)
    cols, want_cols = torch.cat([p, n]), torch.cat([want_p, want_n])
    b = bias if objective.has_bias else None

    dq, dcols, ds = leaves(q, cols, scale)
    loss = objective.dense(dq, dcols, ds, b, ids)
    loss.backward()
    _close(loss.detach(), want_loss.detach(), "dense loss")
    _close(dq.grad, want_q, "dense dq")
    _close(dcols.grad, want_cols, "dense dD")
    _close(ds.grad, want_s, "dense ds")

    for chunk in (5, 7, N):
        out = objective.streamed(q, cols, scale, b, first_row=0, num_queries=N, chunk=chunk, ranks=Ranks(None), ids=ids)
        _close(out.loss, want_loss.detach(), f"streamed loss, chunk {chunk}")
        _close(out.grad_rows, want_q, f"streamed dq, chunk {chunk}")
        _close(out.grad_cols, want_cols, f"streamed dD, chunk {chunk}")
        _close(out.scale_rows.sum(), want_s, f"streamed ds, chunk {chunk}")

    # the step's loss function: documents per sample [N, 1 + k, d], the teacher's scores per sample
    k = case["k"]
    mq, ms, mb = leaves(q, scale, bias)
    mdocs = torch.cat([p[:, None], n.view(N, k, -1)], 1).requires_grad_()
    local_ids = torch.cat([ids[:N, None], ids[N:].view(N, k)], 1)
    loss = MicrobatchLoss(distilled_of(case, dcase))(
        mq, mdocs, ms, mb if objective.has_bias else None, ids=local_ids, teacher=teacher
    )
    loss.backward()
    _close(loss.detach(), want_loss.detach(), "microbatch loss")
    _close(mq.grad, want_q, "microbatch dq")
    _close(mdocs.grad[:, 0], want_p, "microbatch dp")
    _close(mdocs.grad[:, 1:].flatten(0, 1), want_n, "microbatch dn")


def _distributed(names: list[str]) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    ranks = Ranks(dist.group.WORLD)
    for case, dcase in (pair for pair in PAIRS if pair[1]["name"] in names):
        q, p, n, scale, bias, ids = problem(case, seed=1)
        teacher = teacher_of(case["k"], seed=1)
        rq, rp, rn, rs, rb = leaves(q, p, n, scale, bias)
        want_loss = reference_total(case, dcase, rq, rp, rn, rs, rb, ids, teacher)
        want_q, want_p, want_n = torch.autograd.grad(want_loss, (rq, rp, rn))
        c, k = N // world, case["k"]
        own, own_neg = slice(rank * c, (rank + 1) * c), slice(rank * c * k, (rank + 1) * c * k)
        objective = distilled_of(case, dcase)
        b = bias if objective.has_bias else None

        gathered = ranks.gather(teacher[own])  # as the global-negatives step binds it
        out = objective.with_teacher(gathered).streamed(
            q[own], torch.cat([p, n]), scale, b, first_row=own.start, num_queries=N, chunk=3, ranks=ranks, ids=ids
        )
        _close(out.loss, want_loss.detach(), f"{dcase['name']} streamed loss")
        _close(out.grad_rows, want_q[own], f"{dcase['name']} streamed dq")
        shares = out.grad_cols.clone()
        dist.all_reduce(shares)
        _close(shares, torch.cat([want_p, want_n]), f"{dcase['name']} streamed dD")

        lq, ls, lb = leaves(q[own], scale, bias)
        ldocs = torch.cat([p[own, None], n[own_neg].view(c, k, -1)], 1).clone().requires_grad_()
        local_ids = torch.cat([ids[:N][own, None], ids[N:][own_neg].view(c, k)], 1)
        loss = MicrobatchLoss(objective, dist.group.WORLD)(
            lq, ldocs, ls, lb if objective.has_bias else None, ids=local_ids, teacher=teacher[own]
        )
        loss.backward()
        _close(loss.detach(), want_loss.detach(), f"{dcase['name']} microbatch loss")
        _close(lq.grad / world, want_q[own], f"{dcase['name']} microbatch dq")
        _close(ldocs.grad[:, 0] / world, want_p[own], f"{dcase['name']} microbatch dp")
        _close(ldocs.grad[:, 1:].flatten(0, 1) / world, want_n[own_neg], f"{dcase['name']} microbatch dn")


DIST_CASES = [d["name"] for _, d in PAIRS[1::2]]


@pytest.mark.parametrize("world", TWO_AND_FOUR)
def test_distributed_forms_match_the_definition(world: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_distributed(_distributed, world, DIST_CASES)


# ------------------------------------------------------------------ a teacher model: KL over every column


def reference_model_term(tau: float, q, cols, scale, tq, tcols) -> torch.Tensor:
    """The KL to a teacher model's softmax over every column, from its definition, one query at a time."""
    total = 0.0
    for i in range(len(q)):
        logits = torch.stack([scale * (q[i] @ d) for d in cols])
        target = torch.softmax(torch.stack([tq[i] @ t for t in tcols]) / tau, 0)
        log_student = logits - torch.logsumexp(logits, 0)
        total = total + sum(target[j] * (torch.log(target[j]) - log_student[j]) for j in range(len(cols)))
    return total / len(q)


def model_total(case: dict, dcase: dict, q, p, n, scale, bias, ids, teacher) -> torch.Tensor:
    total = dcase["cw"] * reference(case, q, p, n, scale, bias, ids) if dcase["cw"] else 0.0
    tq, tcols = teacher
    for m, w in case["matryoshka"] or [(q.shape[1], 1.0)]:
        qm, pm, nm = (
            None if z is None else F.normalize(z[:, :m], dim=1) if case["matryoshka"] else z for z in (q, p, n)
        )
        cols = pm if nm is None else torch.cat([pm, nm])
        term = reference_model_term(dcase["tau"], qm, cols, scale, tq, tcols)
        if dcase["sym"]:
            along = reference_model_term(dcase["tau"], pm, qm, scale, tcols[: len(q)], tq)  # positives over queries
            term = (term + along) / 2
        total = total + w * dcase["w"] * term
    return total


def model_teacher(q, p, n, seed: int = 0) -> Guide:
    gq, gp, gn = guide_of(q, p, n, seed)
    return Guide(gq, gp if gn is None else torch.cat([gp, gn]))


MODEL_DCASES = [  # the contrastive objective, weight of the term, of the objective, tau, hard negatives, both ways
    ("clip-sym-k0-none-full", 1.0, 1.0, 0.05, 0, False),
    ("clip-sym-k0-none-full", 0.8, 1.0, 0.05, 0, True),
    ("clip-oneway-k2-none-full", 0.7, 0.0, 0.5, 2, False),
    ("clip-oneway-k2-all-mat", 0.5, 0.5, 0.1, 2, False),
    ("clip-oneway-k2-all-mat", 0.5, 0.0, 0.1, 2, True),
    ("siglip-sym-k2-margin-full", 1.0, 1.0, 0.05, 2, False),
    ("siglip-sym-k2-margin-full", 1.0, 1.0, 0.2, 2, True),
    ("clip-gte-k0-all-full", 0.7, 1.0, 0.2, 0, False),
]
MODEL_PAIRS = [
    (
        dict(BASE[name], k=k),
        dict(kind="kl", w=w, cw=cw, tau=tau, sym=sym, name=f"{name}-model-w{w}-cw{cw}-tau{tau}-k{k}{'-sym' * sym}"),
    )
    for name, w, cw, tau, k, sym in MODEL_DCASES
]


def model_distilled_of(case: dict, dcase: dict):
    inner = objective_of(dict(case, matryoshka=None))
    distillation = Distillation("kl", dcase["w"], dcase["tau"], model="loss.teacher_model", symmetric=dcase["sym"])
    objective = Distilled(inner, distillation, dcase["cw"])
    if case["matryoshka"]:
        dims, weights = zip(*case["matryoshka"])
        objective = Matryoshka(objective, dims, weights)
    return objective


@pytest.mark.parametrize("pair", MODEL_PAIRS, ids=[d["name"] for _, d in MODEL_PAIRS])
def test_a_teacher_models_kl_over_every_column_matches_the_definition(pair) -> None:
    case, dcase = pair
    q, p, n, scale, bias, ids = problem(case)
    teacher = model_teacher(q, p, n)
    rq, rp, rn, rs, rb = leaves(q, p, n, scale, bias)
    want_loss = model_total(case, dcase, rq, rp, rn, rs, rb, ids, (teacher.queries, teacher.columns))
    wanted = [t for t in (rq, rp, rn, rs) if t is not None]
    want_q, want_p, *want_n, want_s = torch.autograd.grad(want_loss, wanted)
    objective = model_distilled_of(case, dcase).with_teacher(teacher)
    cols = p if n is None else torch.cat([p, n])
    want_cols = want_p if n is None else torch.cat([want_p, *want_n])
    b = bias if objective.has_bias else None

    dq, dcols, ds = leaves(q, cols, scale)
    loss = objective.dense(dq, dcols, ds, b, ids)
    loss.backward()
    _close(loss.detach(), want_loss.detach(), "dense loss")
    _close(dq.grad, want_q, "dense dq")
    _close(dcols.grad, want_cols, "dense dD")
    _close(ds.grad, want_s, "dense ds")
    for chunk in (5, 7, N):
        out = objective.streamed(q, cols, scale, b, first_row=0, num_queries=N, chunk=chunk, ranks=Ranks(None), ids=ids)
        _close(out.loss, want_loss.detach(), f"streamed loss, chunk {chunk}")
        _close(out.grad_rows, want_q, f"streamed dq, chunk {chunk}")
        _close(out.grad_cols, want_cols, f"streamed dD, chunk {chunk}")
        _close(out.scale_rows.sum(), want_s, f"streamed ds, chunk {chunk}")

    mq, ms, mb = leaves(q, scale, bias)
    k = case["k"]
    mdocs = (p if n is None else torch.cat([p[:, None], n.view(N, k, -1)], 1)).clone().requires_grad_()
    local_ids = ids if n is None else torch.cat([ids[:N, None], ids[N:].view(N, k)], 1)
    loss = MicrobatchLoss(model_distilled_of(case, dcase))(
        mq, mdocs, ms, mb if objective.has_bias else None, ids=local_ids, teacher=teacher
    )
    loss.backward()
    _close(loss.detach(), want_loss.detach(), "microbatch loss")
    _close(mq.grad, want_q, "microbatch dq")
    _close(mdocs.grad if n is None else mdocs.grad[:, 0], want_p, "microbatch dp")


def _model_distributed(names: list[str]) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    ranks = Ranks(dist.group.WORLD)
    for case, dcase in (pair for pair in MODEL_PAIRS if pair[1]["name"] in names):
        q, p, n, scale, bias, ids = problem(case, seed=1)
        gq, gp, gn = guide_of(q, p, n, seed=1)
        rq, rp, rn, rs, rb = leaves(q, p, n, scale, bias)
        whole = model_teacher(q, p, n, seed=1)
        want_loss = model_total(case, dcase, rq, rp, rn, rs, rb, ids, (whole.queries, whole.columns))
        want_q, want_p, *want_n = torch.autograd.grad(want_loss, [t for t in (rq, rp, rn) if t is not None])
        c, k = N // world, case["k"]
        own, own_neg = slice(rank * c, (rank + 1) * c), slice(rank * c * k, (rank + 1) * c * k)
        local = gp[own] if gn is None else torch.cat([gp[own, None], gn[own_neg].view(c, k, -1)], 1)
        teacher = Guide.gathered(gq[own], local, ranks)  # as the steps gather the frozen model's embeddings
        objective = model_distilled_of(case, dcase)
        b = bias if objective.has_bias else None
        cols = p if n is None else torch.cat([p, n])
        out = objective.with_teacher(teacher).streamed(
            q[own], cols, scale, b, first_row=own.start, num_queries=N, chunk=3, ranks=ranks, ids=ids
        )
        _close(out.loss, want_loss.detach(), f"{dcase['name']} streamed loss")
        _close(out.grad_rows, want_q[own], f"{dcase['name']} streamed dq")
        shares = out.grad_cols.clone()
        dist.all_reduce(shares)
        _close(shares, want_p if n is None else torch.cat([want_p, *want_n]), f"{dcase['name']} streamed dD")

        lq, ls, lb = leaves(q[own], scale, bias)
        ldocs = (p[own] if n is None else torch.cat([p[own, None], n[own_neg].view(c, k, -1)], 1)).clone()
        ldocs.requires_grad_()
        local_ids = ids[own] if n is None else torch.cat([ids[:N][own, None], ids[N:][own_neg].view(c, k)], 1)
        loss = MicrobatchLoss(objective, dist.group.WORLD)(
            lq, ldocs, ls, lb if objective.has_bias else None, ids=local_ids, teacher=teacher
        )
        loss.backward()
        _close(loss.detach(), want_loss.detach(), f"{dcase['name']} microbatch loss")
        _close(lq.grad / world, want_q[own], f"{dcase['name']} microbatch dq")


@pytest.mark.parametrize("world", TWO_AND_FOUR)
def test_a_teacher_models_distributed_forms_match_the_definition(world: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_distributed(_model_distributed, world, [d["name"] for _, d in MODEL_PAIRS[::2]])


def test_kl_is_zero_when_the_student_agrees_with_the_teacher() -> None:
    """A student whose logits are the teacher's scores / tau has nothing to learn (KL, not cross-entropy)."""
    case, _ = PAIRS[0]
    q, p, n, scale, *_ = problem(case)
    teacher = 0.5 * own_cosines(q, p, n) * scale
    objective = Distilled(objective_of(case), Distillation("kl", 1.0, 0.5), 0.0).with_teacher(teacher)
    assert objective.dense(q, torch.cat([p, n]), scale).abs() < 1e-12


def own_cosines(q, p, n) -> torch.Tensor:
    k = len(n) // len(q)
    return torch.cat([(q * p).sum(1, keepdim=True), torch.einsum("nd,nkd->nk", q, n.view(len(q), k, -1))], 1)


def test_an_unbound_or_misshapen_teacher_is_a_clear_error() -> None:
    case, _ = PAIRS[0]
    q, p, n, scale, *_ = problem(case)
    objective = Distilled(objective_of(case), Distillation("kl"))
    with pytest.raises(ValueError, match="no teacher for this problem; the step must bind the data.s teacher scores"):
        objective.dense(q, torch.cat([p, n]), scale)
    with pytest.raises(ValueError, match=r"teacher scores \(12, 2\) for 12 queries and 36 columns"):
        objective.with_teacher(teacher_of(1)).dense(q, torch.cat([p, n]), scale)
    with pytest.raises(ValueError, match="k >= 1 hard negatives"):
        objective.with_teacher(teacher_of(0)).dense(q, p, scale)


def _loss(**kwargs):
    loss = JobConfig().loss
    for key, value in kwargs.items():
        setattr(loss, key, value)
    return loss


def test_config_builds_the_distilled_objective_and_refuses_what_it_cannot_mean() -> None:
    objective = build_objective(_loss(distill="kl", distill_weight=0.5, distill_temperature=2.0, matryoshka_dims=[8]))
    assert isinstance(objective, Matryoshka) and objective.inner.distillation == Distillation("kl", 0.5, 2.0)
    assert "distillation (KL to the teacher's softmax at tau 2)" in objective.describe()
    with pytest.raises(ConfigError, match=r"loss.contrastive_weight=0.0 .* set loss.distill"):
        build_objective(_loss(contrastive_weight=0.0))
    with pytest.raises(ConfigError, match="loss.distill_temperature=2.0: only loss.distill=kl"):
        build_objective(_loss(distill="margin_mse", distill_temperature=2.0))
    assert math.isclose(build_objective(_loss(distill="margin_mse")).contrastive_weight, 1.0)
