"""Token-aware chunking for text inputs: each chunk cut to its longest sequence, chunks packed by a
token budget (sentence-transformers' `mini_batch_num_tokens`, over length-sorted samples).

Text towers read right-padded token ids [B, L]: a row's real tokens, then padding. The padding is
masked, so the columns after a chunk's longest sequence change nothing but the compute:
`trim_padding` drops them from every tensor of the input that has those L columns, and the
representations are the untrimmed chunk's up to float rounding. `token_chunks` sorts a batch's
samples by length and cuts them into consecutive chunks of as many samples as fit `chunk_tokens`
(the tokens a trimmed chunk forwards, padding included: samples x its longest sequence, summed
over the padded fields, k times for a field of k sequences per sample; at least one sample), so
short texts go in large chunks, long ones in small chunks, and no chunk forwards much padding.
GradCache gives the loss the samples in their original order (`GradCache.cache_step`).

Where an input's padding is (its "padded fields"); only a Mapping input has any:
- an `attention_mask` [B, L] (Hugging Face's convention) marks the padding of every tensor of the
  mapping with at least 2 dims and L columns (input_ids, token_type_ids, position_ids, the mask);
- `pad_ids` {key: pad id} names right-padded token-id entries that come without a mask, one field
  each (the bi_encoder's `query`, `doc` and `neg`: `BiEncoder.padded_inputs`); [B, k, L] ids (k
  hard negatives per sample) are one field of k sequences per sample.
Anything else (a Tensor, images, the clip family's byte-token captions) has no padded field:
trimming is a no-op and a token budget is an error. A sample's length in a field is its last real
column + 1 (interior padding stays), and left padding is never cut (the last column of a
left-padded batch is real in every row), so no position moves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .inputs import BatchError

__all__ = ["PaddedField", "max_over_ranks", "padded_fields", "right_trimmed", "token_chunks", "trim_padding"]


def max_over_ranks(value: float, group: dist.ProcessGroup | None = None) -> float:
    """The largest `value` over the ranks of `group` (float64: exact for integers below 2^53); this
    rank's own without torch.distributed. On the device the backend needs (CUDA for NCCL).
    (`parallelisms.collectives` names it for the rest of the project: one copy, here, because this
    package imports only torch.)"""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return value
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    t = torch.tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


@dataclass(frozen=True)
class PaddedField:
    keys: tuple[str, ...]
    """The entries cut together (the same L columns)."""
    width: int
    """L: the columns of the field's tensors."""
    lengths: Tensor
    """[B] per sample: its last real column + 1 (0: no real token; the longest of its sequences)."""
    per_sample: int = 1
    """Sequences per sample: 1, or k for token ids [B, k, L] (k hard negatives per sample)."""
    last_dim: bool = False
    """Whether the columns are the tensors' last dimension (token ids) rather than dimension 1."""


def _lengths(real: Tensor) -> Tensor:
    """[B, L] bool (a real token) -> [B] last real column + 1."""
    if real.shape[0] == 0 or real.shape[1] == 0:
        return torch.zeros(real.shape[0], dtype=torch.long, device=real.device)
    return (real.long() * torch.arange(1, real.shape[1] + 1, device=real.device)).amax(dim=1)


def padded_fields(model_input: Any, pad_ids: Mapping[str, int] | None = None) -> list[PaddedField]:
    """The padded fields of `model_input` (see the module docstring); [] for anything else."""
    if not isinstance(model_input, Mapping):
        return []
    fields, taken = [], set()
    mask = model_input.get("attention_mask")
    if isinstance(mask, Tensor) and mask.dim() == 2:
        rows, width = mask.shape
        keys = tuple(
            k for k, v in model_input.items() if isinstance(v, Tensor) and v.dim() >= 2 and v.shape[:2] == (rows, width)
        )
        fields.append(PaddedField(keys, width, _lengths(mask != 0)))
        taken.update(keys)
    for key, pad in (pad_ids or {}).items():
        ids = model_input.get(key)
        if key not in taken and isinstance(ids, Tensor) and ids.dim() == 2:
            fields.append(PaddedField((key,), ids.shape[1], _lengths(ids != pad), last_dim=True))
        elif key not in taken and isinstance(ids, Tensor) and ids.dim() == 3:  # [B, k, L]: k sequences per sample
            lengths = _lengths((ids != pad).flatten(0, 1)).view(ids.shape[0], ids.shape[1])
            fields.append(PaddedField((key,), ids.shape[2], lengths.amax(1), ids.shape[1], last_dim=True))
    return fields


def _kept(lengths: Tensor, width: int) -> int:
    """Columns to keep: the longest sequence (at least one column)."""
    return max(int(lengths.max()), 1) if len(lengths) else width


def right_trimmed(ids: Tensor, pad_id: int) -> Tensor:
    """`ids` [B, L] without its trailing columns that are `pad_id` in every row (one column at least)."""
    return ids[:, : _kept(_lengths(ids != pad_id), ids.shape[1])] if ids.dim() == 2 else ids


def trim_padding(model_input: Any, pad_ids: Mapping[str, int] | None = None) -> Any:
    """`model_input` cut to its longest sequence in each padded field; unchanged without one.
    A Mapping comes back as a dict (a tokenizer's BatchEncoding too)."""
    fields = padded_fields(model_input, pad_ids)
    cuts = {key: (keep, f.last_dim) for f in fields if (keep := _kept(f.lengths, f.width)) < f.width for key in f.keys}
    if not cuts:
        return model_input
    return {
        k: v if k not in cuts else (v[..., : cuts[k][0]] if cuts[k][1] else v[:, : cuts[k][0]])
        for k, v in model_input.items()
    }


def token_chunks(
    model_input: Any,
    chunk_tokens: int,
    pad_ids: Mapping[str, int] | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    what: str = "input",
) -> tuple[Tensor, list[int]]:
    """(order, sizes): the samples of `model_input`, longest first (ties in batch order), and
    consecutive chunk sizes over that order; each chunk as many samples as fit `chunk_tokens`
    (samples x the chunk's longest sequence, summed over the padded fields; at least one sample).

    `group`: the ranks that must run as many chunks as each other, because every forward holds a
    collective (FSDP2 gathers parameters, DDP broadcasts buffers); a rank with fewer than the most
    splits its largest chunks in two (under budget still). None: the default group when
    torch.distributed is initialized.
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise BatchError(f"chunk_tokens={chunk_tokens!r} for {what}: must be an integer >= 1")
    fields = padded_fields(model_input, pad_ids)
    if not fields:
        keys = list(model_input) if isinstance(model_input, Mapping) else type(model_input).__name__
        raise BatchError(
            f"{what} has no padded token field ({keys}); a token budget needs an attention_mask or "
            f"pad_ids naming its right-padded token ids (now {dict(pad_ids or {})})"
        )
    lengths = torch.stack([f.lengths for f in fields], dim=1).cpu()  # [B, fields]
    per_sample = [f.per_sample for f in fields]
    order = torch.sort((lengths * torch.tensor(per_sample)).sum(1), descending=True, stable=True).indices
    rows = lengths[order].tolist()
    sizes: list[int] = []
    start = 0
    while start < len(rows):
        longest, n = rows[start], 1
        while start + n < len(rows):
            wider = [max(a, b) for a, b in zip(longest, rows[start + n])]
            if sum(w * m for w, m in zip(wider, per_sample)) * (n + 1) > chunk_tokens:
                break
            longest, n = wider, n + 1
        sizes.append(n)
        start += n
    most = int(max_over_ranks(len(sizes), group))
    while len(sizes) < most:  # a sub-chunk of a chunk is under budget too
        i = max(range(len(sizes)), key=sizes.__getitem__)
        if sizes[i] < 2:
            raise BatchError(
                f"{what}: {len(rows)} samples cannot make the {most} chunks another rank runs; "
                "give every rank the same number of samples"
            )
        sizes[i : i + 1] = [sizes[i] - sizes[i] // 2, sizes[i] // 2]
    return order, sizes
