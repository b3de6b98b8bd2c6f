"""MMEB evaluation as VLM2Vec scores it (`eval.py`): each query against its own candidates, a hit where its best
scored candidate is the right one, the first (ties to the first, as `argmax`); the fraction of hits is the set's
`hit@1` (MMEB's "accuracy", precision@1). Each set's distinct queries and candidates (`datasets/mmeb_sets.py`) are
embedded once across the ranks (`beir_eval.embed_texts`: contiguous shards, every rank the same number of batches,
as an FSDP2 forward needs), each side in the set's mode through the run's side processor (qwen_vl's `SideProcessor`:
its templates for the mode's kinds, the images at their own sizes), then scored by the dot product of the unit
vectors. Used by the trainer (`[eval] mmeb_path`) and by `python -m titan_contrastive.evaluate --mmeb`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from titan_contrastive.components.beir_eval import embed_texts
from titan_contrastive.components.evaluate import dim_cuts
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.image_transforms import decode_image
from titan_contrastive.datasets.mmeb_sets import Item, MmebSet
from titan_contrastive.datasets.retrieval import side_kinds
from titan_contrastive.datasets.tar_shards import read_regular
from titan_contrastive.losses import matryoshka

__all__ = ["evaluate_mmeb", "hits", "mode_embedders"]

Embed = Callable[[list[Item]], torch.Tensor]


def mode_embedders(forward: Callable[[dict[str, torch.Tensor]], Any], process: Any, mode: str) -> tuple[Embed, Embed]:
    """(embed queries, embed candidates) of retrieval mode `mode`, each a list of (text, image path) items, through
    `process.sides` (the other side one placeholder row: a blank image, a word, or both, as `side_embedders`)."""
    kinds = side_kinds(mode)
    filler: Item = ("query", "")

    def side(items: list[Item], kind: str) -> tuple[list[np.ndarray] | None, list[str] | None]:
        images = [_image(path) if path else _BLANK for _, path in items] if kind != "text" else None
        return images, [text for text, _ in items] if kind != "image" else None

    def batch(queries: list[Item] | None, docs: list[Item] | None) -> dict[str, torch.Tensor]:
        query = side(queries or [filler], kinds["query"])
        doc = side(docs or [filler], kinds["doc"])
        return process.sides(*query, *doc, mode=mode)

    return (lambda items: forward(batch(items, None))[0]), (lambda items: forward(batch(None, items))[1])


_BLANK = np.full((64, 64, 3), 255, dtype=np.uint8)
"""The placeholder image of a side not being embedded."""


def _image(path: str) -> np.ndarray:
    try:
        return np.asarray(decode_image(read_regular(path)))
    except (OSError, ValueError, SyntaxError) as e:
        raise DataError(f"MMEB image {path!r} does not read ({type(e).__name__}: {e}); fix or drop its row") from None


def hits(queries: torch.Tensor, candidates: torch.Tensor, rows: Sequence[tuple[int, Sequence[int]]]) -> list[bool]:
    """Per row (its query's index, its candidates' indices, the right one first): whether the query scores its first
    candidate highest (the first of equal scores wins)."""
    return [bool((candidates[torch.as_tensor(own, dtype=torch.long)] @ queries[q]).argmax() == 0) for q, own in rows]


def evaluate_mmeb(
    sets: dict[str, MmebSet],
    embedders: Callable[[str], tuple[Embed, Embed]],
    *,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    dims: Sequence[int] = (),
    prefix: str = "mmeb/",
) -> dict[str, float]:
    """Each set's `hit@1` (`{prefix}hit@1` for one set; `{prefix}{name}/hit@1` for each of several, and
    `{prefix}hit@1` their mean, as MMEB averages its tasks) and its row count; with `dims`, also of the embeddings cut
    to their first m dims and normalized again (`dim{m}/...`, `evaluate.dim_cuts`). `embedders(mode)`:
    `mode_embedders`."""
    out: dict[str, float] = {}
    each: dict[str, list[float]] = {}
    for name, task in sets.items():
        embed_queries, embed_candidates = embedders(task.mode)
        sizes = {"batch_size": batch_size, "rank": rank, "world_size": world_size}
        queries = embed_texts(embed_queries, task.queries, **sizes)
        candidates = embed_texts(embed_candidates, task.candidates, **sizes)
        key = prefix if len(sets) == 1 else f"{prefix}{name}/"
        out[f"{key}num_queries"] = float(len(task.rows))
        for m, cut in dim_cuts(queries.shape[-1], dims):
            q, c = (matryoshka.prefix(x, m) if cut else x for x in (queries, candidates))
            out[f"{cut}{key}hit@1"] = score = float(np.mean(hits(q, c, task.rows)))
            each.setdefault(cut, []).append(score)
    if len(sets) > 1:
        out |= {f"{cut}{prefix}hit@1": float(np.mean(scores)) for cut, scores in each.items()}
    return out
