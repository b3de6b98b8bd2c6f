"""The pairwise loss (`losses/pairwise.py`, `[loss] name = "pairwise"`): every form against colpali-engine's
pairwise losses written here as it writes them (its top-2 pick of the hardest in-batch negative; BiPairwiseCELoss,
BiPairwiseNegativeCELoss, ColbertPairwiseCELoss, ColbertPairwiseNegativeCELoss; with `in_batch = "infonce"`
BiNegativeCELoss and ColbertNegativeCELoss), in float64, over dot products and
over MaxSim of token sets with padding (each query's score over its token count or not), with and without hard
negatives, at several in-batch weights, wrapped in Matryoshka; on 1, 2 and 4 gloo processes, chunks that divide
nothing; a problem of one query; through the trainer's step kinds as ColBERT (dropout replayed by GradCache); the
settings it cannot take refused in one line; a distillation term and GOR beside it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import TWO_AND_FOUR, run_distributed
from tests.marks import slow_ones
from tests.needs import needs
from tests.objective_forms import assert_distributed_forms, assert_forms, wanted
from tests.test_late_interaction import maxsim
from tests.test_late_interaction import problem as token_problem
from tests.test_objectives import N, leaves
from titan_contrastive.config import ConfigError, parse_args
from titan_contrastive.losses import FalseNegatives, Matryoshka, Pairwise, build_objective
from titan_contrastive.losses.late_interaction import LatePairwise, late_interaction
from titan_contrastive.losses.matryoshka import prefix

D, TOKEN = 8, 3  # dot products' width; the token width of tests/test_late_interaction.py's problems


def dot_problem(k: int, seed: int = 0):
    """Unit queries, positives near them, k hard negatives per query nearer still for some, one positive nearly
    another's (a hardest negative close to the positive)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(N, D, generator=gen, dtype=torch.float64), dim=1)
    p = F.normalize(q + 0.9 * torch.randn(N, D, generator=gen, dtype=torch.float64), dim=1)
    p[3] = F.normalize(p[7] + 1e-3 * torch.randn(D, generator=gen, dtype=torch.float64), dim=0)
    n = None
    if k:
        noise = torch.randn(N * k, D, generator=gen, dtype=torch.float64)
        n = F.normalize(q.repeat_interleave(k, 0) + 0.8 * noise, dim=1)
    return q, p, n, torch.tensor(3.0, dtype=torch.float64), None, torch.arange(N * (1 + k))


def colpali_scores(q, docs, dim: int, normalize: bool):
    """colpali-engine's scores of every query with every document: dot products, or MaxSim (without the padding's
    zero tokens) over each query's length counted by its tokens' first component, as its `_apply_normalization`."""
    if not dim:
        return q @ docs.T
    out = torch.stack([torch.stack([maxsim(q[i], docs[j], dim) for j in range(len(docs))]) for i in range(len(q))])
    lengths = (q.view(len(q), -1, dim)[:, :, 0] != 0).sum(1)
    return out / lengths[:, None] if normalize else out


def colpali_pairwise(q, p, n, scale, weight: float, dim: int = 0, normalize: bool = False):
    """Bi/ColbertPairwiseCELoss without hard negatives, Bi/ColbertPairwiseNegativeCELoss with them (`weight`: its
    in_batch_term_weight), at temperature 1 / scale."""
    scores = scale * colpali_scores(q, p, dim, normalize)
    pos = scores.diagonal()
    top2 = scores.topk(2, dim=1).values
    neg = torch.where(top2[:, 0] == pos, top2[:, 1], top2[:, 0])
    in_batch = F.softplus(neg - pos).mean()
    if n is None:
        return in_batch
    k = len(n) // len(q)
    negs = torch.stack(
        [scale * colpali_scores(q[i : i + 1], n[i * k : (i + 1) * k], dim, normalize)[0] for i in range(len(q))]
    )
    return (1 - weight) * F.softplus(negs - pos[:, None]).mean() + weight * in_batch


def colpali_negative_ce(q, p, n, scale, weight: float, dim: int = 0, normalize: bool = False):
    """Bi/ColbertNegativeCELoss (`weight`: its in_batch_term_weight) at temperature 1 / scale: each hard negative's
    softplus beside its BiEncoderLoss / ColbertLoss, cross-entropy over the positives; without hard negatives that
    cross-entropy alone."""
    scores = scale * colpali_scores(q, p, dim, normalize)
    in_batch = F.cross_entropy(scores, torch.arange(len(q)))
    if n is None:
        return in_batch
    k = len(n) // len(q)
    negs = torch.stack(
        [scale * colpali_scores(q[i : i + 1], n[i * k : (i + 1) * k], dim, normalize)[0] for i in range(len(q))]
    )
    loss = F.softplus(negs - scores.diagonal()[:, None]).mean()
    return loss * (1 - weight) + in_batch * weight


def _matryoshka_reference(dims, weights, token: int):
    def reference(q, p, n, scale, weight, dim=0, normalize=False):
        cut = [lambda z, m=m: None if z is None else prefix(z, m, token) for m in dims]
        terms = [
            colpali_pairwise(c(q), c(p), c(n), scale, weight, m if token else 0, normalize) for c, m in zip(cut, dims)
        ]
        return sum(w * term for w, term in zip(weights, terms))

    return reference


# (name, objective, k, in-batch weight, token width, normalize, reference)
CASES = [
    ("dot", Pairwise(), 0, 0.5, 0, False, colpali_pairwise),
    ("dot-negatives", Pairwise(), 2, 0.5, 0, False, colpali_pairwise),
    ("dot-negatives-w0.3", Pairwise(0.3), 2, 0.3, 0, False, colpali_pairwise),
    ("dot-negatives-only", Pairwise(0.0), 2, 0.0, 0, False, colpali_pairwise),
    ("dot-negatives-matryoshka", Matryoshka(Pairwise(), (8, 4), (1.0, 0.5)), 2, 0.5, 0, False,
     _matryoshka_reference((8, 4), (1.0, 0.5), 0)),
    ("maxsim", LatePairwise(token_dim=TOKEN), 0, 0.5, TOKEN, False, colpali_pairwise),
    ("maxsim-normalized", LatePairwise(token_dim=TOKEN, normalize=True), 0, 0.5, TOKEN, True, colpali_pairwise),
    ("maxsim-negatives-normalized", LatePairwise(token_dim=TOKEN, normalize=True), 2, 0.5, TOKEN, True,
     colpali_pairwise),
    ("maxsim-negatives-w0.8-matryoshka", Matryoshka(LatePairwise(0.8, token_dim=TOKEN), (3, 2), (1.0, 1.0)), 2, 0.8,
     TOKEN, False, _matryoshka_reference((3, 2), (1.0, 1.0), TOKEN)),
    ("dot-negative-ce", Pairwise(0.5, "infonce"), 2, 0.5, 0, False, colpali_negative_ce),
    ("dot-negative-ce-w0.3", Pairwise(0.3, "infonce"), 2, 0.3, 0, False, colpali_negative_ce),
    ("dot-infonce-alone", Pairwise(0.5, "infonce"), 0, 0.5, 0, False, colpali_negative_ce),
    ("maxsim-negative-ce-normalized", LatePairwise(0.5, "infonce", token_dim=TOKEN, normalize=True), 2, 0.5, TOKEN,
     True, colpali_negative_ce),
    ("maxsim-negative-ce-w0.7", LatePairwise(0.7, "infonce", token_dim=TOKEN), 2, 0.7, TOKEN, False,
     colpali_negative_ce),
]  # fmt: skip


def _want(case, seed: int):
    _, _, k, weight, dim, normalize, reference = case
    problem = token_problem(k, seed) if dim else dot_problem(k, seed)
    rq, rp, rn, rs = leaves(*problem[:4])
    loss = reference(rq, rp, rn, rs, weight, dim, normalize)
    return problem, (loss.detach(), *wanted(loss, rq, rp, rn, rs))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_form_matches_colpali_engines_loss(case) -> None:
    problem, want = _want(case, 0)
    assert want[0] > 0.05 and want[1].abs().max() > 1e-3  # a loss with gradient to hold the forms to
    assert_forms(case[1], problem, want)


def test_a_distillation_term_and_gor_add_to_it() -> None:
    """The terms beside an objective wrap the pairwise loss as any: a KL term on the data's teacher scores beside it
    (weighted 0.5 and 0.7) and GOR over its columns, every form against colpali-engine's loss plus the term's
    definition (tests/test_distill.py's, tests/test_spread.py's)."""
    from tests.test_distill import reference_term, teacher_of
    from tests.test_spread import reference_gor
    from titan_contrastive.losses import Distillation, Distilled, Spread

    problem = dot_problem(2, 5)
    teacher = teacher_of(2, 5)
    gor = {"mean": 0.3, "second": 1.0, "agg": "sum"}
    for objective, term, bound in (
        (
            Distilled(Pairwise(0.4), Distillation("kl", 0.7, 2.0), 0.5),
            lambda q, p, n, s: 0.7 * reference_term("kl", 2.0, q, p, n, s, teacher),
            teacher,
        ),
        (Spread(Pairwise(0.4), 0.3, 1.0, "sum"), lambda q, p, n, s: reference_gor(gor, q, p, n), None),
    ):
        weight = 0.5 if bound is not None else 1.0
        rq, rp, rn, rs = leaves(*problem[:4])
        loss = weight * colpali_pairwise(rq, rp, rn, rs, 0.4) + term(rq, rp, rn, rs)
        assert_forms(objective, problem, (loss.detach(), *wanted(loss, rq, rp, rn, rs)), teacher=bound)


def _distributed() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for case in CASES:
        problem, want = _want(case, 1)
        assert_distributed_forms(case[1], problem, want, case[0])


@pytest.mark.parametrize("world", TWO_AND_FOUR)
def test_distributed_forms_match_colpali_engines_loss(world: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_distributed(_distributed, world)


@pytest.mark.parametrize("k", [0, 2])
def test_one_query_has_no_in_batch_negative(k: int) -> None:
    """With one query the in-batch term is 0 (colpali-engine's top-2 pick fails there): the loss is the hard
    negatives' term, weighted 1 - w, or 0 without them; every form agrees."""
    q, p, n, scale, _, _ = dot_problem(2, 4)
    q, p, n = q[:1], p[:1], (n[:k] if k else None)
    cols = p if n is None else torch.cat([p, n])
    objective = Pairwise(0.25)
    want = 0.75 * F.softplus(scale * (n @ q[0] - p[0] @ q[0])).mean() if k else torch.tensor(0.0, dtype=q.dtype)
    assert abs(objective.dense(q, cols, scale) - want) < 1e-12
    from titan_contrastive.losses import Ranks

    out = objective.streamed(q, cols, scale, first_row=0, num_queries=1, chunk=1, ranks=Ranks(None))
    assert abs(out.loss - want) < 1e-12
    assert (out.grad_rows.abs().max() > 0) == bool(k)


def masked_reference(q, p, n, scale, ids, masking, weight: float, in_batch: str, dim: int = 0, normalize=False):
    """The pairwise loss (or, `in_batch = "infonce"`, the NegativeCE form) written one (query, column) at a time with
    the false-negative rules: column j != i leaves row i's terms when its id is the positive's (duplicates), or its
    score (dot product, or MaxSim over the query's tokens where `normalize`) exceeds the positive's by the margin or
    `relative` times it. The hardest in-batch negative is the hardest left (none: no term); a masked hard negative's
    term is 0 (the normalizer N k stays); InfoNCE's softmax leaves it out."""
    from tests.test_late_masks import masked_by

    cols, nq = (p if n is None else torch.cat([p, n])), len(q)
    k = (len(cols) - nq) // nq
    raw = colpali_scores(q, cols, dim, normalize)
    judged = raw.detach().tolist()

    masked = masked_by(masking, judged, ids)

    logits = scale * raw
    in_batch_terms = []
    for i in range(nq):
        others = [j for j in range(nq) if j != i and not masked(i, j)]
        if in_batch == "infonce":
            kept = [i, *others]
            in_batch_terms.append(-torch.log_softmax(logits[i, kept], 0)[0])
        elif others:
            hardest = torch.stack([logits[i, j] for j in others]).max()
            in_batch_terms.append(F.softplus(hardest - logits[i, i]))
    in_term = sum(in_batch_terms) / nq if nq > 1 else 0.0
    if not k:
        return in_term
    own = [(i, nq + i * k + c) for i in range(nq) for c in range(k)]
    e_term = sum(F.softplus(logits[i, j] - logits[i, i]) for i, j in own if not masked(i, j)) / (nq * k)
    return (1 - weight) * e_term + weight * in_term


def _masked_problem(dim: int, k: int, seed: int):
    """A problem whose masks remove something: positive 3 a near copy of positive 7 (one id), and with hard negatives
    query 2's second a near copy of its positive (its id)."""
    if dim:
        from tests.test_late_masks import masked_problem

        return masked_problem(k, seed)
    q, p, n, scale, bias, ids = dot_problem(k, seed)
    ids[3] = ids[7]
    if k:
        n[2 * k + 1] = F.normalize(p[2] + 1e-3 * torch.randn(D, dtype=torch.float64), dim=0)
        ids[N + 2 * k + 1] = ids[2]
    return q, p, n, scale, bias, ids


# (name, token width, normalize, k, in-batch term, weight, masking)
MASK_CASES = [
    ("dot-k2-hardest-all", 0, False, 2, "hardest", 0.5, "all"),
    ("dot-k0-hardest-relative", 0, False, 0, "hardest", 0.5, "relative"),
    ("dot-k2-infonce-all", 0, False, 2, "infonce", 0.3, "all"),
    ("maxsim-k2-hardest-all", TOKEN, True, 2, "hardest", 0.5, "all"),
    ("maxsim-k2-infonce-margin", TOKEN, False, 2, "infonce", 0.5, "margin"),
    ("maxsim-k0-infonce-duplicates", TOKEN, True, 0, "infonce", 0.5, "duplicates"),
]


def _mask_case(case, seed: int):
    from tests.test_objectives import MASKINGS

    _, dim, normalize, k, in_batch, weight, mask = case
    masking = MASKINGS[mask]
    objective = (
        LatePairwise(weight, in_batch, masking, token_dim=dim, normalize=normalize)
        if dim
        else Pairwise(weight, in_batch, masking)
    )
    problem = _masked_problem(dim, k, seed)
    rq, rp, rn, rs = leaves(*problem[:4])
    loss = masked_reference(rq, rp, rn, rs, problem[5], masking, weight, in_batch, dim, normalize)
    unmasked = masked_reference(*problem[:4], problem[5], MASKINGS["none"], weight, in_batch, dim, normalize)
    assert abs(float(loss.detach()) - float(unmasked)) > 1e-6, "the mask removes nothing here"
    return objective, problem, (loss.detach(), *wanted(loss, rq, rp, rn, rs))


@pytest.mark.parametrize("case", MASK_CASES, ids=[c[0] for c in MASK_CASES])
def test_false_negative_masks_remove_columns_in_every_form(case) -> None:
    objective, problem, want = _mask_case(case, 0)
    assert objective.needs_ids == (case[6] in ("duplicates", "all"))
    assert_forms(objective, problem, want)


def _distributed_masks() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for case in MASK_CASES:
        objective, problem, want = _mask_case(case, 1)
        assert_distributed_forms(objective, problem, want, case[0])


@pytest.mark.parametrize("world", TWO_AND_FOUR)
def test_distributed_masks(world: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_distributed(_distributed_masks, world)


def test_the_settings_it_cannot_take_are_one_line() -> None:
    assert build_objective(parse_args(["--loss.name=pairwise"]).loss) == Pairwise(0.5)
    cfg = parse_args(["--loss.name=pairwise", "--loss.pairwise_in_batch_weight=0.2"])
    assert build_objective(cfg.loss) == Pairwise(0.2)
    assert late_interaction(Pairwise(0.2), 16, True) == LatePairwise(0.2, token_dim=16, normalize=True)
    cfg = parse_args(["--loss.name=pairwise", "--loss.pairwise_in_batch=infonce"])
    assert build_objective(cfg.loss) == Pairwise(0.5, "infonce")
    assert late_interaction(Pairwise(0.2, "infonce"), 16) == LatePairwise(0.2, "infonce", token_dim=16)
    with pytest.raises(ConfigError, match=r"^loss.pairwise_in_batch=infonce picks the pairwise loss's in-batch term"):
        build_objective(parse_args(["--loss.pairwise_in_batch=infonce"]).loss)
    with pytest.raises(
        ConfigError, match=r"loss.pairwise_in_batch='softmax' is not a valid choice; choose one of: hard"
    ):
        parse_args(["--loss.name=pairwise", "--loss.pairwise_in_batch=softmax"])
    with pytest.raises(
        ConfigError, match=r"^loss.pairwise_in_batch_weight=1.5 is out of range: expected a number in \[0, 1\]"
    ):
        parse_args(["--loss.name=pairwise", "--loss.pairwise_in_batch_weight=1.5"])
    with pytest.raises(ConfigError, match=r"^loss.pairwise_in_batch_weight=0.2 weighs the pairwise loss's terms, and"):
        build_objective(parse_args(["--loss.pairwise_in_batch_weight=0.2"]).loss)
    masked = build_objective(parse_args(["--loss.name=pairwise", "--loss.mask_margin=0.1"]).loss)
    assert masked == Pairwise(0.5, "hardest", FalseNegatives(margin=0.1))
    assert "false negatives masked (cos > positive + 0.1)" in masked.describe()
    with pytest.raises(ConfigError, match=r"^loss.hardness_strength=2.0: loss.name='pairwise' does not take it"):
        build_objective(parse_args(["--loss.name=pairwise", "--loss.hardness_strength=2"]).loss)


# ---- through the trainer, as ColBERT (MiniLM, a new 8-wide projection, two hard negatives per row)

COLBERT = ["--model.pooling=colbert", "--model.colbert_dim=8", "--data.doc_context_length=12", "--loss.name=pairwise"]
NEGATIVE_CE = ["--loss.pairwise_in_batch=infonce"]
KINDS = {  # local batch, accumulation steps, options
    "accumulate": (6, 1, ["--loss.maxsim_normalize=true"]),
    "gradcache": (
        6,
        1,
        ["--gradcache.enabled=true", "--gradcache.chunk_sizes=4", "--loss.pairwise_in_batch_weight=0.3"],
    ),
    "gradcache-tokens": (6, 1, ["--gradcache.enabled=true", "--gradcache.chunk_tokens=50"]),
    "global": (3, 2, ["--loss.negatives=global", "--loss.stream_chunk_size=5", "--loss.maxsim_normalize=true"]),
    "gradcache-negative-ce": (6, 1, ["--gradcache.enabled=true", "--gradcache.chunk_sizes=4", *NEGATIVE_CE]),
    "global-negative-ce": (3, 2, ["--loss.negatives=global", "--loss.stream_chunk_size=5", *NEGATIVE_CE,
                                  "--loss.maxsim_normalize=true"]),
}  # fmt: skip


def _dense(trainer, every: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """colpali-engine's loss over all samples, on a float64 copy of the model in the trainer's mode."""
    from tests.test_colbert import dense_with

    terms = trainer.cfg.loss
    loss = colpali_negative_ce if terms.pairwise_in_batch == "infonce" else colpali_pairwise
    return dense_with(
        trainer, every, lambda q, p, n, s: loss(q, p, n, s, terms.pairwise_in_batch_weight, 8, terms.maxsim_normalize)
    )


@needs("hf")
# token chunks (gradcache has the chunked step) and the plain accumulation of colpali's pairwise term slow
@pytest.mark.parametrize("kind", slow_ones(KINDS, ["gradcache-tokens", "accumulate"]))
def test_every_step_kind_equals_colpali_engines_loss(tmp_path: Path, kind: str) -> None:
    from tests.test_hard_negatives import pairs_file, step_against

    pairs_file(tmp_path)
    trainer = step_against(tmp_path, KINDS[kind], *COLBERT, reference=_dense)
    assert "pairwise loss" in trainer.gradient_step.describe() and "MaxSim" in trainer.gradient_step.describe()


@needs("hf")
@pytest.mark.parametrize("kind", ["gradcache", "global-negative-ce"])
def test_masks_in_the_trainers_steps(tmp_path: Path, kind: str) -> None:
    """colpali-engine's positive-aware filtering as removal (relative 0.9) and duplicate documents (their token ids),
    ColQwen2's pairwise recipe and the NegativeCE form, against `masked_reference` over every sample."""
    from tests.test_colbert import dense_with
    from tests.test_hard_negatives import pairs_file, step_against
    from titan_contrastive.batching import with_negatives

    masking = FalseNegatives(duplicates=True, relative=0.9)

    def reference(trainer, every: dict) -> tuple[float, dict[str, torch.Tensor]]:
        rows = with_negatives(every["doc"], every["neg"], trainer.model.pad_id).view(len(every["doc"]), 3, -1)
        ids = torch.unique(torch.cat([rows[:, 0], rows[:, 1:].flatten(0, 1)]), dim=0, return_inverse=True)[1]
        terms = trainer.cfg.loss

        def loss_of(q, p, n, s, rules=masking):
            w, norm = terms.pairwise_in_batch_weight, terms.maxsim_normalize
            return masked_reference(q, p, n, s, ids, rules, w, terms.pairwise_in_batch, 8, norm)

        unmasked = dense_with(trainer, every, lambda *z: loss_of(*z, rules=FalseNegatives()))[0]
        loss, want = dense_with(trainer, every, loss_of)
        assert abs(loss - unmasked) > 1e-6, "the mask removes nothing here"
        return loss, want

    pairs_file(tmp_path)
    options = [*COLBERT, "--loss.mask_relative=0.9", "--loss.mask_duplicates=true"]
    trainer = step_against(tmp_path, KINDS[kind], *options, reference=reference)
    assert "false negatives masked (duplicate ids or MaxSim > 0.9 x positive)" in trainer.gradient_step.describe()


@needs("hf")
def test_gradcache_with_dropout_on(tmp_path: Path) -> None:
    """GradCache's re-forward replays each chunk's dropout: the step equals the objective over the same forwards."""
    from tests.test_hard_negatives import assert_step_equals_its_forwards, make_trainer, pairs_file

    pairs_file(tmp_path)
    trainer = make_trainer(tmp_path, "--training.local_batch_size=6", *COLBERT, *KINDS["gradcache"][2])
    assert trainer.model.training and isinstance(trainer.objective, LatePairwise)
    batch = trainer.train_set.__getitems__(list(range(6)))
    chunks = [{k: v[i : i + 4] for k, v in batch.items()} for i in (0, 4)]
    assert_step_equals_its_forwards(trainer, [batch], chunks, seed=5, objective=trainer.objective)
    trainer.metrics.close()
