"""A guide model's masks (GISTEmbed, `losses/guide.py`): with a guide, the margin and relative rules
compare the guide's cosines, in every objective and form. Each form against the reference of
tests/test_objectives.py with the guide's embeddings deciding the masks, in float64 (<= 1e-10): dense
and streamed with chunks that divide nothing, streamed and microbatch on 2 and 4 gloo processes (the
guide gathered from every rank's local embeddings)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import TWO_AND_FOUR, run_distributed
from tests.test_objectives import (
    CASES,
    DIRECTION_SETS,
    MASKINGS,
    N,
    _close,
    _masked,
    leaves,
    objective_of,
    problem,
    reference_grads,
)
from titan_contrastive.losses import MicrobatchLoss, Ranks
from titan_contrastive.losses.guide import Guide

G = 6  # the guide's embedding dimension (the model's is 8)


def guide_of(q, p, n, seed: int = 0):
    """A guide that agrees with the model only roughly: its masks remove other candidates."""
    gen = torch.Generator().manual_seed(100 + seed)

    def embed(z):
        noise = torch.randn(len(z), G, generator=gen, dtype=torch.float64)
        return None if z is None else F.normalize(z[:, :G] + 0.6 * noise, dim=1)

    return embed(q), embed(p), None if n is None else embed(n)


def _columns(p, n):
    return torch.cat([p, n]) if n is not None else p


def _guided(case: dict) -> bool:
    """The objectives with a rule that reads cosines: clip (both ways, with Matryoshka), siglip, GTE's and
    Qwen3's joint sets, and hardness weighting, with no hard negatives and with two."""
    if case["masking"] not in (MASKINGS["margin"], MASKINGS["relative"], MASKINGS["all"]):
        return False
    plain = not case["directions"] and not case["hardness"].enabled
    joint = case["directions"] in (DIRECTION_SETS["gte"], DIRECTION_SETS["qwen3"]) and not case["matryoshka"]
    return plain or (joint and not case["hardness"].enabled) or case["hardness"].mode == "all_negatives"


GUIDE_CASES = [c for c in CASES if _guided(c)]


def test_the_guide_masks_other_candidates_than_the_model() -> None:
    """Else a form that ignored the guide (or the model's mask under a guide) would pass."""
    q, p, n, *_, ids = problem(dict(k=2))
    gq, gp, gn = guide_of(q, p, n)
    cols, gcols = _columns(p, n), _columns(gp, gn)
    for mask in ("margin", "relative"):
        pairs = [(i, j) for i in range(N) for j in range(len(cols))]
        model = {(i, j) for i, j in pairs if _masked(i, j, q, cols, ids, MASKINGS[mask])}
        guide = {(i, j) for i, j in pairs if _masked(i, j, gq, gcols, ids, MASKINGS[mask])}
        assert guide and guide - model and model - guide, mask


@pytest.mark.parametrize("case", GUIDE_CASES, ids=[c["name"] for c in GUIDE_CASES])
def test_guided_dense_and_streamed_match_the_definition(case: dict) -> None:
    q, p, n, scale, bias, ids = problem(case)
    gq, gp, gn = guide_of(q, p, n)
    want_loss, want = reference_grads(case, q, p, n, scale, bias, ids, guide=(gq, gp, gn))
    objective = objective_of(case).with_guide(Guide(gq, _columns(gp, gn)))
    cols, want_cols = _columns(p, n), _columns(want["p"], want.get("n"))
    b = bias if objective.has_bias else None

    dq, dcols, ds = leaves(q, cols, scale)
    loss = objective.dense(dq, dcols, ds, b, ids)
    loss.backward()
    _close(loss.detach(), want_loss, "dense loss")
    _close(dq.grad, want["q"], "dense dq")
    _close(dcols.grad, want_cols, "dense dD")
    _close(ds.grad, want["s"], "dense ds")

    for chunk in (5, 7, N):
        out = objective.streamed(
            q, cols, scale, b, first_row=0, num_queries=N, chunk=chunk, ranks=Ranks(None), ids=ids
        )  # fmt: skip
        _close(out.loss, want_loss, f"streamed loss, chunk {chunk}")
        _close(out.grad_rows, want["q"], f"streamed dq, chunk {chunk}")
        _close(out.grad_cols, want_cols, f"streamed dD, chunk {chunk}")
        _close(out.scale_rows.sum(), want["s"], f"streamed ds, chunk {chunk}")


def _distributed(case_names: list[str]) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    cases = {c["name"]: c for c in GUIDE_CASES}
    ranks = Ranks(dist.group.WORLD)
    for name in case_names:
        case = cases[name]
        q, p, n, scale, bias, ids = problem(case, seed=1)
        gq, gp, gn = guide_of(q, p, n, seed=1)
        want_loss, want = reference_grads(case, q, p, n, scale, bias, ids, guide=(gq, gp, gn))
        c, k = N // world, case["k"]
        own, own_neg = slice(rank * c, (rank + 1) * c), slice(rank * c * k, (rank + 1) * c * k)
        # the guide of the whole problem from each rank's local embeddings, documents [c, 1 + k, G]
        local_docs = gp[own] if gn is None else torch.cat([gp[own, None], gn[own_neg].view(c, k, G)], 1)
        guide = Guide.gathered(gq[own], local_docs, ranks)
        _close(guide.columns, _columns(gp, gn), f"{name} gathered guide")
        objective = objective_of(case).with_guide(guide)
        cols, b = _columns(p, n), bias if objective.has_bias else None

        out = objective.streamed(
            q[own], cols, scale, b, first_row=own.start, num_queries=N, chunk=3, ranks=ranks, ids=ids
        )
        _close(out.loss, want_loss, f"{name} streamed loss")
        _close(out.grad_rows, want["q"][own], f"{name} streamed dq")
        shares = out.grad_cols.clone()
        dist.all_reduce(shares)
        _close(shares, _columns(want["p"], want.get("n")), f"{name} streamed dD")

        # the step's loss function: local embeddings gathered with gradient, the guide given whole
        lq, ls, lb = leaves(q[own], scale, bias)
        ldocs = (p[own] if n is None else torch.cat([p[own, None], n[own_neg].view(c, k, -1)], 1)).clone()
        ldocs.requires_grad_()
        local_ids = ids[own] if n is None else torch.cat([ids[:N][own, None], ids[N:][own_neg].view(c, k)], 1)
        loss = MicrobatchLoss(objective_of(case), dist.group.WORLD)(
            lq, ldocs, ls, lb if objective.has_bias else None, ids=local_ids, guide=guide
        )
        loss.backward()
        _close(loss.detach(), want_loss, f"{name} microbatch loss")
        _close(lq.grad / world, want["q"][own], f"{name} microbatch dq")
        _close(ldocs.grad[:, 0] if n is not None else ldocs.grad, want["p"][own] * world, f"{name} microbatch dp x P")


DIST_CASES = [c["name"] for c in GUIDE_CASES if c["masking"] == MASKINGS["all"] and c["k"]]


@pytest.mark.parametrize("world", TWO_AND_FOUR)
def test_guided_distributed_forms_match_the_definition(world: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_distributed(_distributed, world, DIST_CASES)
