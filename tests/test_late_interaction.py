"""Late interaction (`losses/late_interaction.py`): every form against InfoNCE over MaxSim written here one
query-document pair at a time, in float64, with hard negatives, padded tokens on both sides, query and document
token counts that differ, one-way and symmetric, each query's score over its token count or not (ColPali's
normalize_scores), on 1, 2 and 4 gloo processes, chunks that divide nothing."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import TWO_AND_FOUR, run_distributed
from tests.objective_forms import assert_distributed_forms, assert_forms, wanted
from tests.test_objectives import N, leaves
from titan_contrastive.losses import InfoNCE, MicrobatchLoss, Ranks
from titan_contrastive.losses.late_interaction import LateInteraction, late_interaction

K, LQ, LD, DIM = 2, 4, 5, 3  # hard negatives per query, query and document tokens, token width


def _token_rows(n: int, length: int, gen: torch.Generator, near: torch.Tensor | None = None) -> torch.Tensor:
    """[n, length * DIM]: unit tokens, row r's last r % 3 tokens zero (padding, or skipped)."""
    t = torch.randn(n, length, DIM, generator=gen, dtype=torch.float64)
    if near is not None:
        t[:, : near.shape[1]] += 2 * near
    t = F.normalize(t, dim=-1)
    for r in range(n):
        if r % 3:
            t[r, length - r % 3 :] = 0
    return t.flatten(1)


def problem(k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = _token_rows(N, LQ, gen)
    qt = q.view(N, LQ, DIM)
    p = _token_rows(N, LD, gen, near=qt)
    n = _token_rows(N * k, LD, gen, near=qt.repeat_interleave(k, 0)) if k else None
    return q, p, n, torch.tensor(3.0, dtype=torch.float64), None, torch.arange(N * (1 + k))


def maxsim(qi: torch.Tensor, dj: torch.Tensor, dim: int) -> torch.Tensor:
    """sum over the query's tokens of the largest product with a document token that is not zero."""
    doc = dj.view(-1, dim)
    doc = doc[(doc != 0).any(1)]
    return (qi.view(-1, dim) @ doc.T).amax(1).sum()


def reference(q, p, n, scale, symmetric: bool, dim: int = DIM, normalize: bool = False):
    """InfoNCE over t MaxSim, query i's positive being column i (`p` then `n`, the hard negatives); `normalize`: each
    query's MaxSim over its count of tokens that are not zero."""
    cols, nq = (p if n is None else torch.cat([p, n])), len(q)
    count = [int((q[i].view(-1, dim) != 0).any(1).sum()) if normalize else 1 for i in range(nq)]
    s = torch.stack(
        [torch.stack([scale * maxsim(q[i], cols[j], dim) / count[i] for j in range(len(cols))]) for i in range(nq)]
    )
    forward = sum(torch.logsumexp(s[i], 0) - s[i, i] for i in range(nq)) / nq
    if not symmetric:
        return forward
    backward = sum(torch.logsumexp(s[:, j], 0) - s[j, j] for j in range(nq)) / nq
    return (forward + backward) / 2


CASES = [(k, sym, False) for k in (0, K) for sym in (False, True)] + [(K, False, True), (0, True, True)]


def _want(k: int, symmetric: bool, seed: int, normalize: bool = False):
    problem_ = problem(k, seed)
    rq, rp, rn, rs = leaves(*problem_[:4])
    loss = reference(rq, rp, rn, rs, symmetric, normalize=normalize)
    return problem_, (loss.detach(), *wanted(loss, rq, rp, rn, rs))


@pytest.mark.parametrize(
    ("k", "symmetric", "normalize"),
    CASES,
    ids=[f"k{k}-{'sym' if s else 'oneway'}{'-normalized' if m else ''}" for k, s, m in CASES],
)
def test_every_form_matches_the_definition(k: int, symmetric: bool, normalize: bool) -> None:
    problem_, want = _want(k, symmetric, 0, normalize)
    assert_forms(LateInteraction(DIM, symmetric, normalize), problem_, want)


def test_tiles_smaller_than_a_block_match_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of one or two columns (the module's tile budget shrunk) give the same loss and gradients."""
    from titan_contrastive.losses import maxsim as module

    monkeypatch.setattr(module, "TILE_ELEMENTS", 2 * 5 * LQ * LD)
    problem_, want = _want(K, True, 2)
    assert_forms(LateInteraction(DIM, True), problem_, want)


def _distributed() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for k, symmetric, normalize in CASES:
        problem_, want = _want(k, symmetric, 1, normalize)
        assert_distributed_forms(
            LateInteraction(DIM, symmetric, normalize), problem_, want, f"k{k}-{symmetric}-{normalize}"
        )


@pytest.mark.parametrize("world", TWO_AND_FOUR)
def test_distributed_forms_match_the_definition(world: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_distributed(_distributed, world)


@pytest.mark.parametrize("normalize", [False, True])
def test_scale_gradient_is_the_row_shares(normalize: bool) -> None:
    """MaxSim is positively homogeneous: the temperature's gradient from <q, dL/dq> / t equals autograd's."""
    q, p, n, scale, _, _ = problem(K, 3)
    objective = LateInteraction(DIM, normalize=normalize)
    out = objective.streamed(q, torch.cat([p, n]), scale, first_row=0, num_queries=N, chunk=5, ranks=Ranks(None))
    s = scale.clone().requires_grad_()
    (grad,) = torch.autograd.grad(reference(q, p, n, s, False, normalize=normalize), s)
    assert abs(out.scale_rows.sum() - grad) < 1e-10


def test_each_objective_has_its_late_interaction_twin() -> None:
    """InfoNCE and the sigmoid loss keep their options over MaxSim; an objective of another kind (one registered by
    a user, reading one vector per text) is one line."""
    from titan_contrastive.losses import FalseNegatives, Sigmoid
    from titan_contrastive.losses.late_sigmoid import LateSigmoid

    assert late_interaction(InfoNCE(False), 8) == LateInteraction(8, False)
    assert late_interaction(InfoNCE(True), 8, normalize=True) == LateInteraction(8, True, True)
    masked = late_interaction(InfoNCE(False, FalseNegatives(margin=0.1)), 8)
    assert masked == LateInteraction(8, False, false_negatives=FalseNegatives(margin=0.1))  # tests/test_late_masks.py
    sigmoid = late_interaction(Sigmoid(FalseNegatives(relative=0.9)), 8, normalize=True)
    assert sigmoid == LateSigmoid(
        FalseNegatives(relative=0.9), token_dim=8, normalize=True
    )  # tests/test_late_sigmoid.py
    with pytest.raises(ValueError, match=r"^model.pooling=colbert scores by late interaction, which InfoNCE"):
        late_interaction(InfoNCE(False, name="custom"), 8)


def test_widths_must_be_whole_tokens() -> None:
    q = torch.zeros(2, 4 * DIM)
    with pytest.raises(ValueError, match=r"must be \[B, d\]"):
        MicrobatchLoss(LateInteraction(DIM))(q, torch.zeros(2, 4 * DIM + 1), torch.tensor(1.0))
