"""The cached-gradient engine: the two passes over chunks that every cached-gradient method shares.

1. `forward_no_grad(call, chunks)`: per chunk, capture the RNG (`RandContext`) and run
   `call(chunk)` without a graph. The caller then computes the loss on the outputs and its
   gradient with respect to each output: the gradient cache.
2. `forward_backward(call, chunks, states, gradients)`: per chunk, replay its RNG, run `call`
   again with a graph and backpropagate the surrogate  sum_k <output_k, cached gradient_k>  (in
   float32 or better). Its gradient with respect to each output is the cached one, so by the chain
   rule the parameters receive exactly dL/dtheta, with the activations of one chunk alive at a time.

`keep_last`: pass 1 runs its last chunk with a graph (it is the last forward before the loss) and
pass 2 backpropagates that chunk first, from the kept graph, then re-runs the others: one forward
in k saved, the same values (the re-forward would replay the same RNG), and still the activations
of one chunk alive at a time (the kept graph is freed before the first re-forward). Pass 2's
`sync(is_last)` marks the chunk processed last, which is then chunk k-2. The kept chunk's
forward runs inside `keep_last()`: the data-parallel context its backward needs (DDP decides in
forward), sync only when it is the only chunk.

`call` may return a Tensor or a tuple of Tensors (a CLIP model: image embeddings, text
embeddings, exp(logit_scale)); an output without a cached gradient (None) is left out of the
surrogate. With `replay` (pass 1's outputs per chunk), pass 2 calls `call(chunk, replay=...)`, a
`Replay` of that chunk's pass-1 outputs: a part of the model that needs no graph (a locked tower,
`components.freeze`) returns its entry instead of running again, so it runs once per sample. The
outputs go to the model as an argument, explicitly, through every layer between (GradCache, the
trainer's steps, the model's forward).
Users: `GradCache` (class and `@cached`) and the streaming global-negatives step (its phases A
and D), so the RNG replay and the surrogate exist once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .inputs import GradCacheError
from .rng import RandContext

__all__ = ["Kept", "Outputs", "Replay", "as_tuple", "float_dot", "forward_backward", "forward_no_grad"]

Outputs = Tensor | tuple[Tensor | None, ...]


def as_tuple(outputs: Outputs) -> tuple[Tensor | None, ...]:
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


class _SurrogateDot(torch.autograd.Function):
    """<rep, grad> in `dtype`; the backward writes go x grad, computed in `dtype`, straight into a
    tensor of rep's dtype (one rounding, as a product then a cast, without the wide temporary)."""

    @staticmethod
    def forward(ctx: Any, rep: Tensor, grad: Tensor, dtype: torch.dtype) -> Tensor:  # noqa: ANN401
        ctx.save_for_backward(grad)
        ctx.rep_dtype, ctx.dtype = rep.dtype, dtype
        return torch.dot(rep.flatten().to(dtype), grad.flatten().to(dtype))

    @staticmethod
    def backward(ctx: Any, go: Tensor) -> tuple[Tensor, None, None]:  # noqa: ANN401
        (grad,) = ctx.saved_tensors
        out = torch.empty(grad.shape, dtype=ctx.rep_dtype, device=grad.device)
        return torch.mul(grad.to(ctx.dtype), go.to(ctx.dtype), out=out), None, None


def float_dot(rep: Tensor, grad: Tensor) -> Tensor:
    """<rep, grad> in float32 or better, whatever the representation's dtype (bf16 / fp16 sums lose
    digits); its gradient with respect to `rep` is `grad` times the incoming gradient, in rep's dtype."""
    dtype = torch.promote_types(torch.promote_types(rep.dtype, grad.dtype), torch.float32)
    if grad.shape != rep.shape:
        raise GradCacheError(f"a cached gradient of shape {tuple(grad.shape)} for a representation {tuple(rep.shape)}")
    return _SurrogateDot.apply(rep, grad.detach(), dtype)


class Replay(Sequence):
    """Pass 1's outputs of the chunk a pass-2 re-forward runs: `replay[k]` is output k (None where
    pass 1 returned none). The model receives it as its `replay` argument. A sequence of its own
    rather than a tuple on purpose: data-parallel wrappers rewrite the tensors they find in a
    forward's arguments, inside tuples, lists and dicts (FSDP2 casts them to its compute dtype, DDP
    moves them to its device), and pass 1's outputs must reach the model exactly as pass 1 returned
    them."""

    __slots__ = ("outputs",)

    def __init__(self, outputs: Outputs) -> None:
        self.outputs = as_tuple(outputs)

    def __getitem__(self, index: int) -> Tensor | None:  # type: ignore[override]
        return self.outputs[index]

    def __len__(self) -> int:
        return len(self.outputs)


class Kept:
    """Pass 1's last chunk run with a graph (`forward_no_grad(keep_last=...)`): its outputs, which
    pass 2 backpropagates instead of re-running the chunk. Stands in that chunk's RNG state."""

    def __init__(self, outputs: Outputs) -> None:
        self.outputs = as_tuple(outputs)


def _detached(outputs: Outputs) -> Outputs:
    if isinstance(outputs, (tuple, list)):
        return tuple(None if o is None else o.detach() for o in outputs)
    return outputs.detach()


def forward_no_grad(
    call: Callable[[Any], Outputs],
    chunks: Sequence[Any],
    *,
    keep_last: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> tuple[list[Outputs], list[RandContext | Kept]]:
    """Pass 1: every chunk's outputs without a graph, and the RNG state each chunk started from.
    With `keep_last`, the last chunk runs with a graph inside `keep_last()`: its outputs are
    returned detached and its state is a `Kept` holding the graph."""
    outputs: list[Outputs] = []
    states: list[RandContext | Kept] = []
    for i, chunk in enumerate(chunks):
        if keep_last is not None and i == len(chunks) - 1:
            with keep_last():
                kept = call(chunk)
            states.append(Kept(kept))
            outputs.append(_detached(kept))
            continue
        states.append(RandContext())
        with torch.no_grad():
            outputs.append(call(chunk))
    return outputs, states


def forward_backward(
    call: Callable[..., Outputs],
    chunks: Sequence[Any],
    states: Sequence[RandContext | Kept],
    gradients: Callable[[int, tuple[Tensor | None, ...]], Sequence[Tensor | None]],
    *,
    sync: Callable[[bool], contextlib.AbstractContextManager] = lambda is_last: contextlib.nullcontext(),
    backward: Callable[[Tensor], None] = Tensor.backward,
    replay: Sequence[Outputs] | None = None,
) -> None:
    """Pass 2: per chunk i, replay its RNG, re-run `call` with a graph and backpropagate the surrogate.

    `gradients(i, outputs)` gives chunk i's cached gradient per output (None: not in the loss);
    it sees the re-forward's outputs, so a caller can slice a cache by their sizes. `sync(is_last)`
    is the context for a chunk's forward and backward, is_last for the chunk processed last (the
    data-parallel reduction: `sync.grad_sync`); `backward(surrogate)` runs the backward (a
    float16 caller scales). `replay[i]`: chunk i's pass-1 outputs; given, chunk i is re-run as
    `call(chunk, replay=Replay(replay[i]))` (see above), else as `call(chunk)`. A `Kept` state
    (pass 1's graph) is processed first, without a re-forward.
    """
    # the kept graph first: freed first
    order = sorted(range(len(chunks)), key=lambda i: not isinstance(states[i], Kept))
    for n, i in enumerate(order):
        state = states[i]
        with sync(n == len(order) - 1):
            if isinstance(state, Kept):
                outputs, state.outputs = state.outputs, ()  # the graph goes with this chunk's backward
            else:
                with state:
                    outputs = as_tuple(call(chunks[i]) if replay is None else call(chunks[i], replay=Replay(replay[i])))
            grads = list(gradients(i, outputs))
            if len(grads) != len(outputs):
                raise GradCacheError(
                    f"re-forward of chunk {i} gave {len(outputs)} outputs, the cache holds {len(grads)}"
                )
            terms = []
            for out, grad in zip(outputs, grads):
                if grad is None:
                    continue
                if out is None or grad.shape != out.shape:
                    shape = None if out is None else tuple(out.shape)
                    raise GradCacheError(
                        f"re-forward of chunk {i} gave a representation of shape {shape}, "
                        f"the cache holds {tuple(grad.shape)}"
                    )
                terms.append(float_dot(out, grad))
            del outputs
            if terms:
                surrogate = terms[0]
                for term in terms[1:]:
                    surrogate = surrogate + term
                backward(surrogate)
