"""The miner's core, for text pairs (`mine.py`) and query-page rows (`mine_pages.py`): sentence-transformers'
`mine_hard_negatives` run on rows and a model (a SentenceTransformer, or an object with the calls it makes), the
mined rows written through a temporary file, and the one error a bad argument raises."""

from __future__ import annotations

import argparse
import csv
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from titan_contrastive.atomic_write import write_atomically

SEARCH_BYTES = 1 << 28
"""Bytes of float32 scores per block of queries against the whole corpus (sentence-transformers'
`faiss_batch_size`, which also sizes its exact search without FAISS)."""


class MineError(ValueError):
    """A bad argument: one line naming the flag, the value and the fix."""


def mine(
    texts: Sequence[Sequence[str]],
    model: Any,
    opts: argparse.Namespace,
    corpus: Sequence[str] | None = None,
    pool: list[str] | None = None,
    cross_encoder: Any = None,
) -> list[list[Any] | None]:
    """Per input row, its query, positive and `opts.negatives` mined negatives (then, with
    `opts.scores`, the list of the model's cosines of the positive and each negative); None where
    fewer passed the filters. With `opts.keep_fewer`: the query, the positive and the list of the 1 to
    `opts.negatives` negatives that passed (sentence-transformers' "labeled-list"), None where none did.
    `corpus`: documents to mine from besides the positives; `pool`:
    devices to encode on, one process each; `cross_encoder`: a CrossEncoder whose scores the
    filters and the scores read."""
    from datasets import Dataset
    from sentence_transformers.util import mine_hard_negatives

    size = len({row[1] for row in texts} | set(corpus or ()))
    random.seed(opts.seed)  # sentence-transformers samples with `random` (--sampling random)
    mined = mine_hard_negatives(
        Dataset.from_dict({"anchor": [r[0] for r in texts], "positive": [r[1] for r in texts]}),
        model,
        range_min=opts.range_min,
        range_max=opts.range_max,
        max_score=opts.max_score,
        min_score=opts.min_score,
        absolute_margin=opts.absolute_margin,
        relative_margin=opts.relative_margin,
        num_negatives=opts.negatives,
        sampling_strategy=opts.sampling,
        query_prompt=opts.query_prompt,
        corpus_prompt=opts.doc_prompt,
        output_format="labeled-list" if opts.keep_fewer else "n-tuple",
        output_scores=opts.scores,
        cross_encoder=cross_encoder,
        batch_size=opts.batch_size,
        corpus=list(corpus) if corpus else None,
        use_multi_process=pool or False,
        faiss_batch_size=max(1, SEARCH_BYTES // (4 * size)),
    )
    if opts.keep_fewer:  # "positive" holds the positive then the negatives kept; "scores" (asked for) theirs
        found = {
            (r["anchor"], r["positive"][0]): [r["positive"][1:], *([r["scores"]] if opts.scores else [])] for r in mined
        }
        return [[row[0], row[1], *found[(row[0], row[1])]] if (row[0], row[1]) in found else None for row in texts]
    names = [f"negative_{i}" for i in range(1, opts.negatives + 1)]
    names += ["scores"] if opts.scores else []
    found = {(r["anchor"], r["positive"]): [r[n] for n in names] for r in mined}
    return [[row[0], row[1], *found[(row[0], row[1])]] if (row[0], row[1]) in found else None for row in texts]


def write_rows(out: Path, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """`rows` under `columns` into `out` (by its suffix), through a temporary file renamed when complete."""
    out.parent.mkdir(parents=True, exist_ok=True)
    records = [dict(zip(columns, row)) for row in rows]

    def write(tmp: Path) -> None:
        if out.suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(records), tmp)
        elif out.suffix == ".csv":
            with open(tmp, "w", newline="", encoding="utf-8") as f:
                writer = csv.DictWriter(f, fieldnames=list(columns))
                writer.writeheader()
                writer.writerows(records)
        else:
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)

    write_atomically(out, write)
