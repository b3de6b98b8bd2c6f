"""False-negative masks and hardness weighting under late interaction (`losses/late_interaction.py`): every form
against InfoNCE over MaxSim written here one (query, column) at a time, MaxSim in the place of the cosine, in float64:
duplicate ids, margin, relative and all three, with and without hard negatives, one-way and symmetric, each query's
MaxSim over its token count or not, sentence-transformers' three hardness modes, a guide's cosines deciding instead
(GISTEmbed), queries without in-batch negatives (their own documents only), on 1, 2 and 4 gloo processes, chunks
that divide nothing."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import TWO_AND_FOUR, run_distributed
from tests.objective_forms import assert_distributed_forms, assert_forms, wanted
from tests.test_late_interaction import DIM, LD, LQ, maxsim, problem
from tests.test_objectives import HARDNESS, MASKINGS, N, _logit, leaves
from tests.test_own_documents import OWN
from titan_contrastive.losses import FalseNegatives, Hardness, InfoNCE
from titan_contrastive.losses.guide import Guide
from titan_contrastive.losses.late_interaction import LateInteraction, late_interaction

K = 2


def masked_problem(k: int, seed: int = 0):
    """`test_late_interaction.problem`, with positive 3 a near copy of positive 7 (one id) and, with hard negatives,
    query 2's second negative a near copy of its positive (its id): so each rule removes something."""
    q, p, n, scale, bias, ids = problem(k, seed)
    gen = torch.Generator().manual_seed(50 + seed)

    def near_copy(row: torch.Tensor) -> torch.Tensor:
        t = row.view(-1, DIM).clone()
        real = (t != 0).any(1)
        t[real] = F.normalize(t[real] + 1e-3 * torch.randn(int(real.sum()), DIM, generator=gen, dtype=t.dtype), dim=1)
        return t.flatten()

    p[3] = near_copy(p[7])
    ids[3] = ids[7]
    if k:
        n[2 * k + 1] = near_copy(p[2])
        ids[N + 2 * k + 1] = ids[2]
    return q, p, n, scale, bias, ids


def guide_of(q, p, n, seed: int = 0):
    """A single-vector guide (width 6) that agrees with the model's MaxSim only roughly: each text's mean token,
    noised."""
    gen = torch.Generator().manual_seed(200 + seed)

    def embed(z, length):
        if z is None:
            return None
        mean = z.view(len(z), length, DIM).mean(1)
        noise = torch.randn(len(z), 6, generator=gen, dtype=torch.float64)
        return F.normalize(torch.cat([mean, mean], 1) + 0.3 * noise, dim=1)

    return embed(q, LQ), embed(p, LD), embed(n, LD)


def maxsim_table(q, cols, normalize: bool, dim: int, guide=None):
    """(ms[i][j]: MaxSim of query i and column j, over the query's token count where `normalize`, with autograd;
    judged[i][j]: what the masks read, that MaxSim without gradient, or the guide's (queries, positives, negatives)
    cosine)."""
    nq = len(q)
    count = [int((q[i].view(-1, dim) != 0).any(1).sum()) if normalize else 1 for i in range(nq)]
    ms = [[maxsim(q[i], cols[j], dim) / count[i] for j in range(len(cols))] for i in range(nq)]
    if guide is None:
        return ms, [[float(ms[i][j].detach()) for j in range(len(cols))] for i in range(nq)]
    gq, gp, gn = guide
    return ms, (gq @ (gp if gn is None else torch.cat([gp, gn])).T).tolist()


def masked_by(masking: FalseNegatives, judged, ids):
    """masked(i, j): whether column j leaves query i's problem, by the rules on the scores `judged[i][j]` (query i's
    positive is column i, never masked): its id is the positive's (duplicates), or its score exceeds the positive's by
    the margin or `relative` times it; or, for a query the masking flags (`own_only`), another query's document."""
    nq = len(judged)
    k = (len(judged[0]) - nq) // nq

    def masked(i: int, j: int) -> bool:
        pos, s = float(judged[i][i]), float(judged[i][j])
        other = masking.own_only is not None and bool(masking.own_only[i]) and not nq + i * k <= j < nq + (i + 1) * k
        return j != i and bool(
            other
            or (masking.duplicates and int(ids[j]) == int(ids[i]))
            or (masking.margin is not None and s > pos + masking.margin)
            or (masking.relative is not None and s > masking.relative * pos)
        )

    return masked


def reference(q, p, n, scale, ids, symmetric, masking, hardness, normalize, guide=None, dim: int = DIM):
    """InfoNCE over t MaxSim (over each query's token count where `normalize`), column j leaving query i's problem
    when its id is the positive's (duplicates), or its MaxSim (the guide's cosine, with a guide) exceeds the
    positive's by the margin or `relative` times it; the weighted negatives' logits + alpha sg(MaxSim)."""
    cols, nq = (p if n is None else torch.cat([p, n])), len(q)
    k = (len(cols) - nq) // nq
    ms, judged = maxsim_table(q, cols, normalize, dim, guide)
    masked = masked_by(masking, judged, ids)

    forward = 0.0
    for i in range(nq):
        kept = [j for j in range(len(cols)) if not masked(i, j)]
        logits = torch.stack([_logit(i, j, ms[i][j], scale, nq, k, hardness) for j in kept])
        forward = forward - torch.log_softmax(logits, 0)[kept.index(i)]
    if not symmetric:
        return forward / nq
    backward = 0.0
    for j in range(nq):
        kept = [i for i in range(nq) if not masked(i, j)]
        logits = torch.stack([scale * ms[i][j] for i in kept])
        backward = backward - torch.log_softmax(logits, 0)[kept.index(j)]
    return (forward + backward) / (2 * nq)


MASK_CASES = [
    (k, sym, norm, mask)
    for k in (0, K)
    for sym in (False, True)
    for norm in (False, True)
    for mask in ("duplicates", "margin", "relative", "all")
    if norm == sym or mask == "all"  # normalized one-way and symmetric with all rules, each rule either way
]
HARD_CASES = [(K, mode, mask) for mode in HARDNESS for mask in ("none", "all")] + [(0, "in_batch_negatives", "none")]


def _want(k, symmetric, normalize, masking, hardness, seed, guide=None):
    problem_ = masked_problem(k, seed)
    rq, rp, rn, rs = leaves(*problem_[:4])
    loss = reference(rq, rp, rn, rs, problem_[5], symmetric, masking, hardness, normalize, guide)
    return problem_, (loss.detach(), *wanted(loss, rq, rp, rn, rs))


def _guide(problem_, seed: int) -> tuple[tuple, Guide]:
    gq, gp, gn = guide_of(*problem_[:3], seed)
    return (gq, gp, gn), Guide(gq, gp if gn is None else torch.cat([gp, gn]))


def test_each_rule_removes_something_the_others_keep() -> None:
    """Else a form that ignored a rule, or the guide, or normalized one side and not the other, would still pass."""
    q, p, n, scale, _, ids = masked_problem(K)
    for normalize in (False, True):
        rules = {**{name: MASKINGS[name] for name in ("none", "duplicates", "margin", "relative")}, "guided": None}
        losses = {
            name: float(
                reference(q, p, n, scale, ids, False, m, Hardness(), normalize)
                if m is not None
                else reference(q, p, n, scale, ids, False, MASKINGS["all"], Hardness(), normalize, guide_of(q, p, n))
            )
            for name, m in rules.items()
        }
        assert len(set(losses.values())) == len(losses), losses


@pytest.mark.parametrize(
    ("k", "symmetric", "normalize", "mask"),
    MASK_CASES,
    ids=[f"k{k}-{'sym' if s else 'oneway'}{'-normalized' if m else ''}-{mask}" for k, s, m, mask in MASK_CASES],
)
def test_masked_forms_match_the_definition(k: int, symmetric: bool, normalize: bool, mask: str) -> None:
    problem_, want = _want(k, symmetric, normalize, MASKINGS[mask], Hardness(), 0)
    assert_forms(LateInteraction(DIM, symmetric, normalize, MASKINGS[mask]), problem_, want)


@pytest.mark.parametrize(("k", "mode", "mask"), HARD_CASES, ids=[f"k{k}-{m}-{mask}" for k, m, mask in HARD_CASES])
def test_weighted_forms_match_the_definition(k: int, mode: str, mask: str) -> None:
    problem_, want = _want(k, False, False, MASKINGS[mask], HARDNESS[mode], 0)
    assert_forms(LateInteraction(DIM, False, False, MASKINGS[mask], HARDNESS[mode]), problem_, want)


@pytest.mark.parametrize("symmetric", [False, True])
def test_a_guide_decides_the_masks(symmetric: bool) -> None:
    masking = FalseNegatives(margin=0.02, relative=0.9)
    (guide_vectors, guide) = _guide(masked_problem(K, 0), 0)
    problem_, want = _want(K, symmetric, True, masking, Hardness(), 0, guide_vectors)
    assert_forms(LateInteraction(DIM, symmetric, True, masking), problem_, want, guide=guide)


OWN_CASES = [(K, sym, mask) for sym in (False, True) for mask in ("none", "all")]


@pytest.mark.parametrize(("k", "symmetric", "mask"), OWN_CASES, ids=[f"k{k}-{s}-{mask}" for k, s, mask in OWN_CASES])
def test_queries_without_in_batch_negatives(k: int, symmetric: bool, mask: str) -> None:
    """The flagged queries (`data.in_batch_negatives` false) against their own documents only; the flags matter."""
    masking = MASKINGS[mask].grouped(OWN)
    problem_, want = _want(k, symmetric, True, masking, Hardness(), 0)
    _, unflagged = _want(k, symmetric, True, MASKINGS[mask], Hardness(), 0)
    assert abs(float(want[0]) - float(unflagged[0])) > 0.1
    assert_forms(LateInteraction(DIM, symmetric, True, MASKINGS[mask]), problem_, want, own_only=OWN)


def _distributed() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for k, symmetric, normalize, mask in [c for c in MASK_CASES if c[3] == "all"]:
        problem_, want = _want(k, symmetric, normalize, MASKINGS[mask], Hardness(), 1)
        objective = LateInteraction(DIM, symmetric, normalize, MASKINGS[mask])
        assert_distributed_forms(objective, problem_, want, f"k{k}-{symmetric}-{normalize}-{mask}")
    problem_, want = _want(K, False, False, MASKINGS["all"], HARDNESS["all_negatives"], 1)
    objective = LateInteraction(DIM, False, False, MASKINGS["all"], HARDNESS["all_negatives"])
    assert_distributed_forms(objective, problem_, want, "weighted")
    masking = FalseNegatives(margin=0.02, relative=0.9)
    guide_vectors, guide = _guide(masked_problem(K, 1), 1)
    problem_, want = _want(K, True, True, masking, Hardness(), 1, guide_vectors)
    assert_distributed_forms(LateInteraction(DIM, True, True, masking), problem_, want, "guided", guide=guide)
    problem_, want = _want(K, True, True, MASKINGS["all"].grouped(OWN), Hardness(), 1)
    objective = LateInteraction(DIM, True, True, MASKINGS["all"])
    assert_distributed_forms(objective, problem_, want, "own documents", own_only=OWN)


@pytest.mark.parametrize("world", TWO_AND_FOUR)
def test_distributed_forms_match_the_definition(world: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_distributed(_distributed, world)


def test_the_run_objective_carries_masks_and_weights() -> None:
    masking, hardness = FalseNegatives(duplicates=True, relative=0.95), Hardness("hard_negatives", 2.0)
    late = late_interaction(InfoNCE(False, masking, hardness=hardness), 8, normalize=True)
    assert late == LateInteraction(8, False, True, masking, hardness)
    assert late.needs_ids and not LateInteraction(8).needs_ids
    assert "false negatives masked (duplicate ids or MaxSim > 0.95 x positive)" in late.describe()
    assert "hardness 2 x MaxSim on hard negatives" in late.describe()
    with pytest.raises(ValueError, match=r"loss.joint_directions=\['query_to_query'\] scores queries against"):
        late_interaction(InfoNCE(False, directions=("query_to_query",)), 8)
    with pytest.raises(ValueError, match=r"^loss.hardness_strength=2.0 weighs the query -> document softmax"):
        LateInteraction(8, True, hardness=hardness)
