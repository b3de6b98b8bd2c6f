"""What `benchmarks.qwen_vl_chunks` measures of each GradCache chunk: the tokens it forwards (text and
visual, after trimming) and the activation bytes it saves for its backward (`ChunkProbe`, with
`torch.autograd.graph.saved_tensors_hooks`)."""

from __future__ import annotations

import statistics
from typing import Any

MERGE = 2  # Qwen2-VL merges 2 x 2 patches into one visual token
PAD = -1  # the qwen_vl family's pad id in its token ids
CHUNK_FIELDS = ("samples", "tokens", "real_tokens", "visual_tokens", "patches", "saved_mib")


class ChunkProbe:
    """Wraps a trainer's `step_context.encode` (the model's forward on one chunk, or on the whole
    batch in the plain step): per forward with gradients, the chunk's token counts and the bytes it
    saves for its backward (module docstring). `chunks` holds the records since the last `clear`."""

    def __init__(self, trainer: Any) -> None:
        import torch

        ctx = trainer.step_context
        self.inner = ctx.encode
        model = trainer.model
        self.held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        self.image_token_id = getattr(getattr(model, "tower", None), "config", None)
        self.image_token_id = getattr(self.image_token_id, "image_token_id", None)
        self.chunks: list[dict[str, Any]] = []
        self._torch = torch
        ctx.encode = self  # an instance attribute: the steps call ctx.encode(batch, replay=...)

    def clear(self) -> None:
        self.chunks = []

    def __call__(self, batch: dict[str, Any], replay: Any = None) -> Any:
        torch = self._torch
        if not torch.is_grad_enabled():
            return self.inner(batch, replay=replay)
        inputs = {t.untyped_storage().data_ptr() for t in batch.values() if isinstance(t, torch.Tensor)}
        saved: dict[Any, int] = {}

        def pack(t: Any) -> Any:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in self.held:
                return t
            if ptr in inputs:  # a view of the chunk's own input (the batch's storage): its own bytes
                saved[(ptr, t.storage_offset(), tuple(t.shape))] = t.numel() * t.element_size()
            else:
                saved[ptr] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self.inner(batch, replay=replay)
        self.chunks.append({**chunk_tokens(batch), "saved_mib": sum(saved.values()) / 2**20})
        return out


def is_grid(key: str) -> bool:
    """A batch entry of image grids [images, 3]: `image_grid_thw`, or a side's (`doc_image_grid_thw`)."""
    return key.endswith("image_grid_thw")


def is_packed(key: str) -> bool:
    """A packed image entry (patches or grids), whose rows are not samples."""
    return is_grid(key) or key.endswith("pixel_values")


def image_grids(batch: dict[str, Any]) -> Any:
    """Every image's (t, h, w) in the batch, of both sides, [images, 3]."""
    import torch

    grids = [v.long().reshape(-1, 3) for k, v in batch.items() if is_grid(k)]
    return torch.cat(grids) if grids else torch.zeros(0, 3, dtype=torch.long)


def _trimmed_width(ids: Any) -> int:
    """Columns of right-padded ids [B, L] after cutting the columns that are padding in every row."""
    real = (ids != PAD).any(0).nonzero()
    return int(real.max()) + 1 if len(real) else 1


def chunk_tokens(batch: dict[str, Any]) -> dict[str, int]:
    """A chunk's samples; tokens forwarded (query + document ids, each cut to its longest row, padding
    included: what `[gradcache] chunk_tokens` counts); real (non-pad) tokens; visual tokens and patches."""
    query, doc = batch["query"], batch["doc"]
    n = len(query)
    patches = int(image_grids(batch).prod(-1).sum())
    return {
        "samples": n,
        "tokens": n * (_trimmed_width(query) + _trimmed_width(doc)),
        "real_tokens": int((query != PAD).sum() + (doc != PAD).sum()),
        "visual_tokens": patches // MERGE**2,
        "patches": patches,
    }


def describe_chunks(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """min / median / max of the per-chunk records, the spread of the saved bytes (max / min, and max /
    mean: how far the largest chunk is above an even split of the same bytes), their sum."""
    out: dict[str, Any] = {"chunks": len(chunks), "samples_per_chunk": [c["samples"] for c in chunks]}
    for key in ("tokens", "visual_tokens", "saved_mib"):
        values = [c[key] for c in chunks]
        out |= {f"{key}_min": min(values), f"{key}_median": statistics.median(values), f"{key}_max": max(values)}
    out["saved_spread"] = out["saved_mib_max"] / out["saved_mib_min"] if out["saved_mib_min"] else None
    out["saved_mib_total"] = sum(c["saved_mib"] for c in chunks)
    out["saved_max_over_mean"] = out["saved_mib_max"] * len(chunks) / out["saved_mib_total"]
    return out


def same_chunks(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    key = lambda cs: sorted(tuple(c[k] for k in CHUNK_FIELDS[:-1]) + (round(c["saved_mib"], 6),) for c in cs)  # noqa: E731
    return key(a) == key(b)


# ---------------------------------------------------------------- CPU mode: the variants side by side
