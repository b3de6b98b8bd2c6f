"""GradCache (Gao et al. 2021): a contrastive batch as large as you like at the memory of one chunk.

Order of operations in `cache_step(*model_inputs)` (one input per model, e.g. queries and
passages, plus hard negatives):
1. split every input into chunks (`chunk_sizes[i]` samples for model i; or, with
   `chunk_tokens[i]`, the samples sorted by length and packed into chunks of at most that many
   tokens, `batching.token_chunks`), each cut to its longest sequence (`batching.trim_padding`: the
   trailing columns that are padding in every row of the chunk, where the input marks its padding
   with an `attention_mask` or `pad_ids`; a no-op for anything else);
2. `forward_no_grad`: per chunk, capture the RNG (RandContext) and run the model without a
   graph (with one model, its last chunk with a graph, kept for step 4); concatenate the chunk
   representations (put back in batch order after token chunks);
3. `build_cache`: the loss on the detached, float32 representations; backward gives
   dL/d(representation) for every sample (the "gradient cache"); with float16 the loss is scaled
   by the GradScaler first, so the cache holds scaled gradients and the parameter gradients come
   out scaled as the scaler expects;
4. `forward_backward`: the kept chunk first, from its graph; then per chunk, replay its RNG,
   forward with a graph (with `replay=True` the model also receives step 2's outputs of the chunk
   as its `replay` argument, `engine.Replay`); each chunk's backward of the float32
   surrogate <representation, cached gradient>: by the chain rule this accumulates exactly
   dL/dtheta (token chunks take their rows of the cache in chunk order). With
   `no_sync_except_last` the data-parallel reduction runs only on the very last chunk a model sees
   (`sync.grad_sync`: DDP `no_sync`, FSDP2 deferral; a plain model needs nothing), also
   when one model is passed twice (tied towers).
The caller then steps the optimizer (through the scaler with float16). Steps 2 and 4 are the
cached-gradient engine (`engine.py`), which the streaming global-negatives step shares.

A model with several outputs (a CLIP model: image embeddings, text embeddings, exp(logit_scale))
is one model whose `get_rep_fn` returns a tuple: `loss_fn` receives every representation, model by
model, output by output. A 0-dim output is a per-step value that does not depend on the chunk (a
temperature): the loss sees the first chunk's, its whole gradient flows back through the first
chunk's re-forward and the other chunks backpropagate a zero for it (so every parameter is
reached in every chunk's backward, as DDP's reducer expects).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..batching import split_inputs, take_vlm_chunks, token_chunks, trim_padding
from . import engine
from .engine import Outputs, Replay, as_tuple
from .inputs import GradCacheError, get_rep, model_call
from .rng import RandContext
from .sync import grad_sync

Reps = Tensor | tuple[Tensor, ...]  # one model's representations of a whole input (tuple: several outputs)


def _merge(parts: list[Tensor]) -> Tensor:
    """One output over all chunks: per-sample rows concatenated; a 0-dim value is the first chunk's."""
    return parts[0] if parts[0].dim() == 0 else torch.cat(parts)


def _reorder(reps: Reps, index: Tensor | None) -> Reps:
    """Per-sample rows in the order `index` gives (0-dim values as they are); None: unchanged."""
    if index is None:
        return reps
    out = tuple(t if t.dim() == 0 else t.index_select(0, index.to(t.device)) for t in as_tuple(reps))
    return out[0] if isinstance(reps, Tensor) else out


def _chunk_gradients(
    cached: Reps,
    rows: Sequence[Sequence[int]] | None = None,
) -> Callable[[int, tuple[Tensor | None, ...]], list[Tensor]]:
    """`engine.forward_backward`'s gradients: each chunk's rows of each output's cache; a 0-dim
    output's gradient goes to the first chunk, zero to the others. `rows[i][k]`: chunk i's rows of
    output k (pass 1's outputs), so chunks may come in any order; None: in order, sized by the
    re-forward's outputs."""
    cache = as_tuple(cached)
    if rows is None:
        starts = None
    else:
        starts = [[0] * len(cache), *itertools.accumulate(rows, lambda a, b: [x + y for x, y in zip(a, b)])]
    offsets = [0] * len(cache)

    def gradients(i: int, outputs: tuple[Tensor | None, ...]) -> list[Tensor]:
        grads = []
        for k, grad in enumerate(cache):
            if grad.dim() == 0:
                grads.append(grad if i == 0 else torch.zeros_like(grad))
                continue
            out = outputs[k] if k < len(outputs) else None
            n = len(out) if out is not None and out.dim() else 0
            start = offsets[k] if starts is None else starts[i][k]
            grads.append(grad[start : start + n])
            offsets[k] += n
        return grads

    return gradients


def _rows(outputs: Sequence[Outputs]) -> list[list[int]]:
    """Rows of each output of each chunk (0 for a 0-dim or missing output)."""
    return [[len(o) if o is not None and o.dim() else 0 for o in as_tuple(out)] for out in outputs]


def _per_model(value: int | Sequence[int], models: int, what: str, name: str, minimum: int, must: str) -> list[int]:
    """One integer >= `minimum` per model, from one for all or a sequence (a one-line error otherwise)."""
    values = [value] * models if isinstance(value, int) else list(value)
    if len(values) != models:
        raise GradCacheError(f"{len(values)} {what} for {models} models; give one per model (or one int for all)")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise GradCacheError(f"{name}[{i}]={v!r}: must be {must}")
    return values


class GradCache:
    """Cached-gradient training step for any number of encoders (one input per encoder).

    models: the encoders, in the order of `model_inputs` and of `loss_fn`'s arguments; the same
    module may appear more than once (tied towers). chunk_sizes: one per model (or one for all).
    loss_fn(*reps, **loss_kwargs) -> scalar. split_input_fn(model_input, chunk_size) -> chunks
    (default: `batching.split_inputs`; `batching.split_vlm_inputs` for packed VLM inputs). get_rep_fn(output)
    -> Tensor (default: `get_rep` with `rep_attribute`). fp16 runs forwards under float16 autocast
    and needs `scaler`; `autocast_dtype=torch.bfloat16` runs them under bfloat16 autocast, no scaler.
    sync_context(model, sync) replaces the DDP / FSDP2 detection when the caller owns the wrapper
    (a trainer whose "model" is a function around its DP module).
    get_rep_fn may return a tuple: a model with several outputs (see the module docstring).
    replay=True: the models take a keyword argument `replay`; step 3's re-forward of a chunk passes
    step 1's outputs of that chunk in it (`engine.Replay`, one entry per output of `get_rep_fn`), so
    a part that needs no graph (a locked tower) can return them instead of running again. Step 1
    passes nothing.

    Text inputs (`tokens`): a Mapping input with an `attention_mask`, or with entries that `pad_ids`
    ({key: pad id}) names as right-padded token ids, has each chunk cut to its longest sequence
    (`trim_padding=False`: not). chunk_tokens (one per model or one for all; 0 = chunks of
    `chunk_sizes`): chunks of length-sorted samples, as many as fit that many tokens, padding
    included; the loss sees the representations in batch order, so the loss and the gradients do
    not depend on the sample order. With a token budget every rank of `group` (None: the default
    group, when torch.distributed is initialized) runs as many chunks as the rank with the most.
    """

    def __init__(
        self,
        models: Sequence[nn.Module],
        chunk_sizes: int | Sequence[int],
        loss_fn: Callable[..., Tensor],
        split_input_fn: Callable[[Any, int], list[Any]] | None = None,
        get_rep_fn: Callable[[Any], Tensor] | None = None,
        fp16: bool = False,
        scaler: torch.amp.GradScaler | None = None,
        *,
        autocast_dtype: torch.dtype | None = None,
        rep_attribute: str = "pooler_output",
        sync_context: Callable[[nn.Module, bool], contextlib.AbstractContextManager] | None = None,
        chunk_tokens: int | Sequence[int] = 0,
        pad_ids: Mapping[str, int] | None = None,
        trim_padding: bool = True,
        group: dist.ProcessGroup | None = None,
        replay: bool = False,
    ) -> None:
        self.models = list(models)
        sizes = _per_model(chunk_sizes, len(self.models), "chunk sizes", "chunk_sizes", 1, "an integer >= 1")
        tokens = _per_model(
            chunk_tokens,
            len(self.models),
            "chunk_tokens",
            "chunk_tokens",
            0,
            "0 (chunks of chunk_sizes samples) or an integer >= 1",
        )
        if any(tokens) and split_input_fn is not None:
            raise GradCacheError(
                "chunk_tokens packs batch-major inputs itself; it does not combine with split_input_fn"
            )
        if fp16 and scaler is None:
            raise GradCacheError(
                "fp16=True needs a scaler (torch.amp.GradScaler) to keep float16 gradients from underflowing"
            )
        self.chunk_sizes = sizes
        self.chunk_tokens = tokens
        self.pad_ids = dict(pad_ids or {})
        self.trim_padding = trim_padding
        self.group = group
        self.loss_fn = loss_fn
        self.split_input_fn = split_input_fn
        self.get_rep_fn = get_rep_fn
        self.fp16 = fp16
        self.scaler = scaler
        self.autocast_dtype = torch.float16 if fp16 else autocast_dtype
        self.rep_attribute = rep_attribute
        self.sync_context = sync_context or grad_sync
        self.replay = replay
        self._pass1: dict[int, list] = {}  # id(chunks) -> step 1's per-chunk outputs, until step 3 reads them

    # ------------------------------------------------------------------ the three steps

    def split(self, model_input: Any, chunk_size: int, what: str = "input") -> list[Any]:
        """Chunks of `chunk_size` samples, each cut to its longest sequence."""
        if self.split_input_fn is not None:
            return self._trimmed(self.split_input_fn(model_input, chunk_size))
        return self._trimmed(split_inputs(model_input, chunk_size, what))

    def chunk(self, model_input: Any, index: int) -> tuple[list[Any], Tensor | None]:
        """Model `index`'s chunks of `model_input`, and with a token budget the order of the samples
        in them (chunk rows k = batch rows order[k]); None: batch order."""
        what = f"input {index}"
        if not self.chunk_tokens[index]:
            return self.split(model_input, self.chunk_sizes[index], what), None
        order, sizes = token_chunks(model_input, self.chunk_tokens[index], self.pad_ids, group=self.group, what=what)
        # longest first, the remainder last; the engine keeps the last chunk's graph instead of re-running it,
        # so the chunks go in reverse: the kept one is the first packed (longest sequences, a full budget)
        order, sizes = torch.cat(torch.split(order, sizes)[::-1]), sizes[::-1]
        return self._trimmed(take_vlm_chunks(model_input, order, sizes, what)), order

    def _trimmed(self, chunks: list[Any]) -> list[Any]:
        return [trim_padding(c, self.pad_ids) for c in chunks] if self.trim_padding else chunks

    def _autocast(self, model: nn.Module) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        params = model.parameters() if isinstance(model, nn.Module) else iter(())  # a plain function: no module
        param = next(params, None)
        device = param.device.type if param is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        return torch.autocast(device, dtype=self.autocast_dtype)

    def _rep(self, model: nn.Module, chunk: Any, **kwargs: Any) -> Outputs:
        with self._autocast(model):
            output = model_call(model, chunk, **kwargs)
        return self.get_rep_fn(output) if self.get_rep_fn is not None else get_rep(output, self.rep_attribute)

    def forward_no_grad(
        self,
        model: nn.Module,
        chunks: Sequence[Any],
        *,
        keep_last: Callable[[], contextlib.AbstractContextManager] | None = None,
    ) -> tuple[Reps, list[RandContext | engine.Kept]]:
        """Step 1: representations of all chunks without a graph, and each chunk's RNG state
        (`keep_last`: the last chunk keeps its graph for step 3, `engine.forward_no_grad`)."""
        outputs, states = engine.forward_no_grad(lambda chunk: self._rep(model, chunk), chunks, keep_last=keep_last)
        self._pass1[id(chunks)] = outputs  # step 3: their rows, and with `replay` the re-forward's argument
        if isinstance(outputs[0], Tensor):
            return _merge(outputs), states
        return tuple(_merge([as_tuple(o)[k] for o in outputs]) for k in range(len(outputs[0]))), states

    def build_cache(self, *reps: Tensor, **loss_kwargs: Any) -> tuple[list[Tensor], Tensor]:
        """Step 2: the loss on detached float32 representations and dL/d(rep) for each input."""
        leaves = [r.detach().to(torch.promote_types(r.dtype, torch.float32)).requires_grad_() for r in reps]
        with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
            loss = self.loss_fn(*leaves, **loss_kwargs)
        (self.scaler.scale(loss) if self.fp16 else loss).backward()
        cache = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
        return cache, loss.detach()

    def forward_backward(
        self,
        model: nn.Module,
        chunks: Sequence[Any],
        cached_gradients: Reps,
        random_states: Sequence[RandContext | engine.Kept],
        no_sync_except_last: bool = False,
        sync_on_last: bool = True,
    ) -> None:
        """Step 3: replay each chunk's RNG, forward with a graph, backward of <rep, cached grad>.

        `cached_gradients`: as `forward_no_grad` returned the representations (a tuple for a
        model with several outputs). `sync_on_last=False` keeps even the last chunk unsynced
        (the model is used again later).
        """
        pass1 = self._pass1.pop(id(chunks), None)

        def call(chunk: Any, replay: Replay | None = None) -> Outputs:
            return self._rep(model, chunk) if replay is None else self._rep(model, chunk, replay=replay)

        engine.forward_backward(
            call,
            chunks,
            random_states,
            _chunk_gradients(cached_gradients, None if pass1 is None else _rows(pass1)),
            sync=lambda is_last: self._sync(model, no_sync_except_last, sync_on_last and is_last),
            replay=pass1 if self.replay else None,
        )

    def _sync(self, model: nn.Module, no_sync_except_last: bool, last: bool) -> contextlib.AbstractContextManager:
        return self.sync_context(model, not no_sync_except_last or last)

    def cache_step(self, *model_inputs: Any, no_sync_except_last: bool = False, **loss_kwargs: Any) -> Tensor:
        """Steps 1-3 for one batch: gradients accumulate in .grad; returns the loss (detached)."""
        if len(model_inputs) != len(self.models):
            raise GradCacheError(f"{len(model_inputs)} inputs for {len(self.models)} models; pass one input per model")
        chunks, orders = zip(*(self.chunk(x, i) for i, x in enumerate(model_inputs)))
        if empty := [i for i, c in enumerate(chunks) if not c]:
            raise GradCacheError(
                f"input {empty[0]} is an empty batch (0 samples); a contrastive loss needs at least one pair: skip "
                "empty batches"
            )
        self._pass1.clear()
        # one model: its last chunk keeps its graph (one forward saved, engine.forward_no_grad); with several,
        # kept graphs would be alive together, so each chunk is re-run
        keep = (
            (lambda: self._sync(self.models[0], no_sync_except_last, len(chunks[0]) == 1))
            if len(self.models) == 1
            else None
        )
        reps, states = zip(*(self.forward_no_grad(m, c, keep_last=keep) for m, c in zip(self.models, chunks)))
        # batch order for the loss
        reps = [_reorder(r, None if o is None else torch.argsort(o)) for r, o in zip(reps, orders)]
        widths = [len(as_tuple(r)) for r in reps]  # outputs per model
        cache, loss = self.build_cache(*(t for r in reps for t in as_tuple(r)), **loss_kwargs)
        last_use = {id(m): i for i, m in enumerate(self.models)}  # a tied model syncs after its last use
        for i, (model, model_chunks, model_states) in enumerate(zip(self.models, chunks, states)):
            first = sum(widths[:i])
            grads = _reorder(
                cache[first] if isinstance(reps[i], Tensor) else tuple(cache[first : first + widths[i]]), orders[i]
            )
            self.forward_backward(
                model, model_chunks, grads, model_states, no_sync_except_last, sync_on_last=last_use[id(model)] == i
            )
        return loss
