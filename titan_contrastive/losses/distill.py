"""Knowledge distillation: the model's scores of a query's documents trained toward a teacher's.

A teacher scores what it can see. The data's scores (`datasets/pairs.py`: a `label` or `score`
column, or `labels` / `scores`; e.g. a cross-encoder's logits) are T_i0 of query i's positive and
T_i1..T_ik of its k hard negatives; a frozen teacher model (`[loss] teacher_model`, built like a
guide, `losses/guide.py`) scores every column of the problem, T_ij = <g(q_i), g(d_j)>. With the
model's logits S_ij = t <q_i, d_j> over the same documents (t MaxSim(q_i, d_j) for a late-interaction model: the
inner objective's `pair_scores`, `late_interaction.py`) the term is

    kl:          L_d = 1/N sum_i sum_j p_ij (log p_ij - log softmax(S_i)_j),   p_i = softmax(T_i / tau)
                 (`minmax`: S_i first scaled to (S_i - min S_i) / (max S_i - min S_i + 1e-8), PyLate's normalize_scores)
    margin_mse:  L_d = 1/(N k) sum_i sum_{j >= 1} ((S_i0 - S_ij) - (T_i0 - T_ij))^2    (the data's scores)
    cosent:      L_d = log(1 + sum over pairs (a, b) of the problem with T_a < T_b of exp(S_a - S_b))

where for cosent S = t <q, d>, or with `similarity = "angle"` (AnglE) S = t |<q, R d>|, R d = (d1 - d2, d1 + d2)
for d's halves (d1, d2) (a zero appended to an odd width): |cos + sin| of each pair's halves read as complex
numbers, sentence-transformers' `pairwise_angle_sim` of unit vectors.

(sentence-transformers' DistillKLDivLoss, without its tau^2 factor, MarginMSELoss, CoSENTLoss and AnglELoss; PyLate's
Distillation with `minmax`, tau = 1 and t = 1 under MaxSim; over every
column, the in-batch KL of embedding distillation). CoSENT ranks every (query, own document) pair of the
whole problem, N(1 + k) of them (k >= 0: scored pairs, an STS set's gold labels, need no negatives), by
the data's scores, in O(M log M): sorted by score, each pair's sum over the higher-scored ones is a running
log-sum-exp. It couples the rows, so the streamed form gathers the N(1 + k) logits (one scalar each) over
the ranks before its gradient. The run's loss is contrastive_weight x the
contrastive objective + weight x L_d (`Distilled`). A query's term reads only its own row, and a
rank holds every column, so each form is exact as it stands: the microbatch form on the gathered
problem, the streamed form on a rank's own rows in blocks (their gradients, their columns' shares
and their shares of dL/dt). The teacher's scores of the whole problem are bound per step
(`with_teacher`: the data's scores [N, 1 + k], or the teacher model's embeddings as a `Guide`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from titan_contrastive.losses.base import (
    Objective,
    Ranks,
    StreamResult,
    Wrapping,
    gathered_problem,
    own_columns,
    row_scale_shares,
)
from titan_contrastive.losses.guide import Guide

KINDS = ("kl", "margin_mse", "cosent", "mse")  # mse: a term of the embeddings, `embedding_distill.py`
MINMAX_EPS = 1e-8  # (S - min) / (max - min + eps): PyLate's epsilon
SIMILARITIES = ("cosine", "angle")


@dataclass(frozen=True)
class Distillation:
    """Which term (`kind`), its weight, the teacher's temperature tau (kl), whether the teacher is a frozen
    model's embeddings (`model`: the config key naming them, loss.teacher_model or loss.teacher_embeddings; their
    cosines over every column) rather than the data's scores, and the similarity cosent's logits are t x
    (`similarity`: cosine, or AnglE's angle)."""

    kind: str
    weight: float = 1.0
    temperature: float = 1.0
    model: str = ""
    similarity: str = "cosine"
    minmax: bool = False
    symmetric: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"loss.distill={self.kind!r} is not a distillation term; valid: {', '.join(KINDS)}")
        if self.similarity not in SIMILARITIES:
            raise ValueError(f"loss.cosent_similarity={self.similarity!r}: use one of {', '.join(SIMILARITIES)}")
        if self.similarity != "cosine" and self.kind != "cosent":
            raise ValueError(
                f"loss.cosent_similarity={self.similarity}: only loss.distill=cosent scores its pairs by another "
                f"similarity, and loss.distill={self.kind}; set loss.distill=cosent (AnglE) or leave it at cosine"
            )
        if self.kind != "kl" and self.temperature != 1.0:
            raise ValueError(
                f"loss.distill_temperature={self.temperature}: only loss.distill=kl has a temperature; leave it at 1"
            )
        if self.minmax and (self.kind != "kl" or self.model):
            raise ValueError(
                f"loss.distill_minmax=true scales each query's logits over its own documents for the KL, and "
                f"{f'{self.model} scores every column' if self.model else f'loss.distill={self.kind}'}: "
                "use loss.distill=kl on the data's scores, or set loss.distill_minmax=false"
            )
        if self.temperature == 0 and not self.model:
            raise ValueError(
                f"loss.distill_temperature=0 takes a teacher model's own temperature, and loss.distill={self.kind} "
                "reads the data's scores, which have none: set a number > 0"
            )
        if self.kind == "mse" and not self.model:
            raise ValueError(
                "loss.distill=mse regresses the model's embeddings onto a teacher's: set loss.teacher_embeddings "
                "(written by python -m titan_contrastive.embed) or loss.teacher_model"
            )
        if self.symmetric and (self.kind != "kl" or not self.model):
            raise ValueError(
                "loss.distill_symmetric=true distills each positive document's softmax over the queries, which needs a "
                f"teacher's scores of every pair: use loss.distill=kl with loss.teacher_model (or teacher_embeddings), "
                f"or set it false{'' if self.kind == 'kl' else f' (loss.distill={self.kind})'}"
            )
        if self.model and self.kind not in ("kl", "mse"):
            raise ValueError(
                f"loss.distill={self.kind} reads the data's scores of each query's own documents, and "
                f"{self.model} scores every column; use loss.distill=kl (or mse) with it, or leave {self.model} empty"
            )

    def whole(self, logits: Tensor, teacher: Tensor) -> Tensor:
        """The term (unweighted) of a whole problem, from its logits and the teacher's scores [N, columns]."""
        if self.kind == "cosent":
            return cosent(logits.flatten(), teacher.flatten())
        return self.rows(logits, teacher).mean()

    def rows(self, logits: Tensor, teacher: Tensor) -> Tensor:
        """The term of each row [c], from the student's logits and the teacher's scores [c, columns]."""
        teacher = teacher.to(logits.dtype)
        if self.kind == "kl":
            if self.minmax:  # PyLate's normalize_scores: each row's logits to [0, 1]
                low, high = logits.amin(1, keepdim=True), logits.amax(1, keepdim=True)
                logits = (logits - low) / (high - low + MINMAX_EPS)
            return kl_rows(logits, torch.softmax(teacher / self.temperature, 1))
        return ((logits[:, :1] - logits[:, 1:]) - (teacher[:, :1] - teacher[:, 1:])).square().mean(1)

    def describe(self) -> str:
        if self.model:
            what = f"KL to the teacher model's softmax over every column at tau {self.temperature:g}"
            if self.symmetric:
                what += ", and of each positive over the queries, the two averaged"
            return f"{self.weight:g} x distillation ({what})"
        if self.kind == "cosent":
            name = "AnglE (CoSENT on the angle similarity)" if self.similarity == "angle" else "CoSENT"
            return f"{self.weight:g} x {name} over every (query, own document) pair, ranked by the data's scores"
        what = f"KL to the teacher's softmax at tau {self.temperature:g}" if self.kind == "kl" else "margin MSE"
        if self.minmax:
            what += ", the logits min-max scaled per query"
        return f"{self.weight:g} x distillation ({what}) over each query's own documents"


def log_teacher_temperature(path: str, logit_scale: float) -> None:
    """The start log's note of a CLIP teacher's own temperature, 1 / exp(logit_scale): the one open_clip's
    distillation softmaxes its logits at (`[loss] distill_temperature`)."""
    logging.getLogger("titan_contrastive").info(
        f"{path}: the teacher's own temperature is {math.exp(-logit_scale):.4g} (1 / exp(logit_scale)), the one "
        "open_clip's distillation softmaxes its logits at (loss.distill_temperature)"
    )


def kl_rows(logits: Tensor, p: Tensor) -> Tensor:
    """[c]: KL(p_i || softmax(logits_i)) of each row, for the teacher's distributions p [c, columns]."""
    return (torch.xlogy(p, p) - p * torch.log_softmax(logits, 1)).sum(1)


def cosent(logits: Tensor, scores: Tensor) -> Tensor:
    """log(1 + sum over a, b with scores[a] < scores[b] of exp(logits[a] - logits[b])), for flat logits and
    scores [M]: in descending score order, the sum over the pairs above a is a prefix log-sum-exp of -logits,
    up to the first of a's ties."""
    order = torch.argsort(scores, descending=True, stable=True)
    s, t = logits[order], scores[order].to(logits.dtype)
    prefix = torch.logcumsumexp(-s, 0)
    first = torch.searchsorted(-t, -t)  # each pair's first position among its ties (-t ascends)
    above = torch.where(first > 0, prefix[(first - 1).clamp(min=0)], torch.full_like(s, -torch.inf))
    return torch.logsumexp(torch.cat([s.new_zeros(1), s + above]), 0)


def pair_similarity(q: Tensor, docs: Tensor, similarity: str = "cosine") -> Tensor:
    """[c, k]: each row of `q` [c, d] with its documents `docs` [c, k, d] (unit vectors): <q, d>, or for "angle"
    |<q, R d>| (the module docstring), equal to sentence-transformers' `pairwise_angle_sim`."""
    if similarity == "angle":
        if q.shape[-1] % 2:  # a zero appended to both, as sentence-transformers pads an odd width
            q, docs = F.pad(q, (0, 1)), F.pad(docs, (0, 1))
        first, second = docs.chunk(2, -1)
        return torch.einsum("cd,ckd->ck", q, torch.cat([first - second, first + second], -1)).abs()
    return torch.einsum("cd,ckd->ck", q, docs)


Pairs = Callable[[Tensor, Tensor], Tensor]
"""Scores each row of q [c, d] with its own documents [c, k, d]: [c, k], with autograd."""


def own_logits(q: Tensor, docs: Tensor, scale: Tensor, first_row: int, num_queries: int, pairs: Pairs) -> Tensor:
    """[c, 1 + k]: t x `pairs` of the rows first_row.. of `q` and their own documents in `docs`."""
    idx = own_columns(first_row, len(q), num_queries, len(docs), q.device)
    return scale * pairs(q, docs[idx])


@dataclass(frozen=True)
class TeacherTerm(Wrapping):
    """A contrastive objective (weighted by `contrastive_weight`; 0 leaves it out) plus a teacher's term
    (`distillation`: its kind, weight and teacher); `teacher`: the teacher of the problem the next call computes
    (`with_teacher`). A subclass gives `_term(q, docs, scale)`, the weighted term of a whole problem (autograd), and
    `_share(q_own, docs, scale, first_row, num_queries, chunk, ranks)`: (the whole term, summed over the ranks; its
    gradients of this rank's rows and of every column; its rows' shares of dL/dt), in the accumulation dtype; the
    three forms follow (`Distilled`, `embedding_distill.py`'s `EmbeddingDistilled`)."""

    inner: Objective
    distillation: Distillation
    contrastive_weight: float = 1.0
    teacher: Tensor | Guide | None = field(default=None, compare=False, repr=False)

    def with_guide(self, guide: Guide | None) -> Objective:
        return dataclasses.replace(self, inner=self.inner.with_guide(guide))

    def with_teacher(self, teacher: Tensor | Guide) -> Objective:
        return dataclasses.replace(self, teacher=teacher)

    def fused(self, num_queries: int, num_columns: int) -> bool:
        return self.inner.fused(num_queries, num_columns)

    def _term(self, q: Tensor, docs: Tensor, scale: Tensor) -> Tensor:
        raise NotImplementedError

    def _share(
        self, q_own: Tensor, docs: Tensor, scale: Tensor, first_row: int, num_queries: int, chunk: int, ranks: Ranks
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def dense(
        self, q: Tensor, docs: Tensor, scale: Tensor, bias: Tensor | None = None, ids: Tensor | None = None
    ) -> Tensor:
        term = self._term(q, docs, scale)
        if not self.contrastive_weight:
            return term
        return self.contrastive_weight * self.inner.dense(q, docs, scale, bias, ids) + term

    def microbatch(
        self,
        q: Tensor,
        docs: tuple[Tensor, Tensor | None],
        scale: Tensor,
        bias: Tensor | None,
        ids: tuple[Tensor, Tensor | None] | None,
        ranks: Ranks,
    ) -> Tensor:
        """The term on the problem gathered with gradient (the inner objective's convention: the
        same loss on every rank)."""
        queries, cols, _ = gathered_problem(q, docs, None, ranks)
        term = self._term(queries, cols, scale)
        if not self.contrastive_weight:
            return term
        return self.contrastive_weight * self.inner.microbatch(q, docs, scale, bias, ids, ranks) + term

    def streamed(
        self,
        q_own: Tensor,
        docs: Tensor,
        scale: Tensor,
        bias: Tensor | None = None,
        *,
        first_row: int,
        num_queries: int,
        chunk: int,
        ranks: Ranks,
        kernel: str = "pytorch",
        ids: Tensor | None = None,
    ) -> StreamResult:
        """The own rows' terms and gradients (`_share`), then the inner objective's streamed form, weighted."""
        loss, grad_rows, grad_cols, scale_rows = self._share(q_own, docs, scale, first_row, num_queries, chunk, ranks)
        if not self.contrastive_weight:
            bias_rows = torch.zeros(len(q_own), dtype=scale_rows.dtype, device=q_own.device) if self.has_bias else None
            return StreamResult(loss, grad_rows, grad_cols, scale_rows, bias_rows)
        w = self.contrastive_weight
        part = self.inner.streamed(
            q_own, docs, scale, bias,
            first_row=first_row, num_queries=num_queries, chunk=chunk, ranks=ranks, kernel=kernel, ids=ids,
        )  # fmt: skip
        return StreamResult(
            w * part.loss + loss.to(part.loss.dtype),
            w * part.grad_rows + grad_rows.to(part.grad_rows.dtype),
            w * part.grad_cols + grad_cols.to(part.grad_cols.dtype),
            w * part.scale_rows + scale_rows.to(part.scale_rows.dtype),
            None if part.bias_rows is None else w * part.bias_rows,
        )


@dataclass(frozen=True)
class Distilled(TeacherTerm):
    """A contrastive objective plus a distillation term of the scores (`TeacherTerm`); see the module docstring.
    `teacher`: the data's scores [N, 1 + k], or the teacher model's embeddings."""

    def describe(self) -> str:
        if not self.contrastive_weight:
            late = f", scored by late interaction (MaxSim of {self.token_dim}-wide tokens)" if self.token_dim else ""
            return f"{self.distillation.describe()}{late}, without the contrastive objective"
        return f"{self.contrastive_weight:g} x {self.inner.describe()} + {self.distillation.describe()}"

    def _pairs(self, q: Tensor, docs: Tensor) -> Tensor:
        """[c, k]: each row of q with its own documents [c, k, d], scored as the inner objective scores them where
        it reads tokens (`pair_scores`: late interaction's MaxSim), else by the distillation's similarity."""
        pairs = getattr(self.inner, "pair_scores", None)
        return pairs(q, docs) if pairs is not None else pair_similarity(q, docs, self.distillation.similarity)

    def _teacher(self, num_queries: int, num_columns: int) -> Tensor | Guide:
        """The bound teacher, checked against the problem's shape and the teacher's kind."""
        teacher, model = self.teacher, self.distillation.model
        if teacher is None or isinstance(teacher, Guide) != bool(model):
            want = "the teacher model's embeddings" if model else "the data's teacher scores"
            raise ValueError(f"loss.distill: no teacher for this problem; the step must bind {want}")
        if model:
            if (len(teacher.queries), len(teacher.columns)) != (num_queries, num_columns):
                raise ValueError(
                    f"loss.teacher_model: embeddings of {len(teacher.queries)} queries and {len(teacher.columns)} "
                    f"columns for a problem of {num_queries} and {num_columns}"
                )
            return teacher
        k, least = (num_columns - num_queries) // max(num_queries, 1), int(self.distillation.kind != "cosent")
        if k < least or tuple(teacher.shape) != (num_queries, 1 + k):
            raise ValueError(
                f"loss.distill: teacher scores {tuple(teacher.shape)} for {num_queries} queries and "
                f"{num_columns} columns; it needs [{num_queries}, 1 + k] with k >= {least} hard negatives per query"
            )
        return teacher

    def _term(self, q: Tensor, docs: Tensor, scale: Tensor) -> Tensor:
        """weight x L_d of a whole problem (autograd)."""
        teacher = self._teacher(len(q), len(docs))
        if isinstance(teacher, Guide):
            logits, tau = scale * (q @ docs.T), self.distillation.temperature
            term = kl_rows(logits, teacher.targets(tau, logits.dtype)).mean()
            if self.distillation.symmetric:  # each positive's softmax over the queries too
                along = kl_rows(logits[:, : len(q)].T, teacher.targets(tau, logits.dtype, transposed=True)).mean()
                term = (term + along) / 2
            return self.distillation.weight * term
        logits = own_logits(q, docs, scale, 0, len(q), self._pairs)
        return self.distillation.weight * self.distillation.whole(logits, teacher)

    def _share(
        self, q_own: Tensor, docs: Tensor, scale: Tensor, first_row: int, num_queries: int, chunk: int, ranks: Ranks
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The own rows' terms, their gradients and their columns' shares (`_own_documents`, `_every_column` or
        `_ranked`)."""
        n, acc = num_queries, torch.promote_types(q_own.dtype, torch.float32)
        teacher = self._teacher(n, len(docs))
        if self.distillation.kind == "cosent":
            term, grad_rows, grad_cols = _ranked(
                self.distillation, self._pairs, q_own, docs, scale.detach().to(acc), teacher, first_row, ranks
            )
        elif isinstance(teacher, Guide):
            term, grad_rows, grad_cols = _every_column(
                self.distillation, q_own, docs, scale.detach().to(acc), teacher, first_row, n, chunk, ranks
            )
        else:
            term, grad_rows, grad_cols = _own_documents(
                self.distillation, self._pairs, q_own, docs, scale.detach().to(acc), teacher, first_row, n
            )
        return ranks.sum(term.detach().clone()), grad_rows, grad_cols, row_scale_shares(q_own.to(acc), grad_rows, scale)


def _own_documents(
    distillation: Distillation, pairs: Pairs, q_own: Tensor, docs: Tensor, scale: Tensor, teacher: Tensor,
    first_row: int, n: int,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """weight/N x the own rows' terms over their own documents (the data's scores), by autograd on
    [c, 1 + k] logits (`pairs`); dL/dq of the rows, and dL/dD with their documents' gradients in their columns."""
    c, acc = len(q_own), scale.dtype
    idx = own_columns(first_row, c, n, len(docs), docs.device)
    with torch.enable_grad():
        q_leaf = q_own.detach().to(acc).requires_grad_()
        d_leaf = docs[idx].detach().to(acc).requires_grad_()
        logits = scale * pairs(q_leaf, d_leaf)
        term = distillation.rows(logits, teacher[first_row : first_row + c]).sum() * (distillation.weight / n)
        grad_rows, grad_own = torch.autograd.grad(term, (q_leaf, d_leaf))
    grad_cols = torch.zeros(docs.shape, dtype=acc, device=docs.device)
    grad_cols.index_put_((idx.flatten(),), grad_own.flatten(0, 1))
    return term, grad_rows, grad_cols


def _every_column(
    distillation: Distillation, q_own: Tensor, docs: Tensor, scale: Tensor, teacher: Guide, first_row: int, n: int,
    chunk: int, ranks: Ranks,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """weight/N x the own rows' KL over every column (the teacher model's cosines), in blocks of
    `chunk` rows (a rank holds every column, so each block holds its rows' whole softmax):
    dL/dS = weight/N (softmax(S) - p), carried to the rows and the columns in closed form. `symmetric`: half
    of that, and half of each positive column's KL over the queries, whose log-sum-exps over every rank's rows
    (the model's, LSE_j, and the teacher's) are merged first; the own rows' share of it is
    dL/dS_ij = weight/2N (exp(S_ij - LSE_j) - p'_ij) for j < N, and the rank's share of the LSEs' sum 1/world of it."""
    acc, c, tau = scale.dtype, len(q_own), distillation.temperature
    cols = docs.to(acc)
    term = torch.zeros((), dtype=acc, device=q_own.device)
    grad_rows = torch.empty(c, docs.shape[1], dtype=acc, device=q_own.device)
    grad_cols = torch.zeros(cols.shape, dtype=acc, device=docs.device)
    factor = distillation.weight / n / (2 if distillation.symmetric else 1)

    def block(start: int) -> tuple[Tensor, Tensor]:  # (the model's logits, the teacher's scores / tau) of the rows
        rows = q_own[start : start + chunk].to(acc)
        mine = teacher.queries[first_row + start : first_row + start + len(rows)]
        return scale * (rows @ cols.T), (mine @ teacher.columns.T).to(acc) / tau

    if distillation.symmetric:  # the positives' log-sum-exps over the queries, the model's and the teacher's
        part = torch.full((2, n), -torch.inf, dtype=acc, device=q_own.device)
        for start in range(0, c, chunk):
            logits, targets = block(start)
            part = torch.logaddexp(part, torch.stack([logits[:, :n], targets[:, :n]]).logsumexp(1))
        lse, teacher_lse = ranks.merge_lse(part.flatten()).view(2, n)
        term += lse.sum() * factor / ranks.world
    for start in range(0, c, chunk):
        logits, targets = block(start)
        rows = q_own[start : start + chunk].to(acc)
        p = torch.softmax(targets, 1)
        log_student = torch.log_softmax(logits, 1)
        term += (torch.xlogy(p, p) - p * log_student).sum() * factor
        grad_logits = log_student.exp_() - p
        if distillation.symmetric:
            along = (targets[:, :n] - teacher_lse).exp_()  # p'_ij: the teacher's softmax of column j over queries
            term += (torch.xlogy(along, along) - along * logits[:, :n]).sum() * factor
            grad_logits[:, :n] += (logits[:, :n] - lse).exp_() - along
        grad_logits.mul_(factor * scale)
        grad_rows[start : start + len(rows)] = grad_logits @ cols
        grad_cols.addmm_(grad_logits.T, rows)
    return term, grad_rows, grad_cols


def _ranked(
    distillation: Distillation, pairs: Pairs, q_own: Tensor, docs: Tensor, scale: Tensor, teacher: Tensor,
    first_row: int, ranks: Ranks,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """CoSENT's share of a rank: the own rows' logits of their own documents, gathered over the ranks (each
    rank's rows in rank order: the problem's); the term over all of them (1/world of it, so the ranks' shares
    sum to it); its gradient's own rows carried to q and to their documents' columns."""
    c, n, acc = len(q_own), len(teacher), scale.dtype
    idx = own_columns(first_row, c, n, len(docs), docs.device)
    with torch.enable_grad():
        q_leaf = q_own.detach().to(acc).requires_grad_()
        d_leaf = docs[idx].detach().to(acc).requires_grad_()
        logits = scale * pairs(q_leaf, d_leaf)
        every = ranks.gather(logits.detach()).requires_grad_()
        term = distillation.weight * distillation.whole(every, teacher)
        (grad_every,) = torch.autograd.grad(term, every)
        grad_rows, grad_own = torch.autograd.grad(logits, (q_leaf, d_leaf), grad_every[first_row : first_row + c])
    grad_cols = torch.zeros(docs.shape, dtype=acc, device=docs.device)
    grad_cols.index_put_((idx.flatten(),), grad_own.flatten(0, 1))
    return term.detach() / ranks.world, grad_rows, grad_cols
