"""The sigmoid loss over late interaction (`losses/late_sigmoid.py`): every form against SigLIP's loss over t MaxSim + b
written here one (query, column) at a time, in float64: the loss and the gradients of the queries, the columns, the
scale and the bias; with and without hard negatives, each query's MaxSim over its token count or not, the
false-negative masks by MaxSim (duplicate ids, margin, relative) and a guide's cosines deciding them instead, on 1, 2
and 4 gloo processes, chunks that divide nothing; colpali-engine's ColbertSigmoidLoss written as it writes it."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import TWO_AND_FOUR, run_distributed
from tests.objective_forms import assert_distributed_forms, assert_forms, per_sample, wanted
from tests.test_late_interaction import DIM, LD, LQ
from tests.test_late_masks import K, _guide, masked_by, masked_problem, maxsim_table
from tests.test_objectives import MASKINGS, N, _close, leaves
from titan_contrastive.losses import FalseNegatives, MicrobatchLoss, Ranks, Sigmoid
from titan_contrastive.losses.late_interaction import late_interaction
from titan_contrastive.losses.late_sigmoid import LateSigmoid

BIAS = -1.5


def reference(q, p, n, scale, bias, ids, masking: FalseNegatives, normalize: bool, guide=None, dim: int = DIM):
    """-1/N sum_i sum_j log sigmoid(z_ij (t MaxSim_ij + b)) over the pairs not masked: column j != i leaves query i's
    sum when its id is the positive's (duplicates) or its MaxSim (the guide's cosine, with a guide) exceeds the
    positive's by the margin or `relative` times it."""
    cols, nq = (p if n is None else torch.cat([p, n])), len(q)
    ms, judged = maxsim_table(q, cols, normalize, dim, guide)
    masked = masked_by(masking, judged, ids)

    total = 0.0
    for i in range(nq):
        for j in range(len(cols)):
            if not masked(i, j):
                total = total - F.logsigmoid((1.0 if j == i else -1.0) * (scale * ms[i][j] + bias))
    return total / nq


def _problem(k: int, seed: int):
    q, p, n, scale, _, ids = masked_problem(k, seed)
    return q, p, n, scale, torch.tensor(BIAS, dtype=torch.float64), ids


def _want(k: int, normalize: bool, masking: FalseNegatives, seed: int, guided: bool = False):
    """The problem, the reference's (loss, dq, dD, ds), its db, and the guide (or None)."""
    problem_ = _problem(k, seed)
    guide_tensors, guide = _guide(problem_, seed) if guided else (None, None)
    rq, rp, rn, rs, rb = leaves(*problem_[:5])
    loss = reference(rq, rp, rn, rs, rb, problem_[5], masking, normalize, guide_tensors)
    (db,) = torch.autograd.grad(loss, rb, retain_graph=True)
    return problem_, (loss.detach(), *wanted(loss, rq, rp, rn, rs)), db, guide


def _assert_bias(objective, problem_, db, guide, ranks: Ranks, own: slice) -> None:
    """dL/db of the streamed form (its rows' shares, summed over ranks) and of the step's microbatch loss."""
    q, p, n, scale, bias, ids = problem_
    k = 0 if n is None else len(n) // len(q)
    cols = p if n is None else torch.cat([p, n])
    bound = objective if guide is None else objective.with_guide(guide)
    out = bound.streamed(q[own], cols, scale, bias, first_row=own.start, num_queries=N, chunk=3, ranks=ranks, ids=ids)
    _close(ranks.sum(out.bias_rows.sum()), db, "streamed db")
    docs, local_ids = per_sample(p, n, ids, k, own)
    lq, ls, lb, ldocs = leaves(q[own], scale, bias, docs)
    MicrobatchLoss(objective, ranks.group)(lq, ldocs, ls, lb, ids=local_ids, guide=guide).backward()
    _close(ranks.sum(lb.grad.clone()) / ranks.world, db, "microbatch db")


CASES = [
    (k, normalize, mask, guided)
    for k in (0, K)
    for normalize in (False, True)
    for mask, guided in (("none", False), ("duplicates", False), ("margin", False), ("relative", False), ("all", True))
    if mask in ("none", "all") or normalize == bool(k)
]


def _objective(normalize: bool, mask: str) -> LateSigmoid:
    late = late_interaction(Sigmoid(MASKINGS[mask]), DIM, normalize)
    assert isinstance(late, LateSigmoid)
    return late


@pytest.mark.parametrize(
    ("k", "normalize", "mask", "guided"),
    CASES,
    ids=[f"k{k}-{'normalized-' if m else ''}{mask}{'-guided' if g else ''}" for k, m, mask, g in CASES],
)
def test_every_form_matches_the_definition(k: int, normalize: bool, mask: str, guided: bool) -> None:
    problem_, want, db, guide = _want(k, normalize, MASKINGS[mask], 0, guided)
    objective = _objective(normalize, mask)
    assert_forms(objective, problem_, want, guide=guide)
    _assert_bias(objective, problem_, db, guide, Ranks(None), slice(0, N))
    dq, dcols, ds, dbias = leaves(
        problem_[0], torch.cat([problem_[1], problem_[2]]) if k else problem_[1], *problem_[3:5]
    )
    bound = objective if guide is None else objective.with_guide(guide)
    bound.dense(dq, dcols, ds, dbias, problem_[5]).backward()
    _close(dbias.grad, db, "dense db")


def test_tiles_of_a_column_or_two_match_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of one or two columns (the tile budget shrunk): a block's positives fall in different tiles, and the
    masks read each tile where it sits in the block's row."""
    from titan_contrastive.losses import maxsim

    monkeypatch.setattr(maxsim, "TILE_ELEMENTS", 2 * 5 * LQ * LD)
    problem_, want, db, guide = _want(K, True, MASKINGS["all"], 2)
    objective = _objective(True, "all")
    assert_forms(objective, problem_, want)
    _assert_bias(objective, problem_, db, guide, Ranks(None), slice(0, N))


def test_matryoshka_of_each_token_wraps_it() -> None:
    """Each token cut to its first m components and normalized again, the sigmoid loss over their MaxSim at each m
    (one t and one b), sum_m w_m L_m, in every form."""
    from tests.test_late_matryoshka import cut
    from titan_contrastive.losses import Matryoshka

    problem_ = _problem(K, 4)
    dims, weights = (3, 2), (1.0, 0.5)
    rq, rp, rn, rs, rb = leaves(*problem_[:5])
    loss = sum(
        w * reference(cut(rq, m), cut(rp, m), cut(rn, m), rs, rb, problem_[5], MASKINGS["none"], True, dim=m)
        for m, w in zip(dims, weights)
    )
    objective = late_interaction(Matryoshka(Sigmoid(), dims, weights), DIM, normalize=True)
    assert_forms(objective, problem_, (loss.detach(), *wanted(loss, rq, rp, rn, rs)))


def test_each_rule_and_the_bias_change_the_loss() -> None:
    """Else a form that ignored a rule, the guide, the normalization or the bias would still pass."""
    q, p, n, scale, bias, ids = _problem(K, 0)
    guide_tensors = _guide((q, p, n, scale, bias, ids), 0)[0]
    losses = {
        name: float(reference(q, p, n, scale, bias, ids, MASKINGS[name], False))
        for name in ("none", "duplicates", "margin", "relative")
    }
    losses["guided"] = float(reference(q, p, n, scale, bias, ids, MASKINGS["all"], False, guide_tensors))
    losses["normalized"] = float(reference(q, p, n, scale, bias, ids, MASKINGS["none"], True))
    losses["no bias"] = float(reference(q, p, n, scale, 0.0, ids, MASKINGS["none"], False))
    assert len(set(losses.values())) == len(losses), losses


def test_colpali_engine_sigmoid_loss_is_ours_without_a_bias() -> None:
    """colpali-engine's ColbertSigmoidLoss (its code's operations: MaxSim by einsum and amax, the scores over the
    query lengths, softplus(-scores z / T) averaged over the N^2 pairs) is ours with t = 1 / T and b = 0, over N."""
    q, p, _, _, _, _ = _problem(0, 3)
    temperature = 0.02
    qt, dt = q.view(N, -1, DIM), p.view(N, -1, DIM)
    lengths = (qt[:, :, 0] != 0).sum(1)
    raw = torch.einsum("bnd,csd->bcns", qt, dt).masked_fill(~(dt != 0).any(-1)[None, :, None], -torch.inf)
    scores = raw.amax(3).sum(2) / lengths[:, None]
    signs = -torch.ones(N * N, dtype=torch.float64)
    signs[torch.arange(N) * (N + 1)] = 1.0
    theirs = F.softplus(-scores.reshape(-1) / temperature * signs).mean()
    scale = torch.tensor(1 / temperature, dtype=torch.float64)
    ours = LateSigmoid(token_dim=DIM, normalize=True).dense(q, p, scale, torch.tensor(0.0, dtype=torch.float64))
    assert abs(float(ours) / N - float(theirs)) <= 1e-10 * float(theirs)


def _distributed() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    ranks, world, rank = Ranks(dist.group.WORLD), dist.get_world_size(), dist.get_rank()
    own = slice(rank * (N // world), (rank + 1) * (N // world))
    for k, normalize, mask, guided in CASES:
        problem_, want, db, guide = _want(k, normalize, MASKINGS[mask], 1, guided)
        objective = _objective(normalize, mask)
        assert_distributed_forms(objective, problem_, want, f"k{k}-{normalize}-{mask}-{guided}", guide=guide)
        _assert_bias(objective, problem_, db, guide, ranks, own)


@pytest.mark.parametrize("world", TWO_AND_FOUR)
def test_distributed_forms_match_the_definition(world: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_distributed(_distributed, world)
