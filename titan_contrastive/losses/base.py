"""What every objective is, and the pieces they share.

A contrastive problem: N queries q_i (the first tower: images, or query texts), their positives
p_i and k >= 0 hard negatives n_i1..n_ik each (the second tower), over all ranks. The candidate
documents are D = [p_1..p_N, n_11..n_1k, n_21..n_Nk]: N(1 + k) columns shared by every query,
column i being query i's positive (sentence-transformers' and tevatron's convention). `ids`
(optional, one int per column) say which columns are the same document (false-negative masking).

An objective (`Objective`) owns its temperature (and bias) and three forms of one definition:
- `dense`: the autograd reference over all queries and columns;
- `microbatch`: over the embeddings of all ranks' current microbatches, gathered with gradient;
- `streamed`: a rank's own query rows against all columns in blocks (O(chunk x M) memory), its
  loss and the gradients of its rows, of all columns (this rank's share, to be summed over
  ranks) and of the temperature and bias (per own row), for the cached-gradient steps.
The steps call these and nothing loss-specific; `losses/__init__.py` names the objectives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from titan_contrastive.parallelisms.collectives import all_gather_tensor, all_gather_with_grad, reduce_scatter_sum

if TYPE_CHECKING:
    from titan_contrastive.losses.guide import Guide

ROW_BLOCK = 4096  # rows per block of `row_dots`: a 4096 x 512 float32 temporary is 8 MiB


class StreamResult(NamedTuple):
    """A rank's part of a streamed objective (the caller sums the shares over ranks)."""

    loss: Tensor
    """The whole problem's loss, the same on every rank (detached)."""
    grad_rows: Tensor
    """dL/dq for the own rows [c, d]."""
    grad_cols: Tensor
    """This rank's share of dL/dD for all columns [M, d]."""
    scale_rows: Tensor
    """This rank's share of dL/ds per own row [c] (s = exp(t'), the temperature's multiplier)."""
    bias_rows: Tensor | None
    """This rank's share of dL/db per own row [c], for objectives with a bias."""


@dataclass
class Ranks:
    """The data-parallel ranks that share one contrastive problem (None: this process alone)."""

    group: dist.ProcessGroup | None = None
    world: int = field(init=False)
    rank: int = field(init=False)

    def __post_init__(self) -> None:
        self.world = dist.get_world_size(self.group) if self.group is not None and dist.is_initialized() else 1
        self.rank = dist.get_rank(self.group) if self.world > 1 else 0

    def gather(self, x: Tensor) -> Tensor:
        """Every rank's `x`, concatenated in rank order along dim 0 (no gradient); bool flags sent as bytes (gloo
        gathers no bool tensors)."""
        if self.world == 1:
            return x
        if x.dtype == torch.bool:
            return all_gather_tensor(x.to(torch.uint8), self.group).bool()
        return all_gather_tensor(x, self.group)

    def gather_with_grad(self, x: Tensor) -> Tensor:
        """`gather`, with the gradient of every rank's copy summed back into `x`."""
        return all_gather_with_grad(x, self.group) if self.world > 1 else x

    def sum(self, x: Tensor) -> Tensor:
        """The sum over ranks (in place)."""
        if self.world > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def merge_lse(self, part: Tensor) -> Tensor:
        """The logsumexp over ranks of per-rank partial log-sum-exps."""
        return self.gather(part).view(self.world, -1).logsumexp(0) if self.world > 1 else part

    def scatter_sum(self, x: Tensor) -> Tensor:
        """The sum over ranks of `x` [world * c, ...], this rank's c rows of it."""
        return reduce_scatter_sum(x, self.group) if self.world > 1 else x


def columns(positives: Tensor, negatives: Tensor | None) -> Tensor:
    """D = [positives; negatives] (negatives None or empty: the positives)."""
    return positives if negatives is None or not len(negatives) else torch.cat([positives, negatives])


def own_columns(first_row: int, rows: int, num_queries: int, num_columns: int, device: torch.device) -> Tensor:
    """[rows, 1 + k]: the columns of D that are queries first_row, first_row + 1, ...'s own
    documents, in the layout of `columns`: its positive i, then its hard negatives N + i k, ..."""
    k = (num_columns - num_queries) // num_queries
    i = first_row + torch.arange(rows, device=device)[:, None]
    return torch.cat([i, num_queries + i * k + torch.arange(k, device=device)[None, :]], 1)


class Objective(Protocol):
    """A contrastive objective; see the module docstring. `microbatch` and `streamed` compute the
    same loss as `dense` (the tests hold them to it); `fused` says whether the Triton kernels
    (`losses/fused.py`) compute it."""

    name: str
    has_bias: bool
    init_logit_scale: float
    init_logit_bias: float | None
    needs_ids: bool
    """Whether it reads document ids (`ids`): the duplicate mask."""

    def dense(
        self, q: Tensor, docs: Tensor, scale: Tensor, bias: Tensor | None = None, ids: Tensor | None = None
    ) -> Tensor: ...

    def microbatch(
        self,
        q: Tensor,
        docs: tuple[Tensor, Tensor | None],
        scale: Tensor,
        bias: Tensor | None,
        ids: tuple[Tensor, Tensor | None] | None,
        ranks: Ranks,
    ) -> Tensor: ...

    def streamed(
        self,
        q_own: Tensor,
        docs: Tensor,
        scale: Tensor,
        bias: Tensor | None,
        *,
        first_row: int,
        num_queries: int,
        chunk: int,
        ranks: Ranks,
        kernel: str = "pytorch",
        ids: Tensor | None = None,
    ) -> StreamResult: ...

    def with_guide(self, guide: Guide | None) -> Objective:
        """The same objective whose false-negative masks read a guide's cosines of one problem
        (`losses/guide.py`); only a run with `[loss] guide_model` calls it."""

    def fused(self, num_queries: int, num_columns: int) -> bool: ...

    def describe(self) -> str: ...


class Wrapping:
    """What an objective that wraps another (`inner`: Matryoshka, Distilled) takes from it as it is: its name,
    bias, ids, kernel kind, initial temperature and bias and token width; and its state at a step (`at_step`)."""

    inner: Objective

    def at_step(self, step: int) -> Objective:
        """Itself with its inner objective as it stands at optimizer step `step`."""
        return dataclasses.replace(self, inner=at_step(self.inner, step))  # type: ignore[type-var]

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def has_bias(self) -> bool:
        return self.inner.has_bias

    @property
    def needs_ids(self) -> bool:
        return self.inner.needs_ids

    @property
    def kernel_kind(self) -> str:
        return self.inner.kernel_kind

    @property
    def init_logit_scale(self) -> float:
        return self.inner.init_logit_scale

    @property
    def init_logit_bias(self) -> float | None:
        return self.inner.init_logit_bias

    @property
    def token_dim(self) -> int:
        """The inner objective's token width where it scores by late interaction, else 0."""
        return getattr(self.inner, "token_dim", 0)

    @property
    def similarity(self) -> Callable[[Tensor, Tensor], Tensor]:
        """The inner objective's scores of every query with every document where it scores otherwise than by the dot
        product (late interaction); an AttributeError where it does not, as for any objective without them."""
        return self.inner.similarity  # type: ignore[attr-defined]


def gathered_problem(
    q: Tensor,
    docs: tuple[Tensor, Tensor | None],
    ids: tuple[Tensor, Tensor | None] | None,
    ranks: Ranks,
    *,
    with_rows: bool = True,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(queries, columns D, column ids) of the problem over all ranks, gathered with gradient:
    the positives of all ranks first, then their negatives (both in rank order, so query i's
    negatives stay at N + i k ...). `with_rows=False`: the local queries, not gathered."""
    positives, negatives = docs
    cols = columns(ranks.gather_with_grad(positives), None if negatives is None else ranks.gather_with_grad(negatives))
    col_ids = None
    if ids is not None:
        col_ids = columns(ranks.gather(ids[0]), None if ids[1] is None else ranks.gather(ids[1]))
    return (ranks.gather_with_grad(q) if with_rows else q), cols, col_ids


def at_step(objective: Objective, step: int | None) -> Objective:
    """`objective` as it stands at optimizer step `step` (0-based; None: as built): a term with a schedule of its
    own (FLOPS' warmup, `flops.py`) weighted for the step, through the wrappers around it; an objective without
    an `at_step` method, as it is."""
    method = getattr(objective, "at_step", None)
    return objective if step is None or method is None else method(step)


class EmbeddingTerm(Wrapping):
    """An objective (`inner`) plus a term that reads the embeddings alone, not the logits (GOR, `spread.py`;
    FLOPS, `flops.py`). A subclass gives `whole(q, docs)`, the weighted term of a whole problem (autograd), and
    `own_share(rows, docs, num_queries, ranks)`: (the whole term, its gradient of this rank's rows, its gradient of
    every column, each gradient of the rows' or columns' shape or broadcasting to it) from the rows in the
    accumulation dtype, the columns as they are; the forms follow."""

    def with_guide(self, guide: Guide | None) -> Objective:
        return dataclasses.replace(self, inner=self.inner.with_guide(guide))  # type: ignore[type-var]

    def with_teacher(self, teacher: Tensor | Guide) -> Objective:
        return dataclasses.replace(self, inner=self.inner.with_teacher(teacher))  # type: ignore[type-var, attr-defined]

    def fused(self, num_queries: int, num_columns: int) -> bool:
        return self.inner.fused(num_queries, num_columns)

    def whole(self, q: Tensor, docs: Tensor) -> Tensor:
        raise NotImplementedError

    def own_share(self, rows: Tensor, docs: Tensor, num_queries: int, ranks: Ranks) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def dense(
        self, q: Tensor, docs: Tensor, scale: Tensor, bias: Tensor | None = None, ids: Tensor | None = None
    ) -> Tensor:
        return self.inner.dense(q, docs, scale, bias, ids) + self.whole(q, docs)

    def microbatch(
        self,
        q: Tensor,
        docs: tuple[Tensor, Tensor | None],
        scale: Tensor,
        bias: Tensor | None,
        ids: tuple[Tensor, Tensor | None] | None,
        ranks: Ranks,
    ) -> Tensor:
        """The term on the problem gathered with gradient (the inner objective's convention: the same loss on
        every rank)."""
        queries, cols, _ = gathered_problem(q, docs, None, ranks)
        return self.inner.microbatch(q, docs, scale, bias, ids, ranks) + self.whole(queries, cols)

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
        """The inner objective's streamed form, plus the term (`own_share`): the own rows' gradients and this
        rank's 1/world share of the columns' (every rank holds every column)."""
        part = self.inner.streamed(
            q_own, docs, scale, bias,
            first_row=first_row, num_queries=num_queries, chunk=chunk, ranks=ranks, kernel=kernel, ids=ids,
        )  # fmt: skip
        rows = q_own.detach().to(part.grad_rows.dtype)
        term, grad_rows, grad_cols = self.own_share(rows, docs, num_queries, ranks)
        return StreamResult(
            part.loss + term.detach().to(part.loss.dtype),
            part.grad_rows + grad_rows,
            part.grad_cols + grad_cols / ranks.world,
            part.scale_rows,
            part.bias_rows,
        )


def bind_teacher(objective: Objective, teacher: Tensor | Guide, ranks: Ranks) -> Objective:
    """`objective` with a distillation's teacher of the whole problem: the data's scores of the
    local documents, gathered over `ranks`, or a teacher model's embeddings, gathered already."""
    return objective.with_teacher(ranks.gather(teacher) if isinstance(teacher, Tensor) else teacher)


def own_documents_only(objective: Objective, own_only: Tensor | None) -> Objective:
    """`objective` whose masks leave each flagged query of one problem (bool [N] over all ranks' queries,
    `data.in_batch_negatives`) its own documents only (`masking.FalseNegatives.grouped`), through the objectives
    that wrap it; `own_only` None: `objective` as it is. ValueError for an objective without false-negative masks."""
    if own_only is None:
        return objective
    if isinstance(objective, Wrapping):
        return dataclasses.replace(objective, inner=own_documents_only(objective.inner, own_only))  # type: ignore[type-var]
    masks = getattr(objective, "false_negatives", None)
    if not callable(getattr(masks, "grouped", None)) or not dataclasses.is_dataclass(objective):
        raise ValueError(
            f"{objective.describe()} has no false-negative masks (a false_negatives field, losses/masking.py), so it "
            "cannot score a query against its own documents only"
        )
    return dataclasses.replace(objective, false_negatives=masks.grouped(own_only))  # type: ignore[type-var]


def row_dots(a: Tensor, b: Tensor, dtype: torch.dtype, block: int = ROW_BLOCK) -> Tensor:
    """<a_i, b_i> per row, each product and the sum in `dtype`, `block` rows at a time (the
    temporary in `dtype` stays [block, d] however many rows there are)."""
    blocks = range(0, len(a), block)
    return torch.cat([a[i : i + block].to(dtype, copy=True).mul_(b[i : i + block]).sum(1) for i in blocks])


def row_scale_shares(q_own: Tensor, grad_rows: Tensor, scale: Tensor) -> Tensor:
    """dL/ds per own row, <q_i, dL/dq_i> / s: the loss depends on s only through s <q, d>."""
    return row_dots(q_own, grad_rows, grad_rows.dtype) / scale.to(grad_rows.dtype)


class RescaleAccumulatedLoss:
    """Wrap a training loss so each call returns `loss / accumulation_steps`.

    Gradient accumulation and contrastive losses: dividing each microbatch loss by the k
    accumulation steps makes the summed gradients the mean of the k microbatch gradients. For a
    per-sample loss with equal microbatches that *is* the big-batch gradient; for a contrastive
    loss it is not (a microbatch sees only its own negatives), which is why `[loss] negatives`
    names the choice. Only the training loss is wrapped; evaluation builds its own, unwrapped.
    `no_rescale()` turns the division off temporarily (e.g. to log the raw value of a microbatch).
    """

    def __init__(self, unwrapped_loss_fn: Callable[..., Tensor], accumulation_steps: int) -> None:
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps={accumulation_steps} must be >= 1")
        self.unwrapped_loss_fn = unwrapped_loss_fn
        self.accumulation_steps = accumulation_steps
        self.skip_rescale = False
        functools.update_wrapper(self, unwrapped_loss_fn, updated=())

    def __call__(self, *args, **kwargs) -> Tensor:
        loss = self.unwrapped_loss_fn(*args, **kwargs)
        return loss if self.skip_rescale else loss / self.accumulation_steps

    @contextlib.contextmanager
    def no_rescale(self) -> Iterator[None]:
        """Return the raw loss inside the block (restores the previous setting on exit)."""
        previous, self.skip_rescale = self.skip_rescale, True
        try:
            yield
        finally:
            self.skip_rescale = previous


def widths_fit(objective: Objective, q: Tensor, docs: Tensor) -> bool:
    """Whether query and document embeddings are as wide as `objective` reads them: equally, or whole tokens on
    each side, any number of them, for late interaction (an objective with a `token_dim`)."""
    token = getattr(objective, "token_dim", 0)
    return q.shape[-1] % token == docs.shape[-1] % token == 0 if token else q.shape[-1] == docs.shape[-1]


def split_documents(docs: Tensor) -> tuple[Tensor, Tensor | None]:
    """Per-sample documents [B, d] (positives) or [B, 1 + k, d] (the positive, then k hard
    negatives; `batching.with_negatives`) as (positives [B, d], negatives [B k, d] or None)."""
    if docs.dim() == 2:
        return docs, None
    return docs[:, 0], (docs[:, 1:].flatten(0, 1) if docs.shape[1] > 1 else None)


def split_ids(ids: Tensor) -> tuple[Tensor, Tensor | None]:
    """Per-sample document ids [B] or [B, 1 + k] (`batching.document_ids`) as (the positives' [B],
    the hard negatives' [B k] or None), the layout of `split_documents`."""
    if ids.dim() == 1:
        return ids, None
    return ids[:, 0], (ids[:, 1:].flatten() if ids.shape[1] > 1 else None)


class MicrobatchLoss:
    """An objective's microbatch form as the loss function of a step: called with a model's
    contrastive outputs `(q, docs, exp(t')[, bias])` (docs [B, d], or [B, 1 + k, d] with hard
    negatives; `ids=`: their document ids, [B] or [B, 1 + k]; `guide=`: a guide's embeddings of the
    whole problem; `teacher=`: a distilled objective's teacher, the data's scores of the local
    documents [B, 1 + k] or a teacher model's embeddings of the whole problem; `own_only=`: bool [B], the local
    queries scored against their own documents only, `own_documents_only`), it returns the loss
    of the problem over the current microbatches of all ranks of `group`; `step` gives the optimizer step
    being computed, for a term with a schedule (`at_step`)."""

    def __init__(
        self, objective: Objective, group: dist.ProcessGroup | None = None, step: Callable[[], int] | None = None
    ) -> None:
        self.objective, self.ranks, self.step = objective, Ranks(group), step

    def __call__(
        self,
        q: Tensor,
        docs: Tensor,
        scale: Tensor,
        bias: Tensor | None = None,
        *,
        ids: Tensor | None = None,
        guide: Guide | None = None,
        teacher: Tensor | Guide | None = None,
        own_only: Tensor | None = None,
    ) -> Tensor:
        if q.dim() != 2 or docs.dim() not in (2, 3) or len(q) != len(docs) or not widths_fit(self.objective, q, docs):
            raise ValueError(
                f"query embeddings {tuple(q.shape)} and document embeddings {tuple(docs.shape)} must be [B, d] and "
                "[B, d] (or [B, 1 + k, d] with hard negatives)"
            )
        split = None if ids is None else split_ids(ids)
        step = None if self.step is None else self.step()
        objective = at_step(self.objective if guide is None else self.objective.with_guide(guide), step)
        if own_only is not None:
            objective = own_documents_only(objective, self.ranks.gather(own_only))
        if teacher is not None:
            objective = bind_teacher(objective, teacher, self.ranks)
        return objective.microbatch(q, split_documents(docs), scale, bias, split, self.ranks)
