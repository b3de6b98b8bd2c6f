"""Embedding distillation (`loss.distill = "mse"`, `losses/embedding_distill.py`): every form against the definition,
the mean over every number of every text's squared difference to the teacher's embedding (plus the weighted
contrastive objective), written one text at a time: dense, streamed with chunks that divide nothing, the microbatch
loss, and streamed and microbatch on 2 and 4 gloo processes with the teacher's embeddings gathered from each rank's
(float64, <= 1e-10); the refusals are one line."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import run_distributed
from tests.test_objectives import CASES, N, _close, leaves, objective_of, problem, reference
from titan_contrastive.config import ConfigError, JobConfig
from titan_contrastive.losses import Distillation, EmbeddingDistilled, MicrobatchLoss, Ranks, build_objective
from titan_contrastive.losses.guide import Guide

BASE = {c["name"]: c for c in CASES}
PAIRS = [  # the contrastive objective, the term's weight, the objective's weight, hard negatives
    ("clip-sym-k0-none-full", 1.0, 1.0, 0),
    ("clip-oneway-k2-none-full", 0.7, 0.0, 2),
    ("siglip-sym-k2-margin-full", 2.0, 0.5, 2),
    ("clip-gte-k0-all-full", 0.5, 1.0, 0),
]
PAIRS = [(dict(BASE[name], k=k), dict(w=w, cw=cw, name=f"{name}-w{w}-cw{cw}-k{k}")) for name, w, cw, k in PAIRS]


def teacher_of(q, p, n, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The teacher's unit embeddings of the same texts, of the model's width: near the model's, not equal."""
    gen = torch.Generator().manual_seed(200 + seed)

    def embed(z):
        return None if z is None else F.normalize(z + 0.5 * torch.randn(z.shape, generator=gen, dtype=z.dtype), dim=1)

    return embed(q), embed(p), embed(n)


def definition(case: dict, dcase: dict, q, p, n, scale, bias, ids, teacher) -> torch.Tensor:
    """cw x the objective + w x 1/((N + M) d) sum over every text t of sum_k (x_tk - g_tk)^2."""
    total = dcase["cw"] * reference(case, q, p, n, scale, bias, ids) if dcase["cw"] else 0.0
    texts = [(q[i], teacher[0][i]) for i in range(len(q))] + [(p[i], teacher[1][i]) for i in range(len(p))]
    texts += [] if n is None else [(n[i], teacher[2][i]) for i in range(len(n))]
    width = q.shape[1]
    squares = sum(sum((x[k] - g[k]) ** 2 for k in range(width)) for x, g in texts)
    return total + dcase["w"] * squares / (len(texts) * width)


def distilled_of(case: dict, dcase: dict) -> EmbeddingDistilled:
    distillation = Distillation("mse", dcase["w"], model="loss.teacher_embeddings")
    return EmbeddingDistilled(objective_of(case), distillation, dcase["cw"])


def _guide(gq, gp, gn) -> Guide:
    return Guide(gq, gp if gn is None else torch.cat([gp, gn]))


@pytest.mark.parametrize("pair", PAIRS, ids=[d["name"] for _, d in PAIRS])
def test_every_form_matches_the_definition(pair) -> None:
    case, dcase = pair
    q, p, n, scale, bias, ids = problem(case)
    gq, gp, gn = teacher_of(q, p, n)
    rq, rp, rn, rs, rb = leaves(q, p, n, scale, bias)
    want_loss = definition(case, dcase, rq, rp, rn, rs, rb, ids, (gq, gp, gn))
    wanted = [t for t in (rq, rp, rn, rs) if t is not None]
    want_q, want_p, *want_n, want_s = torch.autograd.grad(want_loss, wanted, allow_unused=True)  # cw 0: no scale
    objective = distilled_of(case, dcase).with_teacher(_guide(gq, gp, gn))
    cols, want_cols = (p, want_p) if n is None else (torch.cat([p, n]), torch.cat([want_p, *want_n]))
    b = bias if objective.has_bias else None

    dq, dcols, ds = leaves(q, cols, scale)
    loss = objective.dense(dq, dcols, ds, b, ids)
    loss.backward()
    for got, want, what in ((loss, want_loss, "loss"), (dq.grad, want_q, "dq"), (dcols.grad, want_cols, "dD")):
        _close(got.detach(), want.detach(), f"dense {what}")
    _close(torch.zeros(()) if ds.grad is None else ds.grad, want_s, "dense ds")
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
    loss = MicrobatchLoss(distilled_of(case, dcase))(
        mq, mdocs, ms, mb if objective.has_bias else None, ids=local_ids, teacher=_guide(gq, gp, gn)
    )
    loss.backward()
    _close(loss.detach(), want_loss.detach(), "microbatch loss")
    _close(mq.grad, want_q, "microbatch dq")
    _close(mdocs.grad if n is None else mdocs.grad[:, 0], want_p, "microbatch dp")


def _distributed(names: list[str]) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    ranks = Ranks(dist.group.WORLD)
    for case, dcase in (pair for pair in PAIRS if pair[1]["name"] in names):
        q, p, n, scale, bias, ids = problem(case, seed=1)
        gq, gp, gn = teacher_of(q, p, n, seed=1)
        rq, rp, rn, rs, rb = leaves(q, p, n, scale, bias)
        want_loss = definition(case, dcase, rq, rp, rn, rs, rb, ids, (gq, gp, gn))
        want_q, want_p, *want_n = torch.autograd.grad(want_loss, [t for t in (rq, rp, rn) if t is not None])
        c, k = N // world, case["k"]
        own, own_neg = slice(rank * c, (rank + 1) * c), slice(rank * c * k, (rank + 1) * c * k)
        local = gp[own] if gn is None else torch.cat([gp[own, None], gn[own_neg].view(c, k, -1)], 1)
        teacher = Guide.gathered(gq[own], local, ranks)  # as the steps gather the data's embeddings
        objective = distilled_of(case, dcase)
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


@pytest.mark.parametrize("world", [2, 4])
def test_the_distributed_forms_match_the_definition(world: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_distributed(_distributed, world, [d["name"] for _, d in PAIRS[1:3]])


def test_what_it_cannot_take_is_one_line() -> None:
    cfg = JobConfig()
    for changes, message in [
        (dict(distill="mse"), r"^loss.distill=mse regresses the model's embeddings onto a teacher's: set"),
        (dict(distill="mse", teacher_embeddings="t.parquet", distill_temperature=0.5), r"^loss.distill_temperature"),
        (
            dict(distill="mse", teacher_embeddings="t.parquet", matryoshka_dims=[4, 8]),
            r"^loss.distill=mse compares the model.s whole embeddings .* loss.matryoshka_dims=\[4, 8\] trains",
        ),
    ]:
        loss = type(cfg.loss)(**changes)
        with pytest.raises(ConfigError, match=message) as e:
            build_objective(loss)
        assert "\n" not in str(e.value)
    objective = build_objective(type(cfg.loss)(distill="mse", teacher_embeddings="t.parquet", symmetric=False))
    q = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^loss.teacher_embeddings: 5-wide embeddings, and the model's are 4-wide"):
        objective.with_teacher(Guide(torch.randn(3, 5), torch.randn(3, 5))).dense(q, q, torch.tensor(1.0))
