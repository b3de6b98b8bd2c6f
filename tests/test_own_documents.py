"""Queries without in-batch negatives (`data.in_batch_negatives` = false, FlagEmbedding's `no_in_batch_neg`): each
flagged query is scored against its own positive and hard negatives only, every other column masked
(`masking.FalseNegatives.own_only`, bound by `losses.base.own_documents_only` through the wrappers). Each form of
clip (one-way and symmetric, with hardness weighting), siglip and Matryoshka, alone and with the other masks,
against the reference of tests/test_objectives.py written from the definition, in float64 (<= 1e-10): dense and
streamed with chunks that divide nothing, and the step's microbatch loss; streamed and microbatch on 2 and 4 gloo
processes, each rank flagging its own queries."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.test_objectives import (
    CASES,
    HARDNESS,
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
from titan_contrastive.losses.base import own_documents_only
from titan_contrastive.losses.pairwise import Pairwise

OWN = torch.tensor([1, 0, 0, 1, 1, 0, 1, 0, 0, 0, 1, 0], dtype=torch.bool)
"""The flagged queries: some on every rank of 2 and of 4, and some not."""


def _own_case(case: dict) -> bool:
    """clip both ways, siglip, Matryoshka, hardness one-way; with hard negatives (what a flagged query keeps)."""
    if not case["k"] or case["directions"]:
        return False
    plain = case["masking"] in (MASKINGS["none"], MASKINGS["all"]) and not case["hardness"].enabled
    return plain or (case["hardness"] == HARDNESS["all_negatives"] and case["masking"] == MASKINGS["none"])


OWN_CASES = [c for c in CASES if _own_case(c)]


def flagged(case: dict, own: torch.Tensor = OWN) -> dict:
    """The case whose reference masks, for the flagged queries, every other query's document."""
    return dict(case, masking=case["masking"].grouped(own))


def _columns(p, n):
    return torch.cat([p, n])


def test_the_flags_mask_every_other_query_s_documents_and_keep_their_own() -> None:
    q, p, n, *_, ids = problem(dict(k=2))
    cols = _columns(p, n)
    masking = MASKINGS["none"].grouped(OWN)
    for i in range(N):
        kept = [j for j in range(len(cols)) if not _masked(i, j, q, cols, ids, masking)]
        assert kept == ([i, N + 2 * i, N + 2 * i + 1] if OWN[i] else list(range(len(cols)))), i
    mask = masking.dense(q, cols, ids)
    assert mask is not None and mask.sum() == int(OWN.sum()) * (len(cols) - 3)


def test_the_flags_change_the_loss() -> None:
    """Else a form that ignored them would pass."""
    case = OWN_CASES[0]
    q, p, n, scale, bias, ids = problem(case)
    with_flags, _ = reference_grads(flagged(case), q, p, n, scale, bias, ids)
    without, _ = reference_grads(case, q, p, n, scale, bias, ids)
    assert abs(with_flags - without) > 0.1


@pytest.mark.parametrize("case", OWN_CASES, ids=[c["name"] for c in OWN_CASES])
def test_own_documents_only_in_every_form_match_the_definition(case: dict) -> None:
    q, p, n, scale, bias, ids = problem(case)
    want_loss, want = reference_grads(flagged(case), q, p, n, scale, bias, ids)
    objective = own_documents_only(objective_of(case), OWN)
    cols, want_cols = _columns(p, n), _columns(want["p"], want["n"])
    b = bias if objective.has_bias else None

    dq, dcols, ds = leaves(q, cols, scale)
    loss = objective.dense(dq, dcols, ds, b, ids)
    loss.backward()
    _close(loss.detach(), want_loss, "dense loss")
    _close(dq.grad, want["q"], "dense dq")
    _close(dcols.grad, want_cols, "dense dD")
    _close(ds.grad, want["s"], "dense ds")

    for chunk in (5, 7, N):
        out = objective.streamed(q, cols, scale, b, first_row=0, num_queries=N, chunk=chunk, ranks=Ranks(None), ids=ids)
        _close(out.loss, want_loss, f"streamed loss, chunk {chunk}")
        _close(out.grad_rows, want["q"], f"streamed dq, chunk {chunk}")
        _close(out.grad_cols, want_cols, f"streamed dD, chunk {chunk}")
        _close(out.scale_rows.sum(), want["s"], f"streamed ds, chunk {chunk}")
        if b is not None:
            _close(out.bias_rows.sum(), want["b"], f"streamed db, chunk {chunk}")

    k = case["k"]
    docs = torch.cat([p[:, None], n.view(N, k, -1)], 1)
    local_ids = torch.cat([ids[:N, None], ids[N:].view(N, k)], 1)
    mq, ms, mb, mdocs = leaves(q, scale, bias, docs)
    loss = MicrobatchLoss(objective_of(case))(mq, mdocs, ms, mb if b is not None else None, ids=local_ids, own_only=OWN)
    loss.backward()
    _close(loss.detach(), want_loss, "microbatch loss")
    _close(mq.grad, want["q"], "microbatch dq")
    _close(torch.cat([mdocs.grad[:, 0], mdocs.grad[:, 1:].flatten(0, 1)]), want_cols, "microbatch dD")


def _distributed(case_names: list[str]) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    cases = {c["name"]: c for c in OWN_CASES}
    ranks = Ranks(dist.group.WORLD)
    for name in case_names:
        case = cases[name]
        q, p, n, scale, bias, ids = problem(case, seed=1)
        want_loss, want = reference_grads(flagged(case), q, p, n, scale, bias, ids)
        c, k = N // world, case["k"]
        own, own_neg = slice(rank * c, (rank + 1) * c), slice(rank * c * k, (rank + 1) * c * k)
        objective = own_documents_only(objective_of(case), ranks.gather(OWN[own].to(torch.uint8)).bool())
        cols, b = _columns(p, n), bias if objective.has_bias else None

        out = objective.streamed(
            q[own], cols, scale, b, first_row=own.start, num_queries=N, chunk=3, ranks=ranks, ids=ids
        )
        _close(out.loss, want_loss, f"{name} streamed loss")
        _close(out.grad_rows, want["q"][own], f"{name} streamed dq")
        shares = out.grad_cols.clone()
        dist.all_reduce(shares)
        _close(shares, _columns(want["p"], want["n"]), f"{name} streamed dD")

        # the step's loss function: each rank's flags and embeddings, gathered
        lq, ls, lb = leaves(q[own], scale, bias)
        ldocs = torch.cat([p[own, None], n[own_neg].view(c, k, -1)], 1).clone().requires_grad_()
        local_ids = torch.cat([ids[:N][own, None], ids[N:][own_neg].view(c, k)], 1)
        loss = MicrobatchLoss(objective_of(case), dist.group.WORLD)(
            lq, ldocs, ls, lb if b is not None else None, ids=local_ids, own_only=OWN[own]
        )
        loss.backward()
        _close(loss.detach(), want_loss, f"{name} microbatch loss")
        _close(lq.grad / world, want["q"][own], f"{name} microbatch dq")
        _close(ldocs.grad[:, 0], want["p"][own] * world, f"{name} microbatch dp x P")
        _close(ldocs.grad[:, 1:].flatten(0, 1), want["n"][own_neg] * world, f"{name} microbatch dn x P")


DIST_CASES = [c["name"] for c in OWN_CASES if c["masking"] == MASKINGS["all"] and not c["matryoshka"]]


@pytest.mark.parametrize("world", [2, 4])
def test_own_documents_only_on_2_and_4_processes_match_the_definition(world: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_distributed(_distributed, world, DIST_CASES)


def test_an_objective_without_masks_is_refused() -> None:
    class Bare:
        def describe(self) -> str:
            return "a registered objective"

    with pytest.raises(ValueError, match="a registered objective has no false-negative masks"):
        own_documents_only(Bare(), OWN)
    assert own_documents_only(Bare, None) is Bare  # no flags: as it is
    bound = own_documents_only(Pairwise(), OWN)
    assert bound.false_negatives.own_only is OWN
