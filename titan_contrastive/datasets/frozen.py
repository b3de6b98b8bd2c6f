"""A frozen model's embeddings computed once and carried in the data (`[loss] teacher_embeddings`,
`guide_embeddings`): the teacher or guide of a run whose texts are embedded ahead of training, by
`python -m titan_contrastive.embed` or by anything else (an embedding API, another framework), so no
frozen model runs during the steps.

The file is `.parquet` or `.jsonl`, one text per row: `text`, `embedding` (a list of numbers, the
same length on every row) and optionally `side` (`query` or `document`). With sides, a row's query is
looked up as ("query", text) and its positive and negatives as ("document", text), so a teacher that
embeds queries with an instruction keeps both of its embeddings of a text; without, one embedding per
text serves either side. Texts are matched after stripping surrounding whitespace, as the pairs reader
strips them (`datasets/pairs.py`), and without the run's own prompts (`data.query_prompts`).

The table is read once (float32, [T, d]; where each text's row is: `text_index.TextIndex`, arrays that forked data
workers share untouched); each row of the training data keeps the indices of its
1 + 1 + k texts, and a batch serves `frozen_query` [B, d] and `frozen_doc` [B, d] or [B, 1 + k, d]
(`batching.FROZEN_QUERIES`, `FROZEN_DOCS`), which the step normalizes and gathers over the ranks as a
guide model's embeddings (`StepContext.guide_of`, `losses/guide.py`). A text of the data without an
embedding, a row of another width, a non-finite or zero vector, an unknown side, or one
text with two different embeddings is a DataError naming the file, before any model is built.

Image-text data (`python -m titan_contrastive.embed_images`) reads a file whose sides are `image`, the row's
`text` being the image's key (`datasets.image_keys`), and `caption`; the datasets look each sample up as it is
served (`FileImageTextDataset.carry_frozen`, `ImageTextDataset.carry_frozen`). Image keys `key#v` are the image's
stored train view v (`embed_images --views`, `EmbeddingTable.views`), which a training sample is then served.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.text_index import TextIndex

FORMATS = (".parquet", ".jsonl")
SIDES = ("query", "document")
IMAGE_TEXT_SIDES = ("image", "caption")
"""An image-text file's sides: an image row's `text` is its key (`image_key`), a caption row's the caption."""
TEACHER_LOGIT_SCALE = "teacher_logit_scale"
"""The .parquet schema metadata key of the teacher's own logit scale (its temperature is 1 / exp of it)."""
EMBED_IMAGES = "python -m titan_contrastive.embed_images --out FILE.parquet --job.config_file RUN.toml"


@dataclass(frozen=True)
class EmbeddingTable:
    """The file's embeddings `vectors` [T, d] and where each text's is: `index` finds (side, text), or
    ("", text) for a file without sides, in its rows (`text_index.TextIndex`)."""

    vectors: torch.Tensor
    index: TextIndex
    sided: bool
    source: str
    logit_scale: float | None = None
    """The teacher's own logit scale, where the file keeps it (`embed_images`' .parquet, `TEACHER_LOGIT_SCALE`)."""
    views: int = 0
    """The stored views of each image (`embed_images --views`: image rows `view_key(key, v)`, v < views); 0: one,
    the evaluation view."""

    @classmethod
    def read(cls, path: str, key: str) -> EmbeddingTable:
        """The table of `path` (named by the config `key` in errors)."""
        file = Path(path).expanduser()
        if file.suffix not in FORMATS or not file.is_file():
            raise DataError(
                f"{key}={path}: not an existing {'/'.join(FORMATS)} file; write one with "
                "python -m titan_contrastive.embed PAIRS --model TEACHER --out FILE.parquet"
            )
        try:
            texts, sides, vectors = _read_parquet(file) if file.suffix == ".parquet" else _read_jsonl(file)
        except DataError as e:  # the file's own problem, named with the key
            raise DataError(f"{key}={path}: {e}") from None
        except Exception as e:  # noqa: BLE001 - pyarrow's and json's errors for a damaged file
            raise DataError(f"{key}={path}: not a readable {file.suffix[1:]} file ({type(e).__name__}: {e})") from None
        table = cls._checked(f"{key}={path}", texts, sides, vectors)
        return (
            dataclasses.replace(table, logit_scale=_logit_scale(file, table.source))
            if file.suffix == ".parquet"
            else table
        )

    @classmethod
    def _checked(cls, source: str, texts: list[Any], sides: list[Any] | None, vectors: torch.Tensor) -> EmbeddingTable:
        if not len(texts):
            raise DataError(f"{source}: no rows; give one row per text (text, embedding[, side])")
        bad = ~torch.isfinite(vectors).all(1) | (vectors.abs().sum(1) == 0)
        if bad.any():
            raise DataError(
                f"{source}: row {int(bad.nonzero()[0])}'s embedding is zero or not finite; a cosine needs a finite, "
                "non-zero vector"
            )
        views = 0
        keys: list[tuple[str, str]] = []
        for row, text in enumerate(texts):
            side = "" if sides is None else sides[row]
            if side not in ("", *SIDES, *IMAGE_TEXT_SIDES) or (sides is not None and not side):
                raise DataError(
                    f"{source}: row {row}'s side is {side!r}; use query or document (or no side column), or image "
                    "and caption for image-text data"
                )
            if not isinstance(text, str) or not text.strip():
                raise DataError(f"{source}: row {row}'s text is {text!r}; give the text the embedding is of")
            if side == "image" and "#" in text:
                views = max(views, _view_of(source, row, text) + 1)
            keys.append((side, text.strip()))
        index, later, first = TextIndex.of(keys)
        differ = (vectors[torch.from_numpy(later)] != vectors[torch.from_numpy(first)]).any(1).nonzero()
        if len(differ):
            at = int(differ[0])
            side, text = keys[later[at]]
            raise DataError(
                f"{source}: rows {first[at]} and {later[at]} give {side + ' ' if side else ''}text {text[:60]!r} "
                "two different embeddings; keep one"
            )
        return cls(vectors, index, sides is not None, source, views=views)

    @property
    def dim(self) -> int:
        return self.vectors.shape[1]

    def check_image_text(self) -> None:
        """A DataError unless the file has image and caption rows (what image-text data looks up)."""
        if not set(IMAGE_TEXT_SIDES) <= self.index.sides:
            has = ", ".join(sorted(side or "none" for side in self.index.sides))
            raise DataError(
                f"{self.source}: no image and caption rows (its sides: {has}); "
                f"image-text data looks up each image and caption: write the file with {EMBED_IMAGES}"
            )

    def lookup(self, side: str, keys: Sequence[str], where: Sequence[str] = ()) -> torch.Tensor:
        """int64 [len(keys)]: the rows of the `side` embeddings of `keys` (image keys or caption texts); a DataError
        naming the first missing one (`where`: each key's sample, for the message)."""
        rows = self.index.find([(side, key.strip()) for key in keys])
        missing = np.flatnonzero(rows < 0)
        if len(missing):
            at = int(missing[0])
            sample = f" (sample {where[at]})" if where else ""
            raise DataError(
                f"{self.source}: no {side} embedding of {len(missing)} of the data's {side}s, e.g. "
                f"{keys[at][:60]!r}{sample}; embed the run's own data: {EMBED_IMAGES}"
            )
        return torch.from_numpy(rows)

    def row(self, side: str, text: str) -> int:
        """The row of one `side` text (`""` in a file without sides), -1 where the file has none."""
        return int(self.index.find([(side, text.strip())])[0])

    def find(self, queries: Sequence[str], documents: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 [len(queries)], [len(documents)]: the rows of the table holding each text of the data's queries
        and documents; a DataError naming the first missing one."""
        named = [("query", text) for text in queries] + [("document", text) for text in documents]
        found = self.index.find([(side if self.sided else "", text.strip()) for side, text in named])
        missing = np.flatnonzero(found < 0)
        if len(missing):
            side, text = named[missing[0]]
            raise DataError(
                f"{self.source}: no embedding of {len(missing)} text(s) of the training data, e.g. {side} "
                f"{text[:60]!r}; embed the same rows (python -m titan_contrastive.embed with data.path's file)"
            )
        found = torch.from_numpy(found)
        return found[: len(queries)], found[len(queries) :]


def _view_of(source: str, row: int, text: str) -> int:
    """The view number of an image row keyed `view_key(key, v)`, or a DataError."""
    view = text.strip().rsplit("#", 1)[1]
    if not view.isdigit():
        raise DataError(
            f"{source}: row {row}'s image key is {text[:60]!r}; a view's key is the image's key, '#' and the view's "
            f"number (written by {EMBED_IMAGES} --views K)"
        )
    return int(view)


def _logit_scale(file: Path, source: str) -> float | None:
    """The teacher's logit scale a .parquet file keeps in its schema's metadata, or None."""
    import pyarrow.parquet as pq

    value = (pq.read_schema(file).metadata or {}).get(TEACHER_LOGIT_SCALE.encode())
    if value is None:
        return None
    try:
        scale = float(value)
    except ValueError:
        scale = math.nan
    if not math.isfinite(scale):
        raise DataError(f"{source}: its {TEACHER_LOGIT_SCALE} metadata is {value!r}; give a finite number, or drop it")
    return scale


def _read_parquet(file: Path) -> tuple[list[Any], list[Any] | None, torch.Tensor]:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(file)
    _check_names(table.column_names)
    column = table.column("embedding").combine_chunks()
    if not hasattr(column, "flatten") or pc.any(pc.is_null(column)).as_py():
        raise DataError(f"its embedding column holds {column.type}; give a list of numbers per row")
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    values = column.flatten().to_numpy(zero_copy_only=False)
    sides = table.column("side").to_pylist() if "side" in table.column_names else None
    return table.column("text").to_pylist(), sides, _stacked(lengths, values)


def _read_jsonl(file: Path) -> tuple[list[Any], list[Any] | None, torch.Tensor]:
    records = [json.loads(line) for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not records:
        return [], None, torch.zeros(0, 1)
    if not all(isinstance(r, dict) for r in records):
        raise DataError("every line must be a JSON object (text, embedding[, side])")
    names = list(records[0]) if records else []
    _check_names(names)
    sided = "side" in names
    vectors = [r.get("embedding") for r in records]
    if not all(isinstance(v, list) and all(isinstance(x, (int, float)) for x in v) for v in vectors):
        raise DataError("an embedding that is not a list of numbers; give one per line")
    lengths = [len(v) for v in vectors]
    values = [x for v in vectors for x in v]
    texts = [r.get("text") for r in records]
    return texts, [r.get("side") for r in records] if sided else None, _stacked(lengths, values)


def _check_names(names: Sequence[str]) -> None:
    if "text" not in names or "embedding" not in names:
        raise DataError(
            f"columns {', '.join(names) or 'none'}; the embeddings file needs text and embedding (and optionally side)"
        )


def _stacked(lengths: Sequence[int], values: Any) -> torch.Tensor:
    """[T, d] float32 of the flat `values` of rows of `lengths`, which must all be one d >= 1."""
    widths = sorted({int(n) for n in lengths})
    if not widths:
        return torch.zeros(0, 1)
    if len(widths) != 1 or widths[0] < 1:
        raise DataError(
            f"embeddings of {', '.join(map(str, widths[:4]))} numbers; every row's must have the same length"
        )
    return torch.from_numpy(np.array(values, dtype=np.float32)).view(len(lengths), widths[0])
