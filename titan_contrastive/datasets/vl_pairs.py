"""The user's query-document rows with images and texts on either side, for the qwen_vl family
(`data.dataset = "vl_pairs"`): every retrieval mode, i2i, t2t and those of image + text sides (m2i, t2m, ...) included.

Files: `.jsonl` (one JSON object per line), `.json` (an array of them, or JSON lines), `.csv`, `.tsv` (both with a
header line), `.parquet` or `.arrow`, or a `save_to_disk` folder (`tables.table_rows`), with the columns
`query_image`, `query_text`, `doc_image`, `doc_text` (or VLM2Vec's or colpali-engine's, `vl_rows`); image paths are
relative to the file's folder, or to `data.image_root`; images held in the cells (a Hugging Face Image column) are
written once to `data.image_cache` and read from there (`held_images`). A glob pattern or a folder of such files
(`shards`) is one source, each file's image paths relative to its own folder (or that root). With `data.corpus`
the rows name their documents by id into it, as tevatron's multimodal rows do (`vl_corpus`).
`[data] retrieval_mode` says which a row needs (`retrieval.MODES`: a text side its `*_text`, an image side its
`*_image`, a multi side both); the others may be absent or empty. An optional `doc_negatives` column holds a row's
hard negatives, documents of the documents' kind: texts (t2t, i2t, m2t), image paths (t2i, i2i, m2i) or
`{"image", "text"}` objects (t2m, i2m, m2m), a list (JSONL, Parquet) or one value; every row has as many as the first
(the train split only, and only with `data.hard_negatives`). With `data.negatives_per_row = k` rows hold any number
and each epoch serves k of them (`pools.Pools`: by the seed, the row and the epoch; a row without one is a bad sample).
They go through the processor like the documents (`SideProcessor.sides`' `negatives`). With `loss.distill`
(kl or margin_mse) a `doc_scores` column holds a teacher's scores of the row's documents, the document's and then
each of `doc_negatives`' in order (FlagEmbedding's `pos_scores` + `neg_scores`); the scores of the documents an
epoch serves are served as `teacher_scores` (`batching.TEACHER_SCORES`) [B, 1 + k].

A row whose needed image is missing, unreadable or does not decode, or whose needed text is empty
(a negative's included), or that holds another number of negatives, is a bad sample: its slot takes
the next good row (in file order, the same in every run) and the skip is listed under `BAD_SAMPLES`
for the loader to count (`bad_samples`), as `files.FileImageTextDataset` does. Images are decoded
at their own resolution and go, with the texts, through the family's processor (`serve_processed`:
qwen_vl's `SideProcessor.sides`), which resizes them within `[min_pixels, max_pixels]`; nothing is
random but the negatives drawn per epoch.
Several files join with `::` (`mixing.SourceMix`, weighted by `data.upsampling_factors`; image paths
relative to each file's folder; a bad row's substitute comes from its own file). Each file may have
its own side templates (`data.query_prompts`, `data.doc_prompts`: a task's instruction, as VLM2Vec
gives each dataset one), used in place of the model's (`model.query_prompt`, `doc_prompt`) for its
rows, its hard negatives included; "" keeps the model's. Each file may have its own retrieval mode
(`data.retrieval_modes`: MMEB's VQA in m2t beside its retrieval in t2i), read as `vl_files.VLFile` says; a batch is
one file's (`data.same_source_batches`) or mixes them, each row of its file's mode (`SideProcessor.sides`' modes per
row), and a side of another kind than the model's takes that kind's default template (`SideProcessor.template`)
unless the file has its own.
With `[loss] teacher_embeddings` (or `guide_embeddings`), a file of a frozen model's embeddings of the rows' queries and
documents written ahead (`embed_images`, keyed as `vl_items` says), each batch carries the vectors of its queries and
documents (`frozen_query` [B, d], `frozen_doc` [B, d] or [B, 1 + k, d] with its hard negatives).
Evaluation (`data.val_path`, the same columns) ranks each query's document among the split's
documents: recall@1/5/10 query -> document and back.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image

from titan_contrastive.batching import OWN_GROUP, TEACHER_SCORES
from titan_contrastive.datasets.bad_samples import BAD_SAMPLES
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.files import MAX_SUBSTITUTES
from titan_contrastive.datasets.held_images import ImageStore, default_folder, local_share
from titan_contrastive.datasets.image_keys import image_key
from titan_contrastive.datasets.image_transforms import decode_image
from titan_contrastive.datasets.mixing import SourceMix, check_per_source, in_batch_per_source, joins, split_sources
from titan_contrastive.datasets.pair_rows import document_scores
from titan_contrastive.datasets.pools import Pools
from titan_contrastive.datasets.retrieval import MODES, SIDES
from titan_contrastive.datasets.sources import BadSample, read_file
from titan_contrastive.datasets.vl_corpus import POSITIVE_IDS, POSITIVES_COLUMN
from titan_contrastive.datasets.vl_files import (
    COLUMNS,
    NEGATIVES_COLUMN,
    SCORES_COLUMN,
    VLFile,
    needed,
    read_source,
    with_documents,
)
from titan_contrastive.datasets.vl_items import FILE_SIDES, Item, carried, item_key, side_key
from titan_contrastive.datasets.vl_rows import as_list, negative_parts, written

__all__ = ["COLUMNS", "VLPairsDataset", "family_refusal"]

logger = logging.getLogger("titan_contrastive")

KEYS = "frozen_keys"
"""A sample's (query key, document key, hard negatives' keys, where) with a frozen model's embeddings (`vl_items`)."""


def family_refusal(family: str) -> str:
    return (
        f"data.dataset='vl_pairs' is read through a model family's processor (query and document images and "
        f"texts); model.name={family!r} has none: use model.name='qwen_vl'"
    )


class VLPairsDataset:
    """A `datasets.protocol.Dataset` of query-document rows (see the module docstring): batches of the
    processor's entries (query, doc, per-side pixel_values and image_grid_thw), `index` [B] and
    `BAD_SAMPLES`, once a family's processor serves them (`serve_processed`); `tokenizer` is then
    the processor's."""

    serves_sides = True
    """Both sides' images and texts per row: every retrieval mode (`layouts.PROCESSED` checks it)."""

    def __init__(
        self,
        *,
        split: str,
        path: str,
        mode: str,
        modes: Sequence[str] = (),
        hard_negatives: bool = True,
        negatives_per_row: int = 0,
        seed: int = 0,
        factors: Sequence[float] = (),
        query_templates: Sequence[str] = (),
        doc_templates: Sequence[str] = (),
        in_batch_negatives: Sequence[bool] = (),
        teacher: str = "",
        image_root: str = "",
        image_cache: str = "",
        corpus: str = "",
        group: Any = None,
    ) -> None:
        """`modes`: one retrieval mode per `::`-joined file (`data.retrieval_modes`; a batch's rows each of its file's);
        empty: `mode` for each. `negatives_per_row`: k > 0 serves k of each row's `doc_negatives` per epoch, drawn by
        `seed` (`pools.Pools`); 0 serves them all, as many per row as the first row's. `in_batch_negatives`: one per
        file, false flags its queries to be scored against their own documents only (`batching.OWN_GROUP`).
        `teacher`: the loss.distill kind that reads the rows' `doc_scores` (the train split; "": none).
        `image_root`: the folder relative image paths are read from (`data.image_root`; "": each file's own).
        `image_cache`: where images held in the files' cells are written (`data.image_cache`; "": `held_images`').
        `corpus`: the file of the documents that rows of document ids name (`data.corpus`, `vl_corpus`). `group`:
        every rank of the run (gloo), building this dataset at once: the ranks of a machine share the writing of the
        images held in cells (`held_images.local_share`) and wait for each other's; None: this process writes all."""
        self.image_root = Path(image_root).expanduser() if image_root else None
        key = "data.path" if split == "train" else "data.val_path"
        parts, factors = split_sources(path, factors)
        modes = list(modes) or [mode] * len(parts)
        for given in modes:
            if given not in MODES:
                raise DataError(f"data.retrieval_mode={given!r}: vl_pairs trains {', '.join(MODES)}")
        self.templates = {"query": list(query_templates), "doc": list(doc_templates)}
        """Per side, one template per file (`data.query_prompts` / `doc_prompts`; "": the model's), or none."""
        for side, given in self.templates.items():
            check_per_source(f"{side}_prompts", given, parts, empty="the model's")
        self.scored = bool(teacher) and split == "train"
        """Whether rows give a teacher's scores of their documents (`SCORES_COLUMN`), served as TEACHER_SCORES."""
        used = {c for m in modes for c in needed(m)}
        self._columns = (
            *(c for c in COLUMNS if c in used),
            NEGATIVES_COLUMN,
            *((SCORES_COLUMN,) if self.scored else ()),
            *((POSITIVES_COLUMN,) if corpus else ()),
        )
        """What a file's row holds (`VLFile.rows`), in this order."""
        self.image_store = store = ImageStore(image_cache or default_folder(), local_share() if group else (0, 1))
        """Where the images held in the files' cells went, and how many this process wrote."""
        self._files = [
            read_source(part, key, m, split, self._columns, self.image_root, self.scored, store, bool(corpus))
            for part, m in zip(parts, modes)
        ]
        if corpus:
            if self.scored:
                raise DataError(
                    f"data.corpus={corpus}: rows of document ids give no teacher's scores; leave loss.distill empty"
                )
            self._files = [with_documents(f, self._columns, corpus, store, self.image_root) for f in self._files]
        if group is not None:  # every image held in a cell written, by whichever rank it fell to
            dist.barrier(group=group)
        if store.images:
            logger.info(
                f"vl_pairs: {store.images} images held in the cells of {path}{' and data.corpus' if corpus else ''}, "
                f"read from {store.folder} "
                f"({store.written} written now{' by this rank' if group is not None else ''})"
            )
        if self.scored:
            logger.info(f"vl_pairs: the teacher's scores of each served document from {path} (loss.distill={teacher})")
        counts = {f.source: int(f.negatives[0]) for f in self._files}
        served = hard_negatives and split == "train"
        self.num_negatives = next(iter(counts.values())) if served else 0
        self._pools: list[Pools] | None = None
        """With negatives_per_row (train split): per file, each row's draw of its negatives."""
        several = next((f.source for f in self._files if f.positives is not None and f.positives.max() > 1), "")
        if several and split == "train" and not (negatives_per_row and served):
            raise DataError(
                f"{key}={path}: rows of {several} name several {POSITIVE_IDS}, and a row here serves one positive; set "
                "data.negatives_per_row = k to draw one of them (and k negatives) per epoch, as tevatron does"
            )
        if negatives_per_row and served:
            drawn = (
                Pools(_ones(f.positives, len(f.rows)), np.maximum(f.negatives, 1), negatives_per_row, seed + i)
                for i, f in enumerate(self._files)
            )
            self.num_negatives, self._pools = negatives_per_row, list(drawn)
            logger.info(
                f"vl_pairs: {negatives_per_row} of each row's {NEGATIVES_COLUMN} served per epoch from {path}, drawn "
                "by the seed (a row without one is a bad sample)"
            )
        elif self.num_negatives and len(set(counts.values())) > 1:
            shown = ", ".join(f"{where}: {k}" for where, k in counts.items())
            raise DataError(
                f"{key}={path}: the sources' first rows hold different numbers of {NEGATIVES_COLUMN} ({shown}); give "
                "every source the same number, or set data.hard_negatives=false"
            )
        if self.scored and not self.num_negatives:
            raise DataError(
                f"{key}={path}: loss.distill compares each query's document with its hard negatives, and the first "
                f"row holds no {NEGATIVES_COLUMN}: give the rows hard negatives, or leave loss.distill empty"
            )
        flags = in_batch_per_source(in_batch_negatives, parts)
        self._own = None if all(flags) else [not flag for flag in flags]
        """Per file, whether its queries see their own documents only (data.in_batch_negatives); None: none do."""
        if self._own is not None and not self.num_negatives:
            raise DataError(
                f"data.in_batch_negatives={list(flags)}: a query without in-batch negatives is scored against its own "
                f"hard negatives, and {path} serves none (its first row holds no {NEGATIVES_COLUMN}): give those "
                "rows hard negatives"
            )
        self._mix = SourceMix([len(f.rows) for f in self._files], factors) if joins(factors) else None
        self.source_sizes = self._mix.sizes if self._mix else None
        """Samples per epoch of each `::`-joined file (`mixing.SourceMix`); None: one file, each row once."""
        self.epoch = 0
        self.name, self.split, self.source, self.full = "vl_pairs", split, path, True
        self.image_shape = None  # native resolution: the processor sizes each image
        self.tokenizer: Any = None  # the processor's (`serve_processed`)
        self.class_names = None
        self.recall_ks = (1, 5, 10)
        self.recall_direction = "query_to_doc"
        self.shard_losses: list[Any] = []
        self._process: Any = None
        self._frozen: Any = None
        self.views = 0

    def __len__(self) -> int:
        return len(self._files[0].rows) if self._mix is None else len(self._mix)

    def __repr__(self) -> str:
        return f"VLPairsDataset({self.split}: {len(self)} rows from {self.source})"

    def set_epoch(self, epoch: int) -> None:
        """Images at their own size, texts as written; joined files' windows and drawn negatives move per epoch."""
        self.epoch = epoch

    @property
    def processed(self) -> bool:
        return self._process is not None

    def serve_processed(self, process: Any, sizes: Sequence[int] = ()) -> None:
        """Serve `process.sides(query images, query texts, document images, document texts)` of each batch."""
        if sizes:
            raise DataError(
                f"data.image_sizes={list(sizes)}: vl_pairs images are served at their own resolution (the "
                "processor's min_pixels / max_pixels bound it); leave data.image_sizes empty"
            )
        if not hasattr(process, "sides"):
            raise DataError("data.dataset='vl_pairs' needs a processor that fills both sides: use model.name='qwen_vl'")
        self._process, self.tokenizer = process, process.tokenizer
        for i, file in enumerate(self._files):
            shown = {side: self._template(side, i) for side in SIDES}
            for side, template in shown.items():
                given = bool(self.templates[side] and self.templates[side][i])
                key = f"data.{side}_prompts[{i}]" if given else f"model.{side}_prompt (or {file.mode}'s default)"
                process.check_template(side, template, key, file.mode)
            if any(self.templates.values()) or file.mode != process.mode:
                shown_as = f"query template {shown['query']!r}, document {shown['doc']!r}"
                logger.info(f"vl_pairs: {file.source} ({file.mode}): {shown_as}")

    def pack_patches(self, *args: Any) -> None:
        raise DataError(family_refusal("vlm"))

    def serve_masked(self, *args: Any) -> None:
        raise DataError(family_refusal("vae"))

    def _value(self, file: VLFile, column: str, kind: str, value: Any, key: str, keyed: bool) -> tuple[Any, str]:
        """One field and its key: a text stripped (its own key), or an image path read and decoded to a uint8 HWC array
        and, where `keyed` (a frozen model's embeddings are looked up or written), the SHA-1 of the file's bytes
        (`image_keys.image_key`; else ""); a multi document's hard negative, an `{"image", "text"}` object, both as
        ((image, text), (text key, image key)); BadSample."""
        where = file.source
        if kind == "multi":
            if not isinstance(value, dict):
                raise BadSample("bad_negative", where, key, f'{column}: not an object {{"image": ..., "text": ...}}')
            image, seen = self._value(file, column, "image", value.get("image"), key, keyed)
            text, said = self._value(file, column, "text", value.get("text"), key, keyed)
            return (image, text), (said, seen)
        if kind == "text":
            if not isinstance(value, str) or not value.strip():
                raise BadSample("missing_text", where, key, f"{column} is empty")
            return value.strip(), value.strip()
        if not isinstance(value, str) or not value.strip():
            raise BadSample("missing_image", where, key, f"{column} is empty")
        data = read_file(str(file.root / value.strip()), where, key)
        try:
            return np.asarray(decode_image(data)), image_key(data) if keyed else ""
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            raise BadSample("undecodable_image", where, key, f"{column}: {type(e).__name__}: {e}") from None

    def drawn(self, source: int, j: int) -> tuple[int, list[int]]:
        """(the place among row `j`'s positives, the places in its `doc_negatives`) that this epoch serves, of
        `::`-joined file `source`."""
        if self._pools is None:
            return 0, list(range(self.num_negatives))
        pools = self._pools[source]
        places = pools.draw(torch.tensor([j]), self.epoch)[0] - pools.start[j]
        return int(places[0]), (places[1:] - pools.positives[j]).tolist()

    def _fields(self, source: int, j: int) -> dict[str, Any]:
        """Row `j` of file `source`: its needed fields (and its hard negatives, a list), or BadSample."""
        file = self._files[source]
        row, key = dict(zip(self._columns, file.rows[j])), str(j)
        positive, places = self.drawn(source, j)
        if row.get(POSITIVES_COLUMN):  # of several positives (documents by id), the one this epoch serves
            row["doc_image"], row["doc_text"] = (row[POSITIVES_COLUMN][positive][f] for f in ("image", "text"))
        keyed = self._frozen is not None
        fields = {
            c: self._value(file, c, "text" if c.endswith("_text") else "image", row[c], key, keyed) for c in file.needed
        }
        out: dict[str, Any] = {c: value for c, (value, _) in fields.items()}
        negatives = as_list(row[NEGATIVES_COLUMN])
        if self._pools is not None:
            if not negatives:
                raise BadSample("no_negatives", file.source, key, f"{NEGATIVES_COLUMN} is empty")
        elif self.num_negatives and len(negatives) != self.num_negatives:
            detail = f"{NEGATIVES_COLUMN} holds {len(negatives)}, the first row {self.num_negatives}"
            raise BadSample("ragged_negatives", file.source, key, detail)
        picked = [self._value(file, NEGATIVES_COLUMN, file.negative_kind, negatives[p], key, keyed) for p in places]
        if self.num_negatives:
            out[NEGATIVES_COLUMN] = [value for value, _ in picked]
        if self._frozen is not None:
            out[KEYS] = self._keys(source, fields, [k for _, k in picked], f"{file.source} row {j}")
        if self.scored:
            value = row.get(SCORES_COLUMN)
            scores = document_scores(value.tolist() if hasattr(value, "tolist") else value, 1 + len(negatives))
            if scores is None:
                detail = (
                    f"{SCORES_COLUMN} is not {1 + len(negatives)} finite numbers (the document's, then each negative's)"
                )
                raise BadSample("bad_scores", file.source, key, detail)
            out[SCORES_COLUMN] = [scores[0]] + [scores[1 + p] for p in places]
        return out

    def _keys(self, source: int, fields: dict[str, tuple[Any, str]], negatives: list[str], where: str) -> tuple:
        """(query key, document key, the hard negatives' keys, `where`) of a row of file `source` (`vl_items`) from its
        `fields`' keys and its `negatives`' (texts, or their images' SHA-1)."""
        none = ("", "")
        own = [
            item_key(
                self._template(side, source), fields.get(f"{side}_text", none)[1], fields.get(f"{side}_image", none)[1]
            )
            for side in SIDES
        ]
        doc = self._template("doc", source)
        kind = self._files[source].kinds["doc"]
        return (*own, [side_key(kind, doc, *(k if isinstance(k, tuple) else (k, k))) for k in negatives], where)

    def _read(self, index: int, bad: list[BadSample]) -> tuple[int, dict[str, Any]]:
        """Sample `index`'s file and fields, or those of the next good row of its file (each bad one appended
        to `bad`)."""
        source, row = (0, index) if self._mix is None else self._mix.locate(index, self.epoch)
        file, j = self._files[source], row
        for _ in range(MAX_SUBSTITUTES):
            try:
                return source, self._fields(source, j)
            except BadSample as e:
                bad.append(e)
            j = (j + 1) % len(file.rows)
        raise DataError(
            f"{file.source}: {MAX_SUBSTITUTES} bad rows in a row from row {row} (last: {bad[-1]}); check the "
            "file and its images"
        )

    def __getitems__(self, indices: Sequence[int]) -> dict[str, Any]:
        if self._process is None:
            raise DataError(family_refusal("this family"))
        bad: list[BadSample] = []
        sources, rows = zip(*(self._read(int(i), bad) for i in indices))
        modes = [self._files[s].mode for s in sources]
        used = {c for m in set(modes) for c in needed(m)}
        fields = {c: [r.get(c) for r in rows] if c in used else None for c in COLUMNS}
        mode = modes[0] if len(set(modes)) == 1 else modes  # rows of several modes: each side's kind per row
        negatives = [n for r in rows for n in r.get(NEGATIVES_COLUMN, ())]  # k per row, row after row
        templates = {side: [given[s] for s in sources] for side, given in self.templates.items() if given}
        batch = self._process.sides(*(fields[c] for c in COLUMNS), negatives=negatives, templates=templates, mode=mode)
        if self._own is not None:
            batch[OWN_GROUP] = torch.tensor([self._own[s] for s in sources])
        if self.scored:
            batch[TEACHER_SCORES] = torch.tensor([r[SCORES_COLUMN] for r in rows], dtype=torch.float32)
        if self._frozen is not None:
            batch |= self._frozen_of([r[KEYS] for r in rows])
        return {**batch, "index": torch.as_tensor(list(indices), dtype=torch.long), BAD_SAMPLES: bad}

    def _template(self, side: str, source: int) -> str:
        """The template of `side` ("query" or "doc") for the rows of file `source`: its own, else the model's for its
        mode (`SideProcessor.template`)."""
        given = self.templates[side]
        return (given[source] if given else "") or self._process.template(side, self._files[source].mode)

    def carry_frozen(self, table: Any, probe: int = 16) -> None:
        """Serve a frozen model's embeddings beside each sample (a `datasets.frozen.EmbeddingTable` of this data's
        items, `embed_images`): `frozen_query` [B, d] of its query, `frozen_doc` [B, d] of its document, or
        [B, 1 + k, d] with the hard negatives it is served, each looked up by its key (`vl_items.item_key`). The first
        `probe` samples are looked up here, before any compute; a sample the file misses later is a DataError when
        its batch is made."""
        table.check_sides(tuple(FILE_SIDES.values()), "vl_pairs rows look up each query and document")
        self._frozen = table
        bad: list[BadSample] = []
        self._frozen_of([self._read(i, bad)[1][KEYS] for i in range(min(probe, len(self)))])

    def _frozen_of(self, keys: Sequence[tuple[Any, ...]]) -> dict[str, torch.Tensor]:
        """`frozen_query` and `frozen_doc` of samples of `keys` (`KEYS`)."""
        return carried(self._frozen, [k[0] for k in keys], [[k[1], *k[2]] for k in keys], [k[3] for k in keys])

    def frozen_items(self) -> dict[str, list[Item]]:
        """Each query and each document an epoch can serve (every hard negative of every row, whichever an epoch
        draws), by the file's side (`query`, `document`), each once, in row order: what a frozen model embeds ahead
        (`embed_images`)."""
        found: dict[str, dict[Item, None]] = {side: {} for side in FILE_SIDES.values()}
        for s, file in enumerate(self._files):
            for values in file.rows:
                row = dict(zip(self._columns, values))
                for side, name in FILE_SIDES.items():
                    kind = file.kinds[side]
                    text = written(row.get(f"{side}_text")) if kind != "image" else ""
                    image = written(row.get(f"{side}_image")) if kind != "text" else ""
                    found[name].setdefault(Item(s, self._template(side, s), text, image), None)
                for value in as_list(row.get(POSITIVES_COLUMN)):  # each positive a row of document ids names
                    text, image = (value[f] if file.kinds["doc"] in (f, "multi") else "" for f in ("text", "image"))
                    found["document"].setdefault(Item(s, self._template("doc", s), text, image), None)
                for value in as_list(row.get(NEGATIVES_COLUMN)) if self.num_negatives else ():
                    text, image = negative_parts(file.negative_kind, value)
                    found["document"].setdefault(Item(s, self._template("doc", s), text, image), None)
        return {side: list(items) for side, items in found.items()}

    def item_inputs(self, side: str, items: Sequence[Item]) -> tuple[dict[str, torch.Tensor], list[str]]:
        """The processor's inputs of `items` of the file's `side` (`frozen_items`): `ids`, and with images
        `pixel_values` and `image_grid_thw`, and their keys (`vl_items.item_key`); an item whose text is empty or
        whose image is missing or does not decode is left out (training never serves it). ({}, []) when none is
        left."""
        templates, texts, images, keys = [], [], [], []
        for item in items:
            file = self._files[item.source]
            kind = file.kinds["query" if side == "query" else "doc"]  # its file's mode's (`data.retrieval_modes`)
            try:
                text = self._value(file, f"{side}_text", "text", item.text, "", True) if kind != "image" else ("", "")
                image = (
                    self._value(file, f"{side}_image", "image", item.image, "", True) if kind != "text" else (None, "")
                )
            except BadSample:
                continue
            templates.append(item.template)
            texts.append(text[0])
            images.append(image[0])
            keys.append(item_key(item.template, text[1], image[1]))
        if not keys:
            return {}, []
        return self._process.items(templates, texts, images if any(i is not None for i in images) else None), keys


def _ones(counts: np.ndarray | None, rows: int) -> Any:
    """Each row's positives (`VLFile.positives`; None: one each)."""
    return [1] * rows if counts is None else counts
