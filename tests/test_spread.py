"""Global orthogonal regularization (`[loss] gor_weight`, `gor_mean_weight`, `losses/spread.py`) beside an
objective: each column's mean and second moment of its pairs' cosines, from the definition (every pair's
similarity written out, the diagonal left out) plus the contrastive reference of tests/test_objectives.py, in
float64 (<= 1e-10): dense, streamed with chunks that divide nothing, the microbatch loss; streamed and
microbatch on 2 and 4 gloo processes (the queries' statistics summed over the ranks). Against
sentence-transformers' GlobalOrthogonalRegularizationLoss on MiniLM's embeddings; through the trainer,
GradCache and global negatives with hard negatives equal the dense objective in the loss and every gradient."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import TWO_AND_FOUR, run_distributed
from tests.needs import needs
from tests.objective_forms import assert_distributed_forms, assert_forms, wanted
from tests.test_objectives import CASES, D, N, _close, leaves, objective_of, reference
from titan_contrastive.losses import Matryoshka, Spread

BASE = {c["name"]: c for c in CASES}
SCASES = [  # the contrastive objective, hard negatives, mean weight, second-moment weight, aggregation
    ("clip-sym-k0-none-full", 0, 0.0, 1.0, "sum"),
    ("clip-oneway-k2-margin-full", 2, 0.5, 2.0, "sum"),
    ("clip-sym-k2-none-mat", 2, 1.0, 0.7, "mean"),
    ("siglip-sym-k0-none-full", 0, 1.0, 0.0, "mean"),
]
PAIRS = [
    (dict(BASE[name], k=k), dict(mean=m, second=s, agg=a, name=f"{name}-m{m}-s{s}-{a}")) for name, k, m, s, a in SCASES
]


def clustered(case: dict, seed: int = 0):
    """Unit embeddings gathered around one direction, so both terms are far from 0 (random ones in 8 dims sit
    near the second moment's threshold 1/d); no duplicate documents."""
    gen = torch.Generator().manual_seed(70 + seed)
    centre = F.normalize(torch.randn(D, generator=gen, dtype=torch.float64), dim=0)

    def draw(n: int, spread: float) -> torch.Tensor:
        return F.normalize(centre + spread * torch.randn(n, D, generator=gen, dtype=torch.float64), dim=1)

    k = case["k"]
    q, p, n = draw(N, 0.6), draw(N, 0.8), draw(N * k, 0.9) if k else None
    ids = torch.arange(N * (1 + k))
    return q, p, n, torch.tensor(7.0, dtype=torch.float64), torch.tensor(-2.0, dtype=torch.float64), ids


def reference_gor(scase: dict, q, p, n) -> torch.Tensor:
    """Each column's pairwise similarities written out (the diagonal left out), its two terms, combined."""
    k = 0 if n is None else len(n) // len(q)
    groups = [q, p, *(n.view(len(q), k, -1)[:, j] for j in range(k))]
    means, seconds = [], []
    for x in groups:
        rows, dim = len(x), x.shape[1]
        sims = [x[i] @ x[j] for i in range(rows) for j in range(rows) if i != j]
        means.append((sum(sims) / len(sims)) ** 2)
        seconds.append(torch.relu(sum(s**2 for s in sims) / len(sims) - 1.0 / dim))
    reduce = sum if scase["agg"] == "sum" else (lambda t: sum(t) / len(t))
    return scase["mean"] * reduce(means) + scase["second"] * reduce(seconds)


def reference_total(case: dict, scase: dict, q, p, n, scale, bias, ids) -> torch.Tensor:
    total = reference(case, q, p, n, scale, bias, ids)
    for m, w in case["matryoshka"] or [(q.shape[1], 1.0)]:
        qm, pm, nm = (
            None if z is None else F.normalize(z[:, :m], dim=1) if case["matryoshka"] else z for z in (q, p, n)
        )
        total = total + w * reference_gor(scase, qm, pm, nm)
    return total


def objective_for(case: dict, scase: dict):
    objective = Spread(objective_of(dict(case, matryoshka=None)), scase["mean"], scase["second"], scase["agg"])
    if case["matryoshka"]:
        dims, weights = zip(*case["matryoshka"])
        objective = Matryoshka(objective, dims, weights)
    return objective


def test_both_terms_move_the_loss() -> None:
    case, scase = PAIRS[1]
    q, p, n, *_ = clustered(case)
    mean_only, second_only = dict(scase, second=0.0), dict(scase, mean=0.0)
    assert reference_gor(mean_only, q, p, n) > 0.05 and reference_gor(second_only, q, p, n) > 0.05


@pytest.mark.parametrize("pair", PAIRS, ids=[d["name"] for _, d in PAIRS])
def test_dense_streamed_and_microbatch_match_the_definition(pair) -> None:
    case, scase = pair
    problem = clustered(case)
    rq, rp, rn, rs, rb = leaves(*problem[:5])
    want_loss = reference_total(case, scase, rq, rp, rn, rs, rb, problem[5])
    assert_forms(objective_for(case, scase), problem, (want_loss.detach(), *wanted(want_loss, rq, rp, rn, rs)))


def _distributed() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for case, scase in PAIRS:
        problem = clustered(case, seed=1)
        rq, rp, rn, rs, rb = leaves(*problem[:5])
        want_loss = reference_total(case, scase, rq, rp, rn, rs, rb, problem[5])
        want = (want_loss.detach(), *wanted(want_loss, rq, rp, rn, rs))
        assert_distributed_forms(objective_for(case, scase), problem, want, scase["name"])


@pytest.mark.parametrize("world", TWO_AND_FOUR)
def test_distributed_forms_match_the_definition(world: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_distributed(_distributed, world)


@needs("hf")
@pytest.mark.parametrize("aggregation", ["sum", "mean"])
def test_equals_sentence_transformers_gor_loss(aggregation: str) -> None:
    """Our term on MiniLM's unit embeddings of queries and positives equals the sum of
    `GlobalOrthogonalRegularizationLoss.compute_loss_from_embeddings`' two terms, loss and gradients."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import GlobalOrthogonalRegularizationLoss

    from tests.test_hard_negatives import WORDS
    from titan_contrastive.losses import InfoNCE
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    model = SentenceTransformer(str(bundled_minilm()), device="cpu")
    a = model.encode([w[0] for w in WORDS], convert_to_tensor=True).double()
    b = model.encode([w[1] for w in WORDS], convert_to_tensor=True).double()
    ours_a, ours_b, theirs_a, theirs_b = leaves(a, b, a, b)
    gor = GlobalOrthogonalRegularizationLoss(model, mean_weight=0.5, second_moment_weight=2.0, aggregation=aggregation)
    terms = gor.compute_loss_from_embeddings([theirs_a, theirs_b])
    theirs = terms["gor_mean"] + terms["gor_second_moment"]
    assert terms["gor_second_moment"] > 0  # above the 1/d threshold
    ours = Spread(InfoNCE(True), 0.5, 2.0, aggregation).whole(*(F.normalize(z, dim=1) for z in (ours_a, ours_b)))
    theirs.backward()
    ours.backward()
    _close(ours.detach(), theirs.detach(), "loss")
    _close(ours_a.grad, theirs_a.grad, "d queries")
    _close(ours_b.grad, theirs_b.grad, "d positives")


KINDS = {  # local batch, accumulation steps, options
    "gradcache": (6, 1, ["--gradcache.enabled=true", "--gradcache.chunk_sizes=4"]),
    "global": (3, 2, ["--loss.negatives=global", "--loss.stream_chunk_size=5"]),
}


@needs("hf")
@pytest.mark.parametrize("kind", list(KINDS))
def test_gor_in_every_step_kind_equals_the_dense_objective(tmp_path: Path, kind: str) -> None:
    """MiniLM with two hard negatives per row, one-way InfoNCE plus GOR's two terms: the step's loss and every
    parameter gradient equal the dense objective over the whole batch."""
    from tests.test_hard_negatives import REL, assert_grads_close, dense_reference, make_trainer, pairs_file
    from tests.test_trainer import grads

    local, ga, extra = KINDS[kind]
    pairs_file(tmp_path)
    trainer = make_trainer(
        tmp_path,
        f"--training.local_batch_size={local}",
        f"--training.global_batch_size={local * ga}",
        "--loss.symmetric=false",
        "--loss.gor_weight=2.0",
        "--loss.gor_mean_weight=0.5",
        *extra,
    )
    assert "GOR (0.5 x its mean, 2 x its second moment, sum over the columns)" in trainer.gradient_step.describe()
    trainer.model.eval()
    data = trainer.train_set
    steps = [data.__getitems__(list(range(j * local, (j + 1) * local))) for j in range(ga)]
    every = {key: torch.cat([s[key] for s in steps]) for key in steps[0]}
    want_loss, want = dense_reference(trainer, every)
    out = trainer.train_step(steps)
    assert_grads_close(grads(trainer.model), want)
    assert abs(out["loss"] - want_loss) <= REL * want_loss
    trainer.metrics.close()


def test_an_aggregation_without_a_weight_is_one_line() -> None:
    from titan_contrastive.config import ConfigError, parse_args
    from titan_contrastive.losses import build_objective

    with pytest.raises(ConfigError, match=r"^loss.gor_aggregation='mean' combines GOR's columns, and loss.gor_weight"):
        build_objective(parse_args(["--loss.gor_aggregation=mean"]).loss)
    assert isinstance(build_objective(parse_args(["--loss.gor_weight=1"]).loss), Spread)
