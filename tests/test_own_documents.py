"""Queries without in-batch negatives (`data.in_batch_negatives` = false, FlagEmbedding's `no_in_batch_neg`): each
flagged query is scored against its own positive and hard negatives only, every other column masked
(`masking.FalseNegatives.own_only`, bound by `losses.base.own_documents_only` through the wrappers). Each form of
clip (one-way and symmetric, with hardness weighting), siglip, Matryoshka and distillation, alone and with the
other masks, against the references of tests/test_objectives.py and tests/test_distill.py written from the
definitions, in float64 (<= 1e-10): dense and streamed with chunks that divide nothing, and the step's microbatch
loss; streamed and microbatch on 2 and 4 gloo processes, each rank flagging its own queries."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.objective_forms import assert_distributed_forms, assert_forms, wanted
from tests.test_distill import PAIRS, distilled_of, reference_total, teacher_of
from tests.test_objectives import (
    CASES,
    HARDNESS,
    MASKINGS,
    N,
    _close,
    _masked,
    objective_of,
    problem,
    reference_grads,
)
from titan_contrastive.losses import Ranks
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


def _want(case: dict, q, p, n, scale, bias, ids) -> tuple:
    """(loss, dq, dD, ds) of the reference with the flags, and its db."""
    loss, want = reference_grads(flagged(case), q, p, n, scale, bias, ids)
    return (loss, want["q"], torch.cat([want["p"], want["n"]]), want["s"]), want["b"]


@pytest.mark.parametrize("case", OWN_CASES, ids=[c["name"] for c in OWN_CASES])
def test_own_documents_only_in_every_form_match_the_definition(case: dict) -> None:
    q, p, n, scale, bias, ids = problem(case)
    want, want_b = _want(case, q, p, n, scale, bias, ids)
    assert_forms(objective_of(case), (q, p, n, scale, bias, ids), want, own_only=OWN)
    if case["objective"] == "siglip":  # the bias's gradient too
        bound = own_documents_only(objective_of(case), OWN)
        out = bound.streamed(
            q, torch.cat([p, n]), scale, bias, first_row=0, num_queries=N, chunk=5, ranks=Ranks(None), ids=ids
        )
        _close(out.bias_rows.sum(), want_b, "streamed db")


@pytest.mark.parametrize("pair", [PAIRS[0], PAIRS[5]], ids=[PAIRS[0][1]["name"], PAIRS[5][1]["name"]])
def test_own_documents_only_under_distillation_match_the_definition(pair) -> None:
    """Through the distillation wrapper (and Matryoshka around it): the contrastive term masked, the teacher's
    term over each query's own documents as before."""
    case, dcase = pair
    q, p, n, scale, bias, ids = problem(case)
    teacher = teacher_of(case["k"])
    rq, rp, rn, rs, rb = (t.clone().requires_grad_() for t in (q, p, n, scale, bias))
    loss = reference_total(flagged(case), dcase, rq, rp, rn, rs, rb, ids, teacher)
    assert_forms(
        distilled_of(case, dcase),
        (q, p, n, scale, bias, ids),
        (loss.detach(), *wanted(loss, rq, rp, rn, rs)),
        teacher=teacher,
        own_only=OWN,
    )


def _distributed(case_names: list[str]) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    cases = {c["name"]: c for c in OWN_CASES}
    for name in case_names:
        q, p, n, scale, bias, ids = problem(cases[name], seed=1)
        want, _ = _want(cases[name], q, p, n, scale, bias, ids)
        assert_distributed_forms(objective_of(cases[name]), (q, p, n, scale, bias, ids), want, name, own_only=OWN)


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
