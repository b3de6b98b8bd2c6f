"""Matryoshka under late interaction (`losses/matryoshka.py` over `losses/late_interaction.py`: Jina-ColBERT-v2's
token-level Matryoshka, sentence-transformers' MultiVectorMatryoshkaLoss): sum_m w_m x the objective over each token
cut to its first m components and normalized again (a zero token staying zero), scored by MaxSim of m-wide tokens,
written here one pair at a time. Every form against it in float64 (<= 1e-10): dense, streamed with chunks that
divide nothing, the step's microbatch loss, on 1, 2 and 4 gloo processes; with a distillation term inside; the
evaluation's cuts (recall and BEIR) scored from the definition; a trainer step on MiniLM as ColBERT; and
sentence-transformers' MultiVectorMatryoshkaLoss on its own tokens."""

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
from tests.test_late_distill import reference_term, teacher_of
from tests.test_late_interaction import DIM, K, maxsim, problem
from tests.test_late_interaction import reference as late_reference
from tests.test_objectives import leaves
from titan_contrastive.losses import Distillation, Distilled, InfoNCE, Matryoshka
from titan_contrastive.losses.late_interaction import late_interaction

DIMS, WEIGHTS = (3, 2), (1.0, 0.5)  # not 1: one-component tokens are ±1, and their MaxSims tie


def cut(x: torch.Tensor, m: int, dim: int = DIM) -> torch.Tensor:
    """Each `dim`-wide token of the rows cut to its first m components and normalized; a zero token is left out: zero,
    and constant (no gradient)."""
    tokens = x.view(len(x), -1, dim)[..., :m]
    norms = tokens.detach().norm(dim=-1, keepdim=True)
    out = [
        t / t.norm() if n > 0 else torch.zeros_like(t.detach()) for t, n in zip(tokens.flatten(0, 1), norms.flatten())
    ]
    return torch.stack(out).view(len(x), -1)


CASES = [  # symmetric, normalized, hard negatives, a distillation term (kind, weight, contrastive weight)
    dict(symmetric=False, normalize=False, k=K, distill=None),
    dict(symmetric=True, normalize=True, k=0, distill=None),
    dict(symmetric=False, normalize=False, k=K, distill=("kl", 0.5, 1.0)),
    dict(symmetric=False, normalize=True, k=K, distill=("margin_mse", 1.0, 0.0)),
]
NAMES = [
    f"{'sym' if c['symmetric'] else 'oneway'}-k{c['k']}-{c['distill'] or 'plain'}-n{c['normalize']:d}" for c in CASES
]


def objective_of(case: dict):
    inner = InfoNCE(case["symmetric"])
    if case["distill"]:
        kind, w, cw = case["distill"]
        inner = Distilled(inner, Distillation(kind, w, minmax=kind == "kl"), cw)
    return late_interaction(Matryoshka(inner, DIMS, WEIGHTS), DIM, case["normalize"])


def reference(case: dict, q, p, n, scale, teacher):
    total = 0.0
    for m, w in zip(DIMS, WEIGHTS):
        qm, pm, nm = (None if x is None else cut(x, m) for x in (q, p, n))
        term = 0.0
        if not case["distill"] or case["distill"][2]:
            term = late_reference(qm, pm, nm, scale, case["symmetric"], m, case["normalize"])
            term = term * (case["distill"][2] if case["distill"] else 1.0)
        if case["distill"]:
            kind, weight, _ = case["distill"]
            dcase = dict(kind=kind, tau=1.0, minmax=kind == "kl", normalize=case["normalize"])
            term = term + weight * reference_term(dcase, qm, pm, nm, scale, teacher, dim=m)
        total = total + w * term
    return total


def _want(case: dict, seed: int):
    problem_ = problem(case["k"], seed)
    teacher = teacher_of(case["k"], seed) if case["distill"] else None
    rq, rp, rn, rs = leaves(*problem_[:4])
    loss = reference(case, rq, rp, rn, rs, teacher)
    return problem_, teacher, (loss.detach(), *wanted(loss, rq, rp, rn, rs))


def test_the_cut_is_each_tokens() -> None:
    """Else a form that cut the rows' first m components (not each token's) would pass: they differ."""
    q, *_ = problem(K)
    assert (cut(q, 2) - F.normalize(q[:, : q.shape[1] * 2 // DIM], dim=1)).abs().max() > 0.1
    assert ((cut(q, 2).view(len(q), -1, 2) == 0).all(-1) == (q.view(len(q), -1, DIM) == 0).all(-1)).all()


@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_every_form_matches_the_definition(case: dict) -> None:
    problem_, teacher, want = _want(case, 0)
    assert_forms(objective_of(case), problem_, want, teacher)


def _distributed() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for case, name in zip(CASES, NAMES):
        problem_, teacher, want = _want(case, 1)
        assert_distributed_forms(objective_of(case), problem_, want, name, teacher)


@pytest.mark.parametrize("world", TWO_AND_FOUR)
def test_distributed_forms_match_the_definition(world: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_distributed(_distributed, world)


def test_a_prefix_wider_than_the_tokens_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"^loss.matryoshka_dims=\[4, 2\]: the tokens have 3 dimensions; use dims <= 3"
    ):
        late_interaction(Matryoshka(InfoNCE(False), (4, 2), (1.0, 1.0)), DIM)


def test_the_evaluations_cuts_score_each_tokens_prefix() -> None:
    """Held-out recall and BEIR at a cut: ranked by MaxSim of each token's first m components, renormalized."""
    from titan_contrastive.components.beir_eval import evaluate_beir
    from titan_contrastive.components.evaluate import recall_at_k
    from titan_contrastive.components.retrieval_metrics import ir_metrics
    from titan_contrastive.datasets.beir_folder import BeirSet

    q, p, *_ = problem(0, seed=5)
    sims = torch.tensor([[float(maxsim(qi, d, 2)) for d in cut(p, 2)] for qi in cut(q, 2)], dtype=torch.float64)
    objective = objective_of(CASES[0])
    from titan_contrastive.losses.matryoshka import at_width, prefix

    got = at_width(objective, 2).similarity(prefix(q, 2, DIM), prefix(p, 2, DIM))
    assert (got - sims).abs().max() < 1e-10 and recall_at_k(got) == recall_at_k(sims.double())
    ids = [str(i) for i in range(len(q))]
    beir = BeirSet(ids, [f"q{i}" for i in ids], ids, [f"d{i}" for i in ids], {i: {i: 1} for i in ids})
    rows = {f"q{i}": q[int(i)] for i in ids} | {f"d{i}": p[int(i)] for i in ids}
    embed = lambda texts: torch.stack([rows[t] for t in texts])  # noqa: E731
    results = evaluate_beir(beir, embed, embed, batch_size=5, dims=(2,), token_dim=DIM)
    scores, indices = sims.topk(len(ids))
    want = ir_metrics(scores, indices, beir.query_ids, beir.corpus_ids, beir.qrels)
    assert {k: results[f"dim2/beir/{k}"] for k in want} == pytest.approx(want, abs=1e-12)
    assert results["dim2/beir/ndcg@10"] != results["beir/ndcg@10"]


# ------------------------------------------------------------------ a trainer step, and sentence-transformers


@needs("hf")
def test_global_negatives_with_token_prefixes_equal_the_definition(tmp_path: Path) -> None:
    """MiniLM as ColBERT (8-wide tokens) at prefixes 8 and 4, global negatives GA 3 x 2: every parameter's gradient."""
    from tests.test_colbert import COLBERT, KINDS
    from tests.test_hard_negatives import pairs_file, step_against
    from tests.test_trainer import full, grads
    from titan_contrastive.batching import with_negatives
    from titan_contrastive.losses import split_documents

    def dense(trainer, every: dict):
        model = trainer.spec.build_model(trainer.model_args).double()
        model.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
        model.train(trainer.model.training)
        q, d, scale = model(every["query"], with_negatives(every["doc"], every["neg"], model.pad_id))
        p, n = split_documents(d.reshape(len(q), 3, -1))
        loss = late_reference(q, p, n, scale, False, 8) + 0.5 * late_reference(
            *(cut(x, 4, 8) for x in (q, p, n)), scale, False, 4
        )
        loss.backward()
        return loss.item(), grads(model)

    pairs_file(tmp_path)
    options = ["--loss.matryoshka_dims=8,4", "--loss.matryoshka_weights=1,0.5"]
    trainer = step_against(tmp_path, KINDS["global"], *COLBERT, *options, reference=dense)
    assert "Matryoshka over each token's dims 8 x 1, 4 x 0.5" in trainer.gradient_step.describe()


@needs("hf")
def test_multi_vector_matryoshka_loss_is_ours(tmp_path: Path) -> None:
    """Its MultiVectorMatryoshkaLoss around MNRL (dims 8, 4, weights 1, 0.5) on its own tokens: ours, to float32."""
    from sentence_transformers.multi_vector_encoder import losses

    from tests.test_multi_vector import ST_REL, _model, _ours, _theirs
    from tests.test_objectives_vs_sentence_transformers import _assert_same

    model = _model(tmp_path)
    mnrl = losses.MultiVectorMultipleNegativesRankingLoss(model)
    want = _theirs(model, losses.MultiVectorMatryoshkaLoss(model, mnrl, [8, 4], [1.0, 0.5]), 2)
    ours = late_interaction(Matryoshka(InfoNCE(False), (8, 4), (1.0, 0.5)), 8)
    _assert_same(_ours(model, ours, 2), want, ST_REL)


def test_evaluation_cuts_wider_than_the_tokens_are_refused_at_start() -> None:
    """`eval.dims` against a ColBERT run's token width (no forward needed), in one line."""
    from titan_contrastive.components.evaluate import check_embedding_dims
    from titan_contrastive.config import ConfigError

    objective = late_interaction(InfoNCE(False), 8)
    check_embedding_dims(None, None, None, {"eval.dims": [8, 4]}, objective)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^eval.dims=\[16\]: the tokens have 8 dimensions; use dims <= 8$"):
        check_embedding_dims(None, None, None, {"eval.dims": [16]}, objective)  # type: ignore[arg-type]
