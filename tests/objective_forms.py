"""Every form of an objective held to a reference's loss and gradients (float64, tests/test_objectives.py's
tolerance): dense, streamed with chunks that divide nothing, and the step's microbatch loss, on one process or
on each rank of a gloo group. For the terms beside an objective (tests/test_cosent.py, tests/test_spread.py);
`teacher`: the data's scores [N, 1 + k] a distilled objective reads; `guide`: a guide's embeddings of the whole
problem (`losses.guide.Guide`), whose cosines decide the masks; `own_only`: the queries scored against their own
documents only."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.test_objectives import N, _close, leaves
from titan_contrastive.losses import MicrobatchLoss, Ranks
from titan_contrastive.losses.base import own_documents_only


def per_sample(p, n, ids, k: int, rows: slice = slice(None)):
    """The documents and ids of `rows` as a step hands them to its loss: [c, 1 + k, d] and [c, 1 + k]."""
    if not k:
        return p[rows], ids[: len(p)][rows]
    docs = torch.cat([p[rows, None], n.view(len(p), k, -1)[rows]], 1)
    return docs, torch.cat([ids[: len(p)][rows, None], ids[len(p) :].view(-1, k)[rows]], 1)


def wanted(loss, q, p, n, scale):
    """The reference's gradients of the queries, of the columns D = [p; n] and of the scale."""
    grads = torch.autograd.grad(loss, [t for t in (q, p, n, scale) if t is not None])
    return grads[0], torch.cat(grads[1:-1]), grads[-1]


def assert_forms(objective, problem, want, teacher=None, guide=None, own_only=None) -> None:
    """`problem`: (q, p, n, scale, bias, ids); `want`: (loss, dq, dD, ds) of the reference; `own_only`: bool [N],
    the queries scored against their own documents only."""
    q, p, n, scale, bias, ids = problem
    want_loss, want_q, want_cols, want_s = want
    k = 0 if n is None else len(n) // len(q)
    bound = objective if teacher is None else objective.with_teacher(teacher)
    bound = own_documents_only(bound if guide is None else bound.with_guide(guide), own_only)
    cols, b = (p if n is None else torch.cat([p, n])), (bias if objective.has_bias else None)

    dq, dcols, ds = leaves(q, cols, scale)
    loss = bound.dense(dq, dcols, ds, b, ids)
    loss.backward()
    _close(loss.detach(), want_loss, "dense loss")
    _close(dq.grad, want_q, "dense dq")
    _close(dcols.grad, want_cols, "dense dD")
    _close(ds.grad, want_s, "dense ds")

    for chunk in (5, 7, N):
        out = bound.streamed(q, cols, scale, b, first_row=0, num_queries=N, chunk=chunk, ranks=Ranks(None), ids=ids)
        _close(out.loss, want_loss, f"streamed loss, chunk {chunk}")
        _close(out.grad_rows, want_q, f"streamed dq, chunk {chunk}")
        _close(out.grad_cols, want_cols, f"streamed dD, chunk {chunk}")
        _close(out.scale_rows.sum(), want_s, f"streamed ds, chunk {chunk}")

    docs, local_ids = per_sample(p, n, ids, k)
    mq, ms, mb, mdocs = leaves(q, scale, bias, docs)
    loss = MicrobatchLoss(objective)(
        mq, mdocs, ms, mb if b is not None else None, ids=local_ids, teacher=teacher, guide=guide, own_only=own_only
    )
    loss.backward()
    _close(loss.detach(), want_loss, "microbatch loss")
    _close(mq.grad, want_q, "microbatch dq")
    _close(
        mdocs.grad if not k else torch.cat([mdocs.grad[:, 0], mdocs.grad[:, 1:].flatten(0, 1)]),
        want_cols,
        "microbatch dD",
    )


def assert_distributed_forms(objective, problem, want, name: str, teacher=None, guide=None, own_only=None) -> None:
    """`assert_forms`' streamed and microbatch forms on this rank of the default group, each rank holding
    N / world of the queries (and of their teacher's scores, gathered as the steps bind them)."""
    q, p, n, scale, bias, ids = problem
    want_loss, want_q, want_cols, _ = want
    rank, world, ranks = dist.get_rank(), dist.get_world_size(), Ranks(dist.group.WORLD)
    k = 0 if n is None else len(n) // len(q)
    own = slice(rank * (N // world), (rank + 1) * (N // world))
    cols, b = (p if n is None else torch.cat([p, n])), (bias if objective.has_bias else None)

    bound = objective if teacher is None else objective.with_teacher(ranks.gather(teacher[own]))
    bound = bound if guide is None else bound.with_guide(guide)
    if own_only is not None:  # every rank's flags gathered, as the steps gather them
        bound = own_documents_only(bound, ranks.gather(own_only[own].to(torch.uint8)).bool())
    out = bound.streamed(q[own], cols, scale, b, first_row=own.start, num_queries=N, chunk=3, ranks=ranks, ids=ids)
    _close(out.loss, want_loss, f"{name} streamed loss")
    _close(out.grad_rows, want_q[own], f"{name} streamed dq")
    shares = out.grad_cols.clone()
    dist.all_reduce(shares)
    _close(shares, want_cols, f"{name} streamed dD")

    docs, local_ids = per_sample(p, n, ids, k, own)
    lq, ls, lb, ldocs = leaves(q[own], scale, bias, docs)
    local_teacher = None if teacher is None else teacher[own]
    loss = MicrobatchLoss(objective, dist.group.WORLD)(
        lq, ldocs, ls, lb if b is not None else None, ids=local_ids, teacher=local_teacher, guide=guide,
        own_only=None if own_only is None else own_only[own],
    )  # fmt: skip
    loss.backward()
    _close(loss.detach(), want_loss, f"{name} microbatch loss")
    _close(lq.grad / world, want_q[own], f"{name} microbatch dq")
    _close((ldocs.grad if not k else ldocs.grad[:, 0]) / world, want_cols[:N][own], f"{name} microbatch dp")
