"""Every objective's dense, microbatch and streamed forms against a reference written here from the
definitions (docs/losses.md), one query at a time, in float64: the loss and the gradients of the
queries, positives, hard negatives, temperature and bias, for every option and combination
(hard negatives x masking x Matryoshka x symmetric x joint directions), on 1, 2 and 4 gloo
processes, with stream chunks that divide nothing."""

from __future__ import annotations

import functools
import itertools
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import TWO_AND_FOUR, run_distributed
from titan_contrastive.losses import FalseNegatives, Hardness, InfoNCE, Matryoshka, Ranks, Sigmoid

TOL = 1e-10
N, K, D = 12, 2, 8  # queries, hard negatives per query, embedding dim


# ------------------------------------------------------------------ the reference, from the definitions


def _masked(i: int, j: int, q, cols, ids, masking: FalseNegatives) -> bool:
    """Whether column j is removed from query i's problem (never the positive j = i)."""
    if j == i:
        return False
    nq = len(q)
    k = (len(cols) - nq) // nq
    if masking.own_only is not None and bool(masking.own_only[i]) and not nq + i * k <= j < nq + (i + 1) * k:
        return True  # a query without in-batch negatives: another query's document
    cos_pos, cos = float((q[i] @ cols[i]).detach()), float((q[i] @ cols[j]).detach())
    return bool(
        (masking.duplicates and int(ids[j]) == int(ids[i]))
        or (masking.margin is not None and cos > cos_pos + masking.margin)
        or (masking.relative is not None and cos > masking.relative * cos_pos)
    )


def _logit(i: int, j: int, cos, scale, nq: int, k: int, hardness: Hardness):
    """Query i's logit for column j: t cos, plus alpha sg(cos) on the negatives the mode weighs."""
    own = j == i or nq + i * k <= j < nq + (i + 1) * k
    weighed = {"in_batch_negatives": not own, "hard_negatives": own and j != i, "all_negatives": j != i}
    return scale * cos + (hardness.strength * cos.detach() if weighed[hardness.mode] else 0.0)


def _cosines(q, p, n, guide):
    """What the masks compare: the model's embeddings (queries, positives, columns), or a guide's."""
    gq, gp, gn = guide or (q, p, n)
    return gq, gp, torch.cat([gp, gn]) if gn is not None else gp


def reference_infonce(q, p, n, scale, ids, symmetric: bool, masking: FalseNegatives, hardness: Hardness, guide=None):
    cols = torch.cat([p, n]) if n is not None else p
    gq, _, gcols = _cosines(q, p, n, guide)
    nq = len(q)
    k = (len(cols) - nq) // nq
    forward = 0.0
    for i in range(nq):
        kept = [j for j in range(len(cols)) if not _masked(i, j, gq, gcols, ids, masking)]
        logits = torch.stack([_logit(i, j, q[i] @ cols[j], scale, nq, k, hardness) for j in kept])
        forward = forward - torch.log_softmax(logits, 0)[kept.index(i)]
    if not symmetric:
        return forward / nq
    backward = 0.0
    for j in range(nq):  # each positive document against the queries that keep it
        kept = [i for i in range(nq) if not _masked(i, j, gq, gcols, ids, masking)]
        logits = torch.stack([scale * (q[i] @ cols[j]) for i in kept])
        backward = backward - torch.log_softmax(logits, 0)[kept.index(j)]
    return (forward / nq + backward / nq) / 2


def _kept(i: int, a, b, key_id, q, p, ids, masking: FalseNegatives) -> bool:
    """Whether the candidate <a, b> (its id key_id) stays in query i's denominator under i's rule."""
    cos_pos, cos = float((q[i] @ p[i]).detach()), float((a @ b).detach())
    return not (
        (masking.duplicates and int(key_id) == int(ids[i]))
        or (masking.margin is not None and cos > cos_pos + masking.margin)
        or (masking.relative is not None and cos > masking.relative * cos_pos)
    )


def reference_joint(
    q, p, n, scale, ids, directions: tuple[str, ...], masking: FalseNegatives, hardness: Hardness, guide=None
):
    """One-way InfoNCE whose denominator also holds the other queries (query_to_query), every query
    against the positive (doc_to_query) and the positive against the other queries' documents
    (doc_to_doc); every candidate masked by query i's rule (query j's id is its positive's)."""
    cols = torch.cat([p, n]) if n is not None else p
    nq = len(q)
    k = (len(cols) - nq) // nq
    gq, gp, gcols = _cosines(q, p, n, guide)
    total = 0.0
    for i in range(nq):
        kept = functools.partial(_kept, i, q=gq, p=gp, ids=ids, masking=masking)
        candidates = [scale * (q[i] @ p[i])]  # the positive first
        candidates += [
            _logit(i, j, q[i] @ cols[j], scale, nq, k, hardness)  # hardness: query -> document only
            for j in range(len(cols))
            if j != i and kept(gq[i], gcols[j], ids[j])
        ]
        if "query_to_query" in directions:
            candidates += [scale * (q[i] @ q[j]) for j in range(nq) if j != i and kept(gq[i], gq[j], ids[j])]
        if "doc_to_query" in directions:
            candidates += [scale * (p[i] @ q[j]) for j in range(nq) if j == i or kept(gp[i], gq[j], ids[j])]
        if "doc_to_doc" in directions:
            own = {i, *(nq + i * k + t for t in range(k))}
            candidates += [
                scale * (p[i] @ cols[j]) for j in range(len(cols)) if j not in own and kept(gp[i], gcols[j], ids[j])
            ]
        total = total - torch.log_softmax(torch.stack(candidates), 0)[0]
    return total / nq


def reference_sigmoid(q, p, n, scale, bias, ids, masking: FalseNegatives, guide=None):
    cols = torch.cat([p, n]) if n is not None else p
    gq, _, gcols = _cosines(q, p, n, guide)
    total = 0.0
    for i in range(len(q)):
        for j in range(len(cols)):
            if not _masked(i, j, gq, gcols, ids, masking):
                z = 1.0 if j == i else -1.0
                total = total - F.logsigmoid(z * (scale * (q[i] @ cols[j]) + bias))
    return total / len(q)


def reference(case: dict, q, p, n, scale, bias, ids, guide=None):
    """`guide`: a guide's (queries, positives, negatives), whose cosines the masks compare at every prefix."""

    def prefix(z, m):  # Matryoshka: the first m dims, renormalized; without it the embeddings as given
        return None if z is None else (F.normalize(z[:, :m], dim=1) if case["matryoshka"] else z)

    total = 0.0
    for m, w in case["matryoshka"] or [(q.shape[1], 1.0)]:
        qm, pm, nm = prefix(q, m), prefix(p, m), prefix(n, m)
        if case["objective"] == "siglip":
            total = total + w * reference_sigmoid(qm, pm, nm, scale, bias, ids, case["masking"], guide)
        elif case["directions"]:
            total = total + w * reference_joint(
                qm, pm, nm, scale, ids, case["directions"], case["masking"], case["hardness"], guide
            )
        else:
            total = total + w * reference_infonce(
                qm, pm, nm, scale, ids, case["symmetric"], case["masking"], case["hardness"], guide
            )
    return total


# ------------------------------------------------------------------ the cases


def objective_of(case: dict):
    if case["objective"] == "siglip":
        objective = Sigmoid(false_negatives=case["masking"])
    else:
        objective = InfoNCE(case["symmetric"], case["masking"], case["directions"], case["hardness"])
    if case["matryoshka"]:
        dims, weights = zip(*case["matryoshka"])
        objective = Matryoshka(objective, dims, weights)
    return objective


MASKINGS = {
    "none": FalseNegatives(),
    "duplicates": FalseNegatives(duplicates=True),
    "margin": FalseNegatives(margin=0.05),
    "relative": FalseNegatives(relative=0.9),
    "all": FalseNegatives(duplicates=True, margin=0.1, relative=0.95),
}
MATRYOSHKA = [(8, 1.0), (5, 0.5), (2, 0.25)]


def _case(name: str, k: int, mask: str, mat, objective="clip", symmetric=False, directions=(), hardness=None):
    return dict(
        objective=objective,
        symmetric=symmetric,
        k=k,
        masking=MASKINGS[mask],
        matryoshka=mat,
        directions=directions,
        hardness=hardness or Hardness(),
        name=f"{name}-k{k}-{mask}-{'mat' if mat else 'full'}",
    )


CASES = [
    _case(f"{obj}-{'sym' if sym else 'oneway'}", k, mask, mat, obj, sym)
    for obj, sym, k, mask, mat in itertools.product(
        ["clip", "siglip"], [True, False], [0, K], list(MASKINGS), [None, MATRYOSHKA]
    )
    if not (obj == "siglip" and not sym)
]
DIRECTION_SETS = {  # GTE's improved contrastive loss; Qwen3-Embedding's and GISTEmbed's; each alone
    "gte": ("query_to_query", "doc_to_query", "doc_to_doc"),
    "qwen3": ("query_to_query", "doc_to_doc"),
    "q2q": ("query_to_query",),
    "d2q": ("doc_to_query",),
    "d2d": ("doc_to_doc",),
}
CASES += [
    _case(f"clip-{key}", k, mask, mat, directions=dirs)
    for key, dirs in DIRECTION_SETS.items()
    for k, mask, mat in itertools.product([0, K], list(MASKINGS), [None, MATRYOSHKA])
    if len(dirs) > 1 or (mask in ("none", "all") and not mat)
]
HARDNESS = {  # sentence-transformers' three modes; LLaVE's alpha 9 (here 3, on t = 7)
    mode: Hardness(mode, 3.0) for mode in ("in_batch_negatives", "hard_negatives", "all_negatives")
}
CASES += [
    _case(f"clip-{dirs_key}-hard-{mode.split('_')[0]}", k, mask, mat, directions=dirs, hardness=h)
    for mode, h in HARDNESS.items()
    for dirs_key, dirs in {"oneway": (), "gte": DIRECTION_SETS["gte"]}.items()
    for k, mask, mat in itertools.product([0, K], ["none", "all"], [None, MATRYOSHKA])
    if not (dirs and mat)
]


def problem(case: dict, seed: int = 0):
    """Unit embeddings, some columns duplicated (same id, near-identical text) and some negatives
    closer to the query than its positive, so every mask removes something."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(N, D, generator=gen, dtype=torch.float64), dim=1)
    p = F.normalize(q + 0.9 * torch.randn(N, D, generator=gen, dtype=torch.float64), dim=1)
    p[3] = F.normalize(p[7] + 1e-3 * torch.randn(D, generator=gen, dtype=torch.float64), dim=0)  # a duplicate
    n = None
    ids = torch.arange(N)
    ids[3] = ids[7]
    if case["k"]:
        n = F.normalize(
            q.repeat_interleave(case["k"], 0) + 1.1 * torch.randn(N * case["k"], D, generator=gen, dtype=torch.float64),
            dim=1,
        )
        neg_ids = torch.arange(N, N + N * case["k"])
        neg_ids[5] = ids[2]  # query 2's positive, mined as a negative of query 2
        n[5] = F.normalize(p[2] + 1e-3 * torch.randn(D, generator=gen, dtype=torch.float64), dim=0)
        ids = torch.cat([ids, neg_ids])
    scale = torch.tensor(7.0, dtype=torch.float64)
    bias = torch.tensor(-2.0, dtype=torch.float64)
    return q, p, n, scale, bias, ids


def leaves(*tensors):
    return [None if t is None else t.clone().requires_grad_() for t in tensors]


def reference_grads(case: dict, q, p, n, scale, bias, ids, guide=None):
    rq, rp, rn, rs, rb = leaves(q, p, n, scale, bias)
    loss = reference(case, rq, rp, rn, rs, rb, ids, guide)
    named = {"q": rq, "p": rp, "n": rn, "s": rs, "b": rb}
    named = {key: t for key, t in named.items() if t is not None}
    grads = torch.autograd.grad(loss, list(named.values()), allow_unused=True)
    return loss.detach(), dict(zip(named, grads))


def _close(a, b, what: str) -> None:
    b = torch.zeros_like(a) if b is None else b
    err = (a - b).abs().max().item()
    assert err <= TOL, f"{what}: max error {err:.3e}"


def test_the_cases_mask_something() -> None:
    """The problem is built so each mask removes at least one column (else masking tests nothing)."""
    for mask in ["duplicates", "margin", "relative"]:
        case = dict(k=K)
        q, p, n, *_, ids = problem(case)
        cols = torch.cat([p, n])
        removed = sum(_masked(i, j, q, cols, ids, MASKINGS[mask]) for i in range(N) for j in range(len(cols)))
        assert removed > 0, mask


def test_the_cases_mask_something_in_every_joint_direction() -> None:
    """Each mask also removes candidates of query_to_query, doc_to_query and doc_to_doc."""
    q, p, n, *_, ids = problem(dict(k=K))
    cols = torch.cat([p, n])
    for mask in ["duplicates", "margin", "relative"]:
        kept = [functools.partial(_kept, i, q=q, p=p, ids=ids, masking=MASKINGS[mask]) for i in range(N)]
        removed = {
            "query_to_query": sum(not kept[i](q[i], q[j], ids[j]) for i in range(N) for j in range(N) if j != i),
            "doc_to_query": sum(not kept[i](p[i], q[j], ids[j]) for i in range(N) for j in range(N) if j != i),
            "doc_to_doc": sum(
                not kept[i](p[i], cols[j], ids[j])
                for i in range(N)
                for j in range(len(cols))
                if j != i and not N + i * K <= j < N + (i + 1) * K  # not query i's own documents
            ),
        }
        assert all(removed.values()), (mask, removed)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_dense_and_streamed_match_the_definition(case: dict) -> None:
    q, p, n, scale, bias, ids = problem(case)
    want_loss, want = reference_grads(case, q, p, n, scale, bias, ids)
    objective = objective_of(case)
    cols = torch.cat([p, n]) if n is not None else p

    # dense form (autograd)
    dq, dcols, ds, db = leaves(q, cols, scale, bias)
    loss = objective.dense(dq, dcols, ds, db if objective.has_bias else None, ids)
    loss.backward()
    _close(loss.detach(), want_loss, "dense loss")
    _close(dq.grad, want["q"], "dense dq")
    _close(dcols.grad, torch.cat([want["p"], want["n"]]) if n is not None else want["p"], "dense dD")
    _close(ds.grad, want["s"], "dense ds")

    # streamed form, one process, chunks that divide nothing
    for chunk in (5, 7, N):
        out = objective.streamed(
            q,
            cols,
            scale,
            bias if objective.has_bias else None,
            first_row=0,
            num_queries=N,
            chunk=chunk,
            ranks=Ranks(None),
            ids=ids,
        )
        _close(out.loss, want_loss, f"streamed loss, chunk {chunk}")
        _close(out.grad_rows, want["q"], f"streamed dq, chunk {chunk}")
        _close(out.grad_cols, torch.cat([want["p"], want["n"]]) if n is not None else want["p"], "streamed dD")
        _close(out.scale_rows.sum(), want["s"], f"streamed ds, chunk {chunk}")
        if objective.has_bias:
            _close(out.bias_rows.sum(), want["b"], f"streamed db, chunk {chunk}")


@functools.cache
def _distributed_wants() -> dict[str, tuple]:
    """The reference's (loss, grads) of each distributed case, formed once here, not again on every rank."""
    cases = {c["name"]: c for c in CASES}
    return {name: reference_grads(cases[name], *problem(cases[name], seed=1)) for name in DIST_CASES}


def _distributed(wants: dict[str, tuple]) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    cases = {c["name"]: c for c in CASES}
    for name, (want_loss, want) in wants.items():
        case = cases[name]
        q, p, n, scale, bias, ids = problem(case, seed=1)
        objective = objective_of(case)
        ranks = Ranks(dist.group.WORLD)
        c = N // world
        own = slice(rank * c, (rank + 1) * c)
        k = case["k"]
        own_neg = slice(rank * c * k, (rank + 1) * c * k)
        cols = torch.cat([p, n]) if n is not None else p
        b = bias if objective.has_bias else None

        # streamed: own rows against all columns; the column shares summed over ranks
        out = objective.streamed(
            q[own], cols, scale, b, first_row=own.start, num_queries=N, chunk=3, ranks=ranks, ids=ids
        )
        _close(out.loss, want_loss, f"{name} streamed loss")
        _close(out.grad_rows, want["q"][own], f"{name} streamed dq")
        shares = out.grad_cols.clone()
        dist.all_reduce(shares)
        _close(shares, torch.cat([want["p"], want["n"]]) if n is not None else want["p"], f"{name} streamed dD")
        s_total = out.scale_rows.sum().clone()
        dist.all_reduce(s_total)
        _close(s_total, want["s"], f"{name} streamed ds")

        # microbatch: local embeddings gathered with gradient; a data-parallel average divides by P
        lq, lp, ls, lb = leaves(q[own], p[own], scale, bias)
        ln = None if n is None else n[own_neg].clone().requires_grad_()
        local_ids = (ids[:N][own], None if n is None else ids[N:][own_neg])
        loss = objective.microbatch(lq, (lp, ln), ls, lb if objective.has_bias else None, local_ids, ranks)
        loss.backward()
        _close(loss.detach(), want_loss, f"{name} microbatch loss")
        _close(lq.grad / world, want["q"][own], f"{name} microbatch dq")
        _close(lp.grad / world, want["p"][own], f"{name} microbatch dp")
        if ln is not None:
            _close(ln.grad / world, want["n"][own_neg], f"{name} microbatch dn")
        s_grad = ls.grad.clone()
        dist.all_reduce(s_grad)
        _close(s_grad / world, want["s"], f"{name} microbatch ds")


def _distributed_case(case: dict) -> bool:
    """On 2 and 4 processes: the plain objectives without and with every mask; the joint sets and the
    hardness modes with every mask (a single direction, and hardness without hard negatives, on 1 only)."""
    if not case["directions"] and not case["hardness"].enabled:
        return case["masking"] in (MASKINGS["none"], MASKINGS["all"])
    single = len(case["directions"]) == 1 or (case["hardness"].enabled and not case["k"])
    return case["masking"] == MASKINGS["all"] and not single


DIST_CASES = [c["name"] for c in CASES if _distributed_case(c)]


@pytest.mark.parametrize("world", TWO_AND_FOUR)
def test_distributed_forms_match_the_definition(world: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_distributed(_distributed, world, _distributed_wants())


def test_matryoshka_larger_than_the_embeddings_is_a_clear_error() -> None:
    objective = Matryoshka(InfoNCE(), (16, 4), (1.0, 1.0))
    q = F.normalize(torch.randn(4, 8, dtype=torch.float64), dim=1)
    with pytest.raises(ValueError, match=r"loss.matryoshka_dims=\[16, 4\]: the embeddings have 8 dimensions"):
        objective.dense(q, q, torch.tensor(1.0))


def test_joint_directions_and_hardness_only_for_one_way_infonce() -> None:
    """Set for an objective that would ignore them, or with the symmetric loss: a one-line error."""
    from titan_contrastive.config import ConfigError
    from titan_contrastive.config.job_config import Loss
    from titan_contrastive.losses import build_objective

    built = build_objective(Loss(symmetric=False, joint_directions=["doc_to_doc"]))
    assert built.directions == ("doc_to_doc",) and "joint with doc_to_doc" in built.describe()
    with pytest.raises(ConfigError, match=r"loss.name='siglip' does not take them"):
        build_objective(Loss(name="siglip", symmetric=False, joint_directions=["doc_to_doc"]))
    with pytest.raises(ConfigError, match=r"set loss.symmetric=false"):
        build_objective(Loss(joint_directions=["query_to_query"]))
    for bad in (["query_to_doc"], ["doc_to_doc", "doc_to_doc"]):
        with pytest.raises(ConfigError, match=r"each at most once, from query_to_query, doc_to_query, doc_to_doc"):
            build_objective(Loss(symmetric=False, joint_directions=bad))
    assert InfoNCE(False, directions=("doc_to_doc",)).fused(8, 8) is False
    weighed = build_objective(Loss(symmetric=False, hardness_mode="hard_negatives", hardness_strength=5.0))
    assert (
        weighed.hardness == Hardness("hard_negatives", 5.0)
        and "hardness 5 x cos on hard negatives" in weighed.describe()
    )
    with pytest.raises(ConfigError, match=r"loss.hardness_strength=5.0 .* set loss.symmetric=false"):
        build_objective(Loss(hardness_strength=5.0))
    with pytest.raises(ConfigError, match=r"loss.name='siglip' does not take it"):
        build_objective(Loss(name="siglip", hardness_strength=5.0))
    assert InfoNCE(False, hardness=Hardness(strength=1.0)).fused(8, 8) is False


def test_plain_clip_is_the_clip_loss() -> None:
    """With no hard negatives, no mask and the symmetric form, InfoNCE is CLIP's loss (open_clip's formula)."""
    q = F.normalize(torch.randn(6, 4, dtype=torch.float64), dim=1)
    p = F.normalize(torch.randn(6, 4, dtype=torch.float64), dim=1)
    logits = 3.0 * q @ p.T
    labels = torch.arange(6)
    clip = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    assert math.isclose(InfoNCE().dense(q, p, torch.tensor(3.0)).item(), clip.item(), rel_tol=1e-12)
