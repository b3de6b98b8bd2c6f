"""CoSENT on the data's scores (`[loss] distill = "cosent"`, `losses/distill.py`): every (query, own document)
pair of the problem ranked by its score, alone or beside a contrastive objective, at every Matryoshka prefix.
Each form against the pairwise definition (every pair of pairs written out) plus the contrastive reference of
tests/test_objectives.py, in float64 (<= 1e-10): dense, streamed with chunks that divide nothing, the
microbatch loss; streamed and microbatch on 2 and 4 gloo processes (the logits of all ranks' rows couple).
Integer scores, so ties (which rank nothing) occur. Against sentence-transformers' CoSENTLoss on MiniLM's
embeddings; through the trainer on an STS-like scored pairs file (no negatives), GradCache chunks and global
negatives equal the dense objective in the loss and every parameter gradient."""

from __future__ import annotations

import json
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
from tests.test_hard_negatives import REL, WORDS, assert_grads_close, make_trainer
from tests.test_objectives import CASES, N, _close, leaves, objective_of, problem, reference
from tests.test_trainer import full
from titan_contrastive.batching import TEACHER_SCORES
from titan_contrastive.losses import Distillation, Distilled, Matryoshka, build_objective
from titan_contrastive.losses.distill import cosent

BASE = {c["name"]: c for c in CASES}
DCASES = [  # the contrastive objective, hard negatives, the term's weight, the objective's weight, the similarity
    ("clip-sym-k0-none-full", 0, 1.0, 0.0, "cosine"),
    ("clip-sym-k0-none-full", 0, 0.7, 0.5, "cosine"),
    ("clip-oneway-k2-margin-full", 2, 1.0, 0.3, "cosine"),
    ("clip-sym-k2-none-mat", 2, 0.5, 0.0, "cosine"),
    ("siglip-sym-k0-none-mat", 0, 1.0, 1.0, "cosine"),
    ("clip-sym-k0-none-full", 0, 1.0, 0.0, "angle"),
    ("clip-oneway-k2-margin-mat", 2, 0.5, 0.3, "angle"),  # Matryoshka's 5 dims: an odd width
]
PAIRS = [
    (dict(BASE[name], k=k), dict(w=w, cw=cw, sim=sim, name=f"{name}-w{w}-cw{cw}-{sim}"))
    for name, k, w, cw, sim in DCASES
]


def angle(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """AnglE's similarity of unit vectors x and y (a zero appended to an odd width), |cos + sin| with the sine
    term pairing dimension i with i + D/2, as sentence-transformers' `pairwise_angle_sim` writes it after its L2
    normalization (the identity on the unit vectors our towers end in)."""
    if len(x) % 2:
        x, y = F.pad(x, (0, 1)), F.pad(y, (0, 1))
    h = len(x) // 2
    return (x @ y + sum(x[i + h] * y[i] - x[i] * y[i + h] for i in range(h))).abs()


def scores_of(k: int, seed: int = 0) -> torch.Tensor:
    """Gold labels 0..5 of each query's 1 + k documents [N, 1 + k], many tied."""
    return torch.randint(0, 6, (N, 1 + k), generator=torch.Generator().manual_seed(60 + seed)).double()


def reference_term(q, p, n, scale, scores, sim: str = "cosine") -> torch.Tensor:
    """log(1 + sum of exp(S_a - S_b) over every two pairs with T_a < T_b), each pair's S = t <q_i, d> (or t x
    AnglE's `angle`)."""
    k = 0 if n is None else len(n) // len(q)
    of = angle if sim == "angle" else torch.dot
    logits = [
        scale * of(q[i], d) for i in range(len(q)) for d in [p[i], *([] if n is None else n[i * k : (i + 1) * k])]
    ]
    flat = scores.flatten().tolist()
    terms = [torch.zeros((), dtype=q.dtype)]
    terms += [logits[a] - logits[b] for a in range(len(flat)) for b in range(len(flat)) if flat[a] < flat[b]]
    return torch.logsumexp(torch.stack(terms), 0)


def reference_total(case: dict, dcase: dict, q, p, n, scale, bias, ids, scores) -> torch.Tensor:
    total = dcase["cw"] * reference(case, q, p, n, scale, bias, ids) if dcase["cw"] else 0.0
    for m, w in case["matryoshka"] or [(q.shape[1], 1.0)]:
        qm, pm, nm = (
            None if z is None else F.normalize(z[:, :m], dim=1) if case["matryoshka"] else z for z in (q, p, n)
        )
        total = total + w * dcase["w"] * reference_term(qm, pm, nm, scale, scores, dcase["sim"])
    return total


def objective_for(case: dict, dcase: dict):
    term = Distillation("cosent", dcase["w"], similarity=dcase["sim"])
    objective = Distilled(objective_of(dict(case, matryoshka=None)), term, dcase["cw"])
    if case["matryoshka"]:
        dims, weights = zip(*case["matryoshka"])
        objective = Matryoshka(objective, dims, weights)
    return objective


def test_the_term_ranks_something_and_moves_the_loss() -> None:
    """Else a form that dropped the term (or read the scores in another order) could pass."""
    case, _ = PAIRS[0]
    q, p, n, scale, _, _ = problem(case)
    term = reference_term(q, p, n, scale, scores_of(0))
    assert term > 1.0 and abs(reference_term(q, p, n, scale, scores_of(0, seed=1)) - term) > 0.1
    assert reference_term(q, p, n, scale, torch.ones(N, 1)) == 0  # all tied: nothing ranked


def test_the_sorted_form_is_the_pairwise_sum_with_ties() -> None:
    """`cosent`'s O(M log M) form against every pair written out: ties, all tied, one pair, float32 scores."""
    gen = torch.Generator().manual_seed(3)
    for m, levels in ((1, 1), (2, 2), (9, 3), (40, 5), (40, 40)):
        logits = (4 * torch.randn(m, generator=gen, dtype=torch.float64)).requires_grad_()
        scores = torch.randint(0, levels, (m,), generator=gen).float()
        want = torch.logsumexp(
            torch.stack(
                [logits.new_zeros(())]
                + [logits[a] - logits[b] for a in range(m) for b in range(m) if scores[a] < scores[b]]
            ),
            0,
        )
        got = cosent(logits, scores)
        _close(got.detach(), want.detach(), f"M={m} loss")
        if want.requires_grad:
            _close(torch.autograd.grad(got, logits)[0], torch.autograd.grad(want, logits)[0], f"M={m} grad")


@pytest.mark.parametrize("pair", PAIRS, ids=[d["name"] for _, d in PAIRS])
def test_dense_streamed_and_microbatch_match_the_definition(pair) -> None:
    case, dcase = pair
    problem_ = problem(case)
    scores = scores_of(case["k"])
    rq, rp, rn, rs, rb = leaves(*problem_[:5])
    want_loss = reference_total(case, dcase, rq, rp, rn, rs, rb, problem_[5], scores)
    want = (want_loss.detach(), *wanted(want_loss, rq, rp, rn, rs))
    assert_forms(objective_for(case, dcase), problem_, want, teacher=scores)


def _distributed() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for case, dcase in PAIRS:
        problem_ = problem(case, seed=1)
        scores = scores_of(case["k"], seed=1)
        rq, rp, rn, rs, rb = leaves(*problem_[:5])
        want_loss = reference_total(case, dcase, rq, rp, rn, rs, rb, problem_[5], scores)
        want = (want_loss.detach(), *wanted(want_loss, rq, rp, rn, rs))
        assert_distributed_forms(objective_for(case, dcase), problem_, want, dcase["name"], teacher=scores)


@pytest.mark.parametrize("world", TWO_AND_FOUR)
def test_distributed_forms_match_the_definition(world: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_distributed(_distributed, world)


@needs("hf")
@pytest.mark.parametrize("loss,sim", [("CoSENTLoss", "cosine"), ("AnglELoss", "angle")])
def test_equals_sentence_transformers_loss(loss: str, sim: str) -> None:
    """Our term at t = 20 (sentence-transformers' scale) on MiniLM's embeddings of scored pairs, normalized as
    our towers end, equals `CoSENTLoss` / `AnglELoss.compute_loss_from_embeddings`, loss and gradient of both
    sides' embeddings."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import losses

    model = SentenceTransformer(str(_minilm()), device="cpu")
    a = F.normalize(model.encode([w[0] for w in WORDS], convert_to_tensor=True).double(), dim=1)  # unit in float64
    b = F.normalize(model.encode([w[1] for w in WORDS], convert_to_tensor=True).double(), dim=1)
    labels = torch.tensor([float(i % 4) for i in range(len(WORDS))], dtype=torch.float64)
    ours_a, ours_b, theirs_a, theirs_b = leaves(a, b, a, b)
    theirs = getattr(losses, loss)(model).compute_loss_from_embeddings([theirs_a, theirs_b], labels)
    term = Distillation("cosent", similarity=sim)
    objective = Distilled(objective_of(BASE["clip-sym-k0-none-full"]), term, 0.0)
    unit = [F.normalize(z, dim=1) for z in (ours_a, ours_b)]  # as our towers end; CoSENTLoss's cosine divides
    ours = objective.with_teacher(labels[:, None]).dense(*unit, torch.tensor(20.0, dtype=torch.float64))
    theirs.backward()
    ours.backward()
    _close(ours.detach(), theirs.detach(), "loss")
    _close(ours_a.grad, theirs_a.grad, "d anchors")
    _close(ours_b.grad, theirs_b.grad, "d others")


def _minilm() -> Path:
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    return bundled_minilm()


def sts_file(tmp: Path) -> Path:
    """(sentence1, sentence2, score) rows: an STS set's shape, no negatives, labels 0..5 with ties."""
    path = tmp / "sts.jsonl"
    with open(path, "w") as f:
        for i, (query, positive, negative, _) in enumerate(WORDS):
            other = positive if i % 3 else negative
            f.write(json.dumps({"sentence1": query, "sentence2": other, "score": float((5 * i) % 6)}) + "\n")
    return path


def dense_reference(trainer, samples: dict, scores: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """The objective's dense form over all samples at once, on a float64 copy of the model in its mode."""
    model = trainer.spec.build_model(trainer.model_args).double()
    model.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    model.train(trainer.model.training)
    q, d, scale = model(samples["query"], samples["doc"])
    loss = build_objective(trainer.cfg.loss).with_teacher(scores).dense(q, d, scale)
    loss.backward()
    return loss.item(), trained_grads(model)


def trained_grads(model) -> dict[str, torch.Tensor]:
    """Every trained parameter's gradient (the fixed scale has none)."""
    return {n: full(p.grad).detach().clone() for n, p in model.named_parameters() if p.requires_grad}


KINDS = {  # local batch, accumulation steps, options
    "gradcache": (6, 1, ["--gradcache.enabled=true", "--gradcache.chunk_sizes=4"]),
    "global-matryoshka": (
        3,
        2,
        ["--loss.negatives=global", "--loss.stream_chunk_size=2", "--loss.matryoshka_dims=384,64"],
    ),
}


@needs("hf")
@pytest.mark.parametrize(  # each similarity and step kind once by default, the other pairs slow
    ("kind", "sim"),
    slow_ones(
        [(k, s) for s in ("cosine", "angle") for k in KINDS], [("gradcache", "angle"), ("global-matryoshka", "cosine")]
    ),
)
def test_cosent_alone_in_every_step_kind_equals_the_dense_objective(tmp_path: Path, kind: str, sim: str) -> None:
    """CoSENT or AnglE alone (contrastive_weight 0, the scale fixed at sentence-transformers' 20) on scored pairs:
    the step's loss and every parameter gradient equal the dense objective over the whole batch."""
    local, ga, extra = KINDS[kind]
    sts_file(tmp_path)
    trainer = make_trainer(
        tmp_path,
        f"--data.path={tmp_path / 'sts.jsonl'}",
        f"--training.local_batch_size={local}",
        f"--training.global_batch_size={local * ga}",
        "--loss.distill=cosent",
        "--loss.contrastive_weight=0",
        "--loss.learn_logit_scale=false",
        "--loss.init_logit_scale=2.995732273553991",
        f"--loss.cosent_similarity={sim}",
        *extra,
    )
    name = "AnglE (CoSENT on the angle similarity)" if sim == "angle" else "CoSENT"
    assert f"{name} over every (query, own document) pair" in trainer.gradient_step.describe()
    trainer.model.eval()
    data = trainer.train_set
    steps = [data.__getitems__(list(range(j * local, (j + 1) * local))) for j in range(ga)]
    every = {key: torch.cat([s[key] for s in steps]) for key in steps[0]}
    assert "neg" not in every and every[TEACHER_SCORES].shape == (local * ga, 1)
    assert every[TEACHER_SCORES].flatten().tolist() == [float((5 * i) % 6) for i in range(local * ga)]
    want_loss, want = dense_reference(trainer, every, every[TEACHER_SCORES].double())
    out = trainer.train_step(steps)
    assert_grads_close(trained_grads(trainer.model), want)
    assert abs(out["loss"] - want_loss) <= REL * want_loss
    trainer.metrics.close()


def test_cosent_alone_with_a_learned_scale_warns() -> None:
    from titan_contrastive.config import parse_args
    from titan_contrastive.config.manager import log_config_warnings

    alone = ["--training.steps=100", "--loss.distill=cosent", "--loss.contrastive_weight=0"]
    (line,) = log_config_warnings(parse_args(alone))
    assert line.startswith("loss.distill=cosent alone with a learned logit scale")
    assert log_config_warnings(parse_args([*alone, "--loss.learn_logit_scale=false"])) == []
    assert log_config_warnings(parse_args(["--training.steps=100", "--loss.distill=cosent"])) == []


def test_the_angle_similarity_without_cosent_is_refused() -> None:
    from titan_contrastive.config import ConfigError, parse_args

    for extra, message in [
        ([], r"^loss.cosent_similarity=angle scores CoSENT's pairs, and loss.distill is empty"),
        (["--loss.distill=kl"], r"^loss.cosent_similarity=angle: only loss.distill=cosent scores its pairs by"),
    ]:
        with pytest.raises(ConfigError, match=message):
            build_objective(parse_args(["--loss.cosent_similarity=angle", *extra]).loss)


@needs("hf")
def test_scored_pairs_without_cosent_are_refused(tmp_path: Path) -> None:
    """A one-number label is another loss's data: without loss.distill it is refused, naming cosent; kl wants
    hard negatives."""
    from titan_contrastive.datasets.base import DataError

    sts_file(tmp_path)
    path = f"--data.path={tmp_path / 'sts.jsonl'}"
    with pytest.raises(DataError, match=r"a 'score' column: scored pairs train with loss.distill=cosent \(CoSENT\)"):
        make_trainer(tmp_path, path, "--training.local_batch_size=6")
    with pytest.raises(DataError, match=r"loss.distill compares each query's positive with its hard negatives"):
        make_trainer(tmp_path, path, "--training.local_batch_size=6", "--loss.distill=kl")
