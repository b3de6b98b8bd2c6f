"""Adaptive layers (`loss.adaptive_layers`, `losses/layers.py`): the objective at the last layer and at earlier
layers, plus each earlier layer's KL from the last's, against the definition written here one text at a time
(float64, <= 1e-10): the dense, streamed (chunks that divide nothing) and microbatch forms, on 1, 2 and 4 gloo
processes, over InfoNCE with hard negatives and masks, Matryoshka inside it, the sigmoid loss, and layers drawn per
step; and sentence-transformers' AdaptiveLayerLoss over every layer of MiniLM. A bi_encoder trained with it:
`tests/test_adaptive_layers_trainer.py`."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import TWO_AND_FOUR, run_distributed
from tests.needs import needs
from tests.test_objectives import CASES, N, _close, leaves, objective_of, problem, reference
from titan_contrastive.losses import MicrobatchLoss, Ranks
from titan_contrastive.losses.layers import AdaptiveLayers

BASE = {c["name"]: c for c in CASES}
LAYERS = [  # the inner objective's case, the earlier exits' weights, the KL's weight and temperature, exits per step
    ("clip-oneway-k2-all-full", (0.5, 0.25), 1.0, 0.3, 0),
    ("clip-sym-k0-none-mat", (1.0,), 2.0, 0.7, 0),
    ("siglip-sym-k2-margin-full", (0.3, 0.6), 0.5, 0.3, 0),
    ("clip-oneway-k0-relative-full", (0.5,), 1.0, 0.0, 0),
    ("clip-oneway-k2-all-full", (0.5, 0.25, 0.4), 1.0, 0.3, 2),
    ("siglip-sym-k2-margin-full", (0.3, 0.6), 0.5, 0.3, 1),
]
LAYERS = [
    (BASE[name], dict(w=w, a=a, t=t, n=n, name=f"{name}-{len(w)}exits-a{a}-t{t}-drawn{n}"))
    for name, w, a, t, n in LAYERS
]
STEP = 5  # the optimizer step the drawn cases are at


def wide(case: dict, count: int, seed: int = 0):
    """`count` problems side by side: each text's exits [last | earlier ...], each a unit vector, with the ids,
    scale and bias of the first."""
    blocks = [problem(case, seed + 10 * i) for i in range(count)]
    q, p, n = (None if b[0] is None else torch.cat(list(b), 1) for b in zip(*(x[:3] for x in blocks)))
    return (q, p, n, *blocks[0][3:])


def definition(case: dict, lcase: dict, q, p, n, scale, bias, ids, drawn=None) -> torch.Tensor:
    """L(last) + sum_k w_k L(exit k) + a T sum_k 1/R sum over the R texts of sum_j p_j (log p_j - log q_j), p the
    last exit's softmax at T (held), q exit k's; `drawn` (0-based earlier exits): the sums over them alone, each w_k
    times K / len(drawn)."""
    d = q.shape[1] // (1 + len(lcase["w"]))
    exits = range(len(lcase["w"])) if drawn is None else drawn
    share = len(lcase["w"]) / len(exits)

    def block(x, i):
        return None if x is None else x[:, i * d : (i + 1) * d]

    total = reference(case, block(q, 0), block(p, 0), block(n, 0), scale, bias, ids)
    for e in exits:
        w, i = lcase["w"][e] * share, e + 1
        total = total + w * reference(case, block(q, i), block(p, i), block(n, i), scale, bias, ids)
    t = lcase["t"]
    if not (lcase["a"] and t):
        return total
    texts = [x for x in (q, p, n) if x is not None]
    texts = [row for x in texts for row in x]
    kl = 0.0
    for row in texts:
        last = row[:d].detach() / t
        target = [math.exp(v) for v in (last - last.logsumexp(0)).tolist()]
        for i in (e + 1 for e in exits):
            log_q = row[i * d : (i + 1) * d] / t
            log_q = log_q - log_q.logsumexp(0)
            kl = kl + sum(pj * (math.log(pj) - log_q[j]) for j, pj in enumerate(target))
    return total + lcase["a"] * t * kl / len(texts)


def layers_of(case: dict, lcase: dict, width: int) -> AdaptiveLayers:
    """The objective of the case, at step `STEP` where it draws exits."""
    objective = AdaptiveLayers(objective_of(case), width, lcase["w"], lcase["a"], lcase["t"], lcase["n"], seed=3)
    return objective.at_step(STEP) if lcase["n"] else objective


@pytest.mark.parametrize("pair", LAYERS, ids=[c["name"] for _, c in LAYERS])
def test_every_form_matches_the_definition(pair) -> None:
    case, lcase = pair
    q, p, n, scale, bias, ids = wide(case, 1 + len(lcase["w"]))
    objective = layers_of(case, lcase, q.shape[1] // (1 + len(lcase["w"])))
    assert (objective.drawn is None) == (not lcase["n"]) and len(objective.drawn or lcase["w"]) == (
        lcase["n"] or len(lcase["w"])
    )
    rq, rp, rn, rs, rb = leaves(q, p, n, scale, bias)
    want_loss = definition(case, lcase, rq, rp, rn, rs, rb, ids, objective.drawn)
    wanted = [x for x in (rq, rp, rn, rs) if x is not None]
    want_q, want_p, *want_n, want_s = torch.autograd.grad(want_loss, wanted)
    cols, want_cols = (p, want_p) if n is None else (torch.cat([p, n]), torch.cat([want_p, *want_n]))
    b = bias if objective.has_bias else None

    dq, dcols, ds = leaves(q, cols, scale)
    loss = objective.dense(dq, dcols, ds, b, ids)
    loss.backward()
    for got, want, what in ((loss, want_loss, "loss"), (dq.grad, want_q, "dq"), (dcols.grad, want_cols, "dD")):
        _close(got.detach(), want.detach(), f"dense {what}")
    _close(ds.grad, want_s, "dense ds")
    for chunk in (5, 7, N):
        out = objective.streamed(q, cols, scale, b, first_row=0, num_queries=N, chunk=chunk, ranks=Ranks(None), ids=ids)
        _close(out.loss, want_loss.detach(), f"streamed loss, chunk {chunk}")
        _close(out.grad_rows, want_q, f"streamed dq, chunk {chunk}")
        _close(out.grad_cols, want_cols, f"streamed dD, chunk {chunk}")
        _close(out.scale_rows.sum(), want_s, f"streamed ds, chunk {chunk}")

    mq, ms, mb = leaves(q, scale, bias)
    k = case["k"]
    mdocs = (p if n is None else torch.cat([p[:, None], n.view(N, k, -1)], 1)).clone().requires_grad_()
    local_ids = ids if n is None else torch.cat([ids[:N, None], ids[N:].view(N, k)], 1)
    loss = MicrobatchLoss(objective)(mq, mdocs, ms, mb if objective.has_bias else None, ids=local_ids)
    loss.backward()
    _close(loss.detach(), want_loss.detach(), "microbatch loss")
    _close(mq.grad, want_q, "microbatch dq")
    _close(mdocs.grad if n is None else mdocs.grad[:, 0], want_p, "microbatch dp")
    assert "KL" in objective.describe() or not lcase["t"]


def test_the_draws_are_the_seeds_and_the_steps() -> None:
    """The exits drawn at a step depend on the seed and the step alone (every rank, every pass draws the same), vary
    from step to step, and each exit is drawn about equally often."""
    case, lcase = LAYERS[4]
    made = AdaptiveLayers(objective_of(case), 8, lcase["w"], per_step=1, seed=3)
    draws = [made.at_step(step).drawn for step in range(300)]
    assert draws == [made.at_step(step).drawn for step in range(300)]
    assert draws != [dataclasses.replace(made, seed=4).at_step(step).drawn for step in range(300)]
    counts = [draws.count((k,)) for k in range(3)]
    assert sum(counts) == 300 and min(counts) > 70, counts
    assert made.at_step(0).inner == made.inner and dataclasses.replace(made, per_step=0).at_step(7).drawn is None


def test_the_kl_term_counts() -> None:
    """The cases' KL terms are not zero: the definition without them differs."""
    case, lcase = LAYERS[0]
    q, p, n, scale, bias, ids = wide(case, 3)
    with_kl = definition(case, lcase, q, p, n, scale, bias, ids)
    assert abs(with_kl - definition(case, dict(lcase, a=0.0), q, p, n, scale, bias, ids)) > 1e-3


def _distributed(names: list[str]) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    ranks = Ranks(dist.group.WORLD)
    for case, lcase in (pair for pair in LAYERS if pair[1]["name"] in names):
        q, p, n, scale, bias, ids = wide(case, 1 + len(lcase["w"]), seed=1)
        objective = layers_of(case, lcase, q.shape[1] // (1 + len(lcase["w"])))
        rq, rp, rn, rs, rb = leaves(q, p, n, scale, bias)
        want_loss = definition(case, lcase, rq, rp, rn, rs, rb, ids, objective.drawn)
        want_q, want_p, *want_n = torch.autograd.grad(want_loss, [x for x in (rq, rp, rn) if x is not None])
        c, k = N // world, case["k"]
        own, own_neg = slice(rank * c, (rank + 1) * c), slice(rank * c * k, (rank + 1) * c * k)
        b = bias if objective.has_bias else None
        cols = p if n is None else torch.cat([p, n])
        out = objective.streamed(
            q[own], cols, scale, b, first_row=own.start, num_queries=N, chunk=2, ranks=ranks, ids=ids
        )
        _close(out.loss, want_loss.detach(), f"{lcase['name']} streamed loss")
        _close(out.grad_rows, want_q[own], f"{lcase['name']} streamed dq")
        shares = out.grad_cols.clone()
        dist.all_reduce(shares)
        _close(shares, want_p if n is None else torch.cat([want_p, *want_n]), f"{lcase['name']} streamed dD")

        lq, ls, lb = leaves(q[own], scale, bias)
        ldocs = (p[own] if n is None else torch.cat([p[own, None], n[own_neg].view(c, k, -1)], 1)).clone()
        ldocs.requires_grad_()
        local_ids = ids[own] if n is None else torch.cat([ids[:N][own, None], ids[N:][own_neg].view(c, k)], 1)
        loss = MicrobatchLoss(objective, dist.group.WORLD)(
            lq, ldocs, ls, lb if objective.has_bias else None, ids=local_ids
        )
        loss.backward()
        _close(loss.detach(), want_loss.detach(), f"{lcase['name']} microbatch loss")
        _close(lq.grad / world, want_q[own], f"{lcase['name']} microbatch dq")


@pytest.mark.parametrize("world", TWO_AND_FOUR)
def test_the_distributed_forms_match_the_definition(world: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_distributed(_distributed, world, [LAYERS[i][1]["name"] for i in (0, 2, 4)])


def _mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)


@needs("hf")
def test_it_is_adaptive_layer_loss_over_every_layer() -> None:
    """sentence-transformers' AdaptiveLayerLoss around MultipleNegativesRankingLoss with every layer at every step
    (`n_layers_per_step=-1`, uniform weights, its KL at T 0.3) on all-MiniLM-L6-v2 with two hard negatives, float64:
    our objective at layers 0 to 5 (each 1/6) on the same model's exits, the same loss and every parameter's
    gradient."""
    from tests.test_objectives_vs_sentence_transformers import (
        SCALE,
        _assert_same,
        _features,
        _grads,
        _model,
        _st_losses,
    )
    from titan_contrastive.losses import InfoNCE

    model = _model()
    st = _st_losses().AdaptiveLayerLoss(model, _st_losses().MultipleNegativesRankingLoss(model, scale=SCALE), -1)
    value = st(_features(model), None)
    value.backward()
    want = (value.item(), _grads(model))

    def exits(features: dict) -> torch.Tensor:
        out = model[0].auto_model(**{k: v for k, v in features.items() if k != "modality"}, output_hidden_states=True)
        mask = features["attention_mask"]
        layers = [out.hidden_states[-1], *out.hidden_states[:-1]]
        return torch.cat([F.normalize(_mean(h, mask), dim=-1) for h in layers], -1)

    q, p, *negs = (exits(dict(f)) for f in _features(model))
    cols = torch.cat([p, torch.stack(negs, 1).flatten(0, 1)])
    objective = AdaptiveLayers(InfoNCE(symmetric=False), 384, (1 / 6,) * 6, 1.0, 0.3)
    loss = objective.dense(q, cols, torch.tensor(SCALE, dtype=torch.float64))
    loss.backward()
    _assert_same((loss.item(), _grads(model)), want)
