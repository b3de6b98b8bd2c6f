"""A frozen model's embeddings computed once and carried in the data (`[loss] teacher_embeddings`,
`guide_embeddings`): the teacher or guide of a run whose texts are embedded ahead of training, by
`python -m titan_contrastive.embed` or by anything else (an embedding API, another framework), so no
frozen model runs during the steps.

The file is `.parquet`, `.jsonl` or `.arrow` (an Arrow IPC file, Feather v2), one text per row: `text`, `embedding` (a
list of numbers, the same length on every row) and optionally `side` (`query` or `document`). With sides, a row's query
is looked up as ("query", text) and its positive and negatives as ("document", text), so a teacher that embeds queries
with an instruction keeps both of its embeddings of a text; without, one embedding per text serves either side. Texts
are matched after stripping surrounding whitespace, as the pairs reader strips them (`datasets/pairs.py`), and without
the run's own prompts (`data.query_prompts`).

The table is read once (`Vectors`, float32 [T, d]; where each text's row is: `text_index.TextIndex`, arrays that
forked data workers share untouched, mapped from the index written beside a .parquet or .arrow file where it has one,
`frozen_index`, else built from the file). An uncompressed .arrow file of float32 lists is not read into memory but
mapped: every rank and data worker of a machine reads the same pages of it, one copy of the vectors per machine at any
scale (the others: one per rank). Each row of the training data keeps the indices of its
1 + 1 + k texts, and a batch serves `frozen_query` [B, d] and `frozen_doc` [B, d] or [B, 1 + k, d]
(`batching.FROZEN_QUERIES`, `FROZEN_DOCS`), which the step normalizes and gathers over the ranks as a
guide model's embeddings (`StepContext.guide_of`, `losses/guide.py`). A text of the data without an
embedding, a row of another width, a non-finite or zero vector, an unknown side, or one
text with two different embeddings is a DataError naming the file, before any model is built.

vl_pairs rows, and image-text data served through the qwen_vl processor, read a file (`embed_images` too) whose
`query` and `document` rows are keyed by their items' filled templates (`vl_items`), looked up as each sample is
served (`VLPairsDataset.carry_frozen`, `FileImageTextDataset.carry_frozen`).
Image-text data (`python -m titan_contrastive.embed_images`) reads a file whose sides are `image`, the row's
`text` being the image's key (`datasets.image_keys`), and `caption`; the datasets look each sample up as it is
served (`FileImageTextDataset.carry_frozen`, `ImageTextDataset.carry_frozen`). Image keys `key#v` are the image's
stored train view v (`embed_images --views`, `EmbeddingTable.views`), which a training sample is then served.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from titan_contrastive.datasets import frozen_index
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.text_index import TextIndex, digests

logger = logging.getLogger("titan_contrastive")

FORMATS = (".parquet", ".jsonl", ".arrow")
SIDES = ("query", "document")
IMAGE_TEXT_SIDES = ("image", "caption")
"""An image-text file's sides: an image row's `text` is its key (`image_key`), a caption row's the caption."""
TEACHER_LOGIT_SCALE = "teacher_logit_scale"
"""The .parquet / .arrow schema metadata key of the teacher's own logit scale (its temperature is 1 / exp of it)."""
EMBED_IMAGES = "python -m titan_contrastive.embed_images --out FILE.parquet --job.config_file RUN.toml"
BUNDLED_PROCESSED = (
    "the bundled sets served through a model's processor (the qwen_vl family) resize each image to a size drawn per "
    "epoch, so no one embedding of it can be written ahead; use your own image-text data (csv, webdataset, hf) or "
    "vl_pairs rows"
)
"""Why the bundled sets in the qwen_vl family are refused a file (`embed_images` and the run)."""
INDEX_HINT_ROWS = 1 << 20
"""A file of this many rows or more, read without its index (`frozen_index`), is named with the command writing it."""
PART_ROWS = 1 << 16
"""Rows of an Arrow file's record batch made Python strs at a time, while the index is built (`Part`)."""
Part = tuple[list[Any], "list[Any] | None"]
"""A part of a file's rows: their texts and their sides (None: the file has no side column)."""


class Vectors:
    """A table's embeddings [T, d] (float32) in row chunks: one held in memory (.jsonl), a .parquet file's row
    groups, or an .arrow file's record batches mapped from the file, whose pages the operating system keeps once
    per machine for every rank and data worker that reads them."""

    def __init__(self, chunks: Sequence[torch.Tensor], within: tuple[int, int] = (0, 0)) -> None:
        self.chunks = [c for c in chunks if len(c)]
        self.starts = np.cumsum([0, *(len(c) for c in self.chunks)])
        self.mapped = bool(self.chunks) and all(within[0] <= c.data_ptr() < within[1] for c in self.chunks)
        """Every chunk lies in the memory map `within` (start and end addresses): read from the file's pages."""

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def dim(self) -> int:
        return self.chunks[0].shape[1]

    def __getitem__(self, rows: torch.Tensor | int) -> torch.Tensor:
        """float32 [*rows.shape, d]: a copy of the rows at `rows` (int64 of any shape, or an int)."""
        rows = torch.as_tensor(rows, dtype=torch.int64)
        flat = rows.reshape(-1)
        if len(self.chunks) == 1:
            return self.chunks[0].index_select(0, flat).view(*rows.shape, self.dim)
        which = np.searchsorted(self.starts, flat.numpy(), side="right") - 1
        out = torch.empty(len(flat), self.dim)
        for c in np.unique(which):
            at = torch.from_numpy(np.flatnonzero(which == c))
            out[at] = self.chunks[c].index_select(0, flat[at] - int(self.starts[c]))
        return out.view(*rows.shape, self.dim)

    def blocks(self, size: int = 1 << 16) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, rows) at most `size` rows at a time."""
        for start, chunk in zip(self.starts.tolist(), self.chunks):
            for s in range(0, len(chunk), size):
                yield start + s, chunk[s : s + size]


@dataclass(frozen=True)
class EmbeddingTable:
    """The file's embeddings `vectors` [T, d] and where each text's is: `index` finds (side, text), or
    ("", text) for a file without sides, in its rows (`text_index.TextIndex`)."""

    vectors: Vectors
    index: TextIndex
    sided: bool
    source: str
    logit_scale: float | None = None
    """The teacher's own logit scale, where the file keeps it (`embed_images`' .parquet, `TEACHER_LOGIT_SCALE`)."""
    views: int = 0
    """The stored views of each image (`embed_images --views`: image rows `view_key(key, v)`, v < views); 0: one,
    the evaluation view."""

    @classmethod
    def read(cls, path: str, key: str, indexed: bool = True) -> EmbeddingTable:
        """The table of `path` (named by the config `key` in errors), with its index where a .parquet or .arrow file
        has one (`frozen_index`: neither its keys hashed nor its vectors checked again); `indexed=False`: the file
        read and checked whole, its index left aside."""
        file = Path(path).expanduser()
        if file.suffix not in FORMATS or not file.is_file():
            raise DataError(
                f"{key}={path}: not an existing {'/'.join(FORMATS)} file; write one with "
                "python -m titan_contrastive.embed PAIRS --model TEACHER --out FILE.parquet"
            )
        source = f"{key}={path}"
        try:
            if file.suffix == ".jsonl":
                parts, vectors, metadata = _read_jsonl(file)
            else:
                parts, vectors, metadata = _read_arrow_table(file)
            saved = frozen_index.load(file) if indexed and file.suffix != ".jsonl" else None
        except DataError as e:  # the file's own problem, named with the key
            raise DataError(f"{source}: {e}") from None
        except Exception as e:  # noqa: BLE001 - pyarrow's and json's errors for a damaged file
            raise DataError(f"{source}: not a readable {file.suffix[1:]} file ({type(e).__name__}: {e})") from None
        if saved is None:
            table = cls._checked(source, parts, vectors)
            if indexed and len(vectors) >= INDEX_HINT_ROWS and file.suffix != ".jsonl":
                logger.warning(
                    f"warning: {source}: every process hashed its {len(vectors)} keys, as it has no index; write its "
                    f"index once: {frozen_index.INDEX_COMMAND} {path}"
                )
        elif (saved.rows, saved.dim) != (len(vectors), vectors.dim):
            raise DataError(
                f"{source}: its index {frozen_index.index_path(file)} names {saved.rows} rows of {saved.dim} numbers "
                f"where the file has {len(vectors)} of {vectors.dim}; delete the index, or write it again: "
                f"{frozen_index.INDEX_COMMAND} {path}"
            )
        else:
            table = cls(vectors, saved.index, saved.sided, source, views=saved.views)
        if file.suffix != ".jsonl":  # pages pyarrow decoded or decompressed the file through, back to the system
            import pyarrow as pa

            pa.default_memory_pool().release_unused()
        if file.suffix == ".arrow" and not vectors.mapped:
            logger.warning(
                f"warning: {source}: its vectors are held in this process's memory, not mapped from the file (they "
                "are compressed, not float32, or hold nulls); write it uncompressed with float32 lists "
                "(python -m titan_contrastive.embed --out FILE.arrow) so that every process of the machine reads one "
                "copy"
            )
        return dataclasses.replace(table, logit_scale=_logit_scale(metadata, source))

    @classmethod
    def of_rows(cls, source: str, sides: Sequence[tuple[str, int]], texts: Any, vectors: np.ndarray) -> EmbeddingTable:
        """The table of the rows `embed.write_rows` writes, checked as the file of them is when it is read whole
        (named `source` in errors): `sides` (each side and its number of rows, in order), the rows' `texts`
        (strs, or a pyarrow string array) and their float32 `vectors` [N, d] (read a block at a time where mapped)."""
        ends = np.cumsum([n for _, n in sides])

        def parts() -> Iterator[Part]:
            for start in range(0, len(texts), PART_ROWS):
                part = texts[start : start + PART_ROWS]
                rows = np.arange(start, start + len(part))
                named = [sides[b][0] for b in np.searchsorted(ends, rows, side="right").tolist()]
                yield part.to_pylist() if hasattr(part, "to_pylist") else list(part), named

        return cls._checked(source, parts, Vectors([_stacked(len(vectors), vectors.reshape(-1))]))

    def saved(self) -> frozen_index.Saved:
        """What the file's checks found, as its index file keeps it (`frozen_index.save`)."""
        return frozen_index.Saved(self.index, len(self.vectors), self.dim, self.sided, self.views)

    @classmethod
    def _checked(cls, source: str, parts: Callable[[], Iterator[Part]], vectors: Vectors) -> EmbeddingTable:
        """The table of the file's `parts` (its texts and sides, read a part at a time) and `vectors`, checked."""
        if not len(vectors):
            raise DataError(f"{source}: no rows; give one row per text (text, embedding[, side])")
        for start, block in vectors.blocks():  # one pass, no temporary but a norm a row
            norm = torch.linalg.vector_norm(block, ord=1, dim=1)  # inf or nan where a number is (or it overflows)
            bad = ~torch.isfinite(norm) | (norm == 0)
            if bad.any():
                raise DataError(
                    f"{source}: row {start + int(bad.nonzero()[0])}'s embedding is zero or not finite; a cosine "
                    "needs a finite, non-zero vector"
                )
        views, row, sided, seen, highs, lows = 0, 0, False, set(), [], []
        for texts, sides in parts():
            keys: list[tuple[str, str]] = []
            for at, text in enumerate(texts):
                side = "" if sides is None else sides[at]
                if side not in ("", *SIDES, *IMAGE_TEXT_SIDES) or (sides is not None and not side):
                    raise DataError(
                        f"{source}: row {row}'s side is {side!r}; use query or document (or no side column), or "
                        "image and caption for image-text data"
                    )
                if not isinstance(text, str) or not text.strip():
                    raise DataError(f"{source}: row {row}'s text is {text!r}; give the text the embedding is of")
                if side == "image" and "#" in text:
                    views = max(views, _view_of(source, row, text) + 1)
                keys.append((side, text.strip()))
                row += 1
            sided = sides is not None
            seen.update(side for side, _ in keys)
            high, low = digests(keys)
            highs.append(high)
            lows.append(low)
        index, later, first = TextIndex.from_digests(_joined(highs), _joined(lows), frozenset(seen))
        differ = (vectors[torch.from_numpy(later)] != vectors[torch.from_numpy(first)]).any(1).nonzero()
        if len(differ):
            at = int(differ[0])
            side, text = _key_at(parts, int(later[at]))
            raise DataError(
                f"{source}: rows {first[at]} and {later[at]} give {side + ' ' if side else ''}text {text[:60]!r} "
                "two different embeddings; keep one"
            )
        return cls(vectors, index, sided, source, views=views)

    @property
    def dim(self) -> int:
        return self.vectors.dim

    def check_image_text(self) -> None:
        """A DataError unless the file has image and caption rows (what image-text data looks up)."""
        self.check_sides(IMAGE_TEXT_SIDES, "image-text data looks up each image and caption")

    def check_sides(self, sides: Sequence[str], why: str) -> None:
        """A DataError (saying `why` the data needs them) unless the file has rows of each of `sides`."""
        if not set(sides) <= self.index.sides:
            has = ", ".join(sorted(side or "none" for side in self.index.sides))
            raise DataError(
                f"{self.source}: no {' and '.join(sides)} rows (its sides: {has}); {why}: write the file with "
                f"{EMBED_IMAGES}"
            )

    def lookup(self, side: str, keys: Sequence[str], where: Sequence[str] = ()) -> torch.Tensor:
        """int64 [len(keys)]: the rows of the `side` embeddings of `keys` (image keys or caption texts, or vl_pairs
        items' keys, `vl_items`); a DataError naming the first missing one (`where`: each key's sample, for the
        message)."""
        rows = self.index.find([(side, key.strip()) for key in keys])
        missing = np.flatnonzero(rows < 0)
        if len(missing):
            at = int(missing[0])
            sample = f" (sample {where[at]})" if where else ""
            raise DataError(
                f"{self.source}: no {side} embedding of {len(missing)} {side} key(s) of the data, e.g. "
                f"{keys[at][:100]!r}{sample}; embed the run's own data: {EMBED_IMAGES}"
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


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """The arrays of `parts` joined, and the list emptied: held once, not twice, while the digests sort."""
    joined = np.concatenate(parts)
    parts.clear()
    return joined


def _view_of(source: str, row: int, text: str) -> int:
    """The view number of an image row keyed `view_key(key, v)`, or a DataError."""
    view = text.strip().rsplit("#", 1)[1]
    if not view.isdigit():
        raise DataError(
            f"{source}: row {row}'s image key is {text[:60]!r}; a view's key is the image's key, '#' and the view's "
            f"number (written by {EMBED_IMAGES} --views K)"
        )
    return int(view)


def _key_at(parts: Callable[[], Iterator[Part]], row: int) -> tuple[str, str]:
    """(side, text) of the file's `row` (for a message)."""
    for texts, sides in parts():
        if row < len(texts):
            return ("" if sides is None else sides[row]), texts[row].strip()
        row -= len(texts)
    raise IndexError(row)


def _logit_scale(metadata: dict[bytes, bytes] | None, source: str) -> float | None:
    """The teacher's logit scale a .parquet or .arrow file keeps in its schema's metadata, or None."""
    value = (metadata or {}).get(TEACHER_LOGIT_SCALE.encode())
    if value is None:
        return None
    try:
        scale = float(value)
    except ValueError:
        scale = math.nan
    if not math.isfinite(scale):
        raise DataError(f"{source}: its {TEACHER_LOGIT_SCALE} metadata is {value!r}; give a finite number, or drop it")
    return scale


def _read_arrow_table(file: Path) -> tuple[Callable[[], Iterator[Part]], Vectors, dict[bytes, bytes] | None]:
    """(parts, vectors, schema metadata) of a .parquet file (read into memory) or an .arrow file (Arrow IPC, mapped:
    its uncompressed float32 vectors stay in the file's pages)."""
    import pyarrow as pa

    if file.suffix == ".arrow":
        mapped = pa.memory_map(str(file))
        table = pa.ipc.open_file(mapped).read_all()
        mapped.seek(0)
        span = mapped.read_buffer()  # the whole map, not copied
        within = (span.address, span.address + span.size)
    else:
        import pyarrow.parquet as pq

        table, within = pq.read_table(file), (0, 0)
    _check_names(table.column_names)
    chunks = table.column("embedding").chunks
    if not all(_is_list(c.type) and not c.null_count for c in chunks):
        raise DataError(f"its embedding column holds {table.column('embedding').type}; give a list of numbers per row")
    vectors = Vectors(_chunk_vectors(chunks), within)
    sided = "side" in table.column_names

    def parts() -> Iterator[Part]:  # `PART_ROWS` at a time: a batch may hold the whole file
        for batch in table.to_batches():
            for start in range(0, batch.num_rows, PART_ROWS):
                part = batch.slice(start, PART_ROWS)
                yield part.column("text").to_pylist(), part.column("side").to_pylist() if sided else None

    return parts, vectors, table.schema.metadata


def _is_list(kind: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


def _chunk_vectors(chunks: Sequence[Any]) -> list[torch.Tensor]:
    """float32 [n, d] per chunk of a list column, without a copy where the numbers are float32 already; a DataError
    unless every row holds the same d >= 1 numbers (a fixed-size list's type says it: no row is read)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    widths: set[int] = set()
    for chunk in (c for c in chunks if len(c)):
        if pa.types.is_fixed_size_list(chunk.type):
            widths.add(chunk.type.list_size)
        else:
            widths.update(np.unique(pc.list_value_length(chunk).to_numpy(zero_copy_only=False)).tolist())
    if not widths:
        return []
    _width(widths)
    out = []
    for chunk in chunks:
        numbers = chunk.flatten()
        if numbers.null_count:
            raise DataError("an embedding holding a null; give numbers only")
        out.append(_stacked(len(chunk), numbers.to_numpy(zero_copy_only=False)))
    return out


def _read_jsonl(file: Path) -> tuple[Callable[[], Iterator[Part]], Vectors, None]:
    records = [json.loads(line) for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not records:
        return lambda: iter([]), Vectors([]), None
    if not all(isinstance(r, dict) for r in records):
        raise DataError("every line must be a JSON object (text, embedding[, side])")
    names = list(records[0]) if records else []
    _check_names(names)
    sided = "side" in names
    vectors = [r.get("embedding") for r in records]
    if not all(isinstance(v, list) and all(isinstance(x, (int, float)) for x in v) for v in vectors):
        raise DataError("an embedding that is not a list of numbers; give one per line")
    lengths = [len(v) for v in vectors]
    _width(lengths)
    values = [x for v in vectors for x in v]
    part = ([r.get("text") for r in records], [r.get("side") for r in records] if sided else None)
    return lambda: iter([part]), Vectors([_stacked(len(lengths), values)]), None


def _check_names(names: Sequence[str]) -> None:
    if "text" not in names or "embedding" not in names:
        raise DataError(
            f"columns {', '.join(names) or 'none'}; the embeddings file needs text and embedding (and optionally side)"
        )


def _width(lengths: Iterable[int]) -> int:
    """The one d >= 1 of rows of `lengths`, or a DataError."""
    widths = sorted({int(n) for n in lengths})
    if len(widths) != 1 or widths[0] < 1:
        raise DataError(
            f"embeddings of {', '.join(map(str, widths[:4]))} numbers; every row's must have the same length"
        )
    return widths[0]


def _stacked(n: int, values: Any) -> torch.Tensor:
    """[n, d] float32 of the flat `values` of `n` rows of one width (`_width`); a view of float32 numbers."""
    numbers = np.asarray(values, dtype=np.float32)
    with warnings.catch_warnings():  # the file's mapped pages are read-only; the rows served are copies
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        flat = torch.from_numpy(numbers)
    return flat.view(n, -1) if n else flat.view(0, 1)
