"""The queries and documents of vl_pairs rows as a frozen model's embeddings written ahead key them
(`python -m titan_contrastive.embed_images` on vl_pairs data, then `[loss] teacher_embeddings`, `datasets/frozen.py`).

A side's item is its template filled with the row's text and image, as the processor fills it (`qwen_vl.processor`);
its key (`item_key`) is that string with the image's key (the SHA-1 of its file's bytes, `image_keys.image_key`) where
the visual tokens go and the text uncut. The file's `query` rows hold the queries, its `document` rows the documents
and every hard negative of every row (whichever an epoch draws). So a file serves any copy of the rows, in any order,
split or joined with others, and a template changed since the file was written is a missing key, not a stale vector.
Image-text data served through the processor (csv, webdataset, hf in the qwen_vl family) keys its samples the same
way (`image_text_keys`): the image on the mode's image side, the caption on the other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from titan_contrastive.batching import FROZEN_DOCS, FROZEN_QUERIES

__all__ = ["FILE_SIDES", "Item", "ItemChunks", "carried", "image_text_keys", "item_key", "side_key"]

FILE_SIDES = {"query": "query", "doc": "document"}
"""A vl_pairs side -> the side of its items in the file."""


def item_key(template: str, text: str, image: str = "") -> str:
    """The key of the item `template` fills with `text` and the image keyed `image` ("": none)."""
    return template.replace("{image}", f"<image {image}>").replace("{text}", text)


def side_key(kind: str, template: str, text: str, image: str) -> str:
    """The key of a side's item of `kind` (text, image or multi, `retrieval.MODES`): what it reads of `text` and the
    image keyed `image`."""
    return item_key(template, text if kind != "image" else "", image if kind != "text" else "")


def image_text_keys(
    kinds: Mapping[str, str], templates: Mapping[str, str], image: str, caption: str, negatives: Sequence[str] = ()
) -> tuple[str, str, list[str]]:
    """(query key, document key, the negative captions' keys) of an image-text sample served through the processor
    (`kinds` and `templates` of "query" and "doc": the image on the mode's image side, the caption on the other; the
    negative captions are text documents)."""
    query, doc = (side_key(kinds[side], templates[side], caption, image) for side in ("query", "doc"))
    return query, doc, [side_key("text", templates["doc"], text, "") for text in negatives]


def carried(
    table: Any, queries: Sequence[str], documents: Sequence[Sequence[str]], where: Sequence[str]
) -> dict[str, torch.Tensor]:
    """`frozen_query` [B, d] and `frozen_doc` [B, d], or [B, 1 + k, d] with hard negatives, of B samples from `table`
    (`frozen.EmbeddingTable`): each sample's query key, and its document's key followed by its k negatives' keys
    (`documents`, B lists of 1 + k); `where` names each sample in a missing key's message."""
    k = len(documents[0]) - 1 if documents else 0
    found = table.lookup("document", [d for docs in documents for d in docs], [w for w in where for _ in range(1 + k)])
    docs = table.vectors[found].view(len(documents), 1 + k, -1)
    return {
        FROZEN_QUERIES: table.vectors[table.lookup("query", queries, where)],
        FROZEN_DOCS: docs if k else docs[:, 0],
    }


class Item(NamedTuple):
    """One side's item of a row, as written: its template and, as its side's kind reads them, its text and its image's
    path ("" for what the side does not read)."""

    source: int
    """The `::`-joined file of the row (its folder roots the image's path)."""
    template: str
    text: str
    image: str


class ItemChunks(torch.utils.data.Dataset):
    """One side's `items` in chunks of `size`: each chunk's processor inputs and keys (`VLPairsDataset.item_inputs`),
    for a loader's workers."""

    def __init__(self, data: Any, side: str, items: Sequence[Item], size: int) -> None:
        self.data, self.side, self.items, self.size = data, side, items, size

    def __len__(self) -> int:
        return -(-len(self.items) // self.size)

    def __getitem__(self, chunk: int) -> tuple[dict[str, torch.Tensor], list[str]]:
        return self.data.item_inputs(self.side, self.items[chunk * self.size : (chunk + 1) * self.size])
