"""`python -m titan_contrastive.embed PAIRS --model MODEL --out FILE`: a frozen model's embeddings of your text
pairs' texts, computed once, for `[loss] teacher_embeddings` or `guide_embeddings` (`datasets/frozen.py`): a
distillation or a guide's masks without the teacher or guide running in every step.

PAIRS is what `data.path` reads for `data.dataset = "pairs"` (`datasets.pairs`; `--columns` is
`data.pairs_columns`, `--corpus` `data.corpus`; files joined with `::` are read one after another), or `wordnet` for
the bundled WordNet pairs (`data.dataset = "wordnet"`). MODEL is one of `mine`'s: a bi_encoder or static step folder
(through a verified sentence-transformers export; a run of two towers embeds each side with its own unless `--tower`
names one),
a sentence-transformers folder (a Router's routes: `query`, `document`), or a transformers folder (mean pooling);
its own code runs only with `--trust-remote-code`. Each distinct query text is embedded with the query prompt
(`--query-prompt`; default the model's `query` prompt, if it has one) and each distinct document text (the
positives and negatives) with the document prompt (`--doc-prompt`; default its `document`, `passage` or `corpus`
prompt), as sentence-transformers' `encode_query` / `encode_document` do.

`--parallel` reads PAIRS as parallel sentences, (source, translation) rows: it embeds the sources alone and gives each
translation its source's embedding, the labels of multilingual knowledge distillation (Reimers and Gurevych 2020,
sentence-transformers' `make_multilingual.py`): with `distill = "mse"` a student learns to embed the source and its
translation where the teacher embeds the source. A row with hard negatives, or a translation of two different
sources, is refused.

`--device cuda:0,cuda:1,...` embeds on several devices at once, a process on each (sentence-transformers'
multi-process pool: the texts in chunks, the rows in their order).

FILE (`.parquet`, `.jsonl`, or `.arrow`: an uncompressed Arrow IPC file, which every process of a training machine maps
instead of reading, one copy of the vectors per machine) holds one row per (side, text): `side` (query or document),
`text`, `embedding` (float32, as the model returns it). The vectors go to a hidden folder beside it as they are
computed, `ENCODE_ROWS` texts at a time (`row_spool`), and FILE is written from there mapped, so no process holds them
all; it is written under a temporary name and renamed when complete, never over an existing file unless
`--overwrite`, never the input. The rows of a .parquet or .arrow FILE are checked as a run checks a file it reads
whole, and its index written beside it (FILE.index, `datasets/frozen_index.py`), which a run maps instead of hashing
its keys. Bad arguments are one `error: ...` line and exit code 2, before any model is loaded. Needs the `hf` and `data`
extras.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from titan_contrastive.atomic_write import write_atomically
from titan_contrastive.datasets.frozen import EmbeddingTable
from titan_contrastive.datasets.frozen_index import save
from titan_contrastive.extras import import_failure
from titan_contrastive.mining import MineError

OUT_FORMATS = (".parquet", ".jsonl", ".arrow")
ROW_GROUP = 1 << 16
"""Rows a .parquet file's row group holds, and a .jsonl file's rows converted at a time."""
ENCODE_ROWS = 1 << 16
"""Texts per call of the model's `encode`: the vectors held before they go to the spool's file (`row_spool`)."""
DOCUMENT_PROMPTS = ("document", "passage", "corpus")
"""The prompt names sentence-transformers' `encode_document` reads, in its order."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m titan_contrastive.embed", description=__doc__.split("\n\n")[0])
    p.add_argument("pairs", metavar="PAIRS", help="a pairs file as data.path reads, or 'wordnet' (the bundled pairs)")
    p.add_argument(
        "--model",
        required=True,
        help="a bi_encoder or static step folder, or a sentence-transformers / transformers one ('': the bundled "
        "all-MiniLM-L6-v2)",
    )
    p.add_argument("--out", type=Path, required=True, help="the file to write: .parquet, .jsonl or .arrow")
    p.add_argument("--columns", default="", help="query,positive[,negatives] column names (data.pairs_columns)")
    p.add_argument("--corpus", default="", help="the documents the rows name by id (data.corpus)")
    p.add_argument("--query-prompt", default=None, help="text before each query (default: the model's 'query' prompt)")
    p.add_argument(
        "--doc-prompt", default=None, help="text before each document (default: the model's 'document' prompt)"
    )
    p.add_argument(
        "--tower",
        choices=("query", "doc"),
        default=None,
        help="a checkpoint with two towers: embed both sides with this one (default: each side with its own)",
    )
    p.add_argument(
        "--parallel",
        action="store_true",
        help="(source, translation) rows: embed the sources and give each translation its source's embedding",
    )
    p.add_argument("--batch-size", type=int, default=64, help="texts per forward (default: 64)")
    p.add_argument(
        "--device",
        default=None,
        help="cpu, cuda, cuda:1 ..., or several (cuda:0,cuda:1): one encoding process each (default: "
        "sentence-transformers' choice of one)",
    )
    p.add_argument(
        "--trust-remote-code", action="store_true", help="run the code a model folder ships (config.json auto_map)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace --out when it exists")
    return p


def check(opts: argparse.Namespace) -> Path:
    """The output file, or a MineError for an argument that cannot work (before anything is read)."""
    from titan_contrastive.datasets.formats import data_suffix, formats_named
    from titan_contrastive.datasets.pair_rows import FORMATS

    if opts.batch_size < 1:
        raise MineError(f"--batch-size={opts.batch_size}: texts per forward, 1 or more")
    if opts.parallel and opts.doc_prompt is not None:
        raise MineError(
            f"--doc-prompt={opts.doc_prompt!r}: --parallel embeds only the sources (with the query prompt); drop it"
        )
    out = Path(opts.out).expanduser()
    if out.suffix not in OUT_FORMATS:
        raise MineError(f"--out={out}: write {'/'.join(OUT_FORMATS)} (what loss.teacher_embeddings reads)")
    if out.is_dir() or out.is_symlink():
        raise MineError(f"--out={out} is a folder or a link; give a file name")
    if out.exists() and not opts.overwrite:
        raise MineError(f"--out={out} exists; choose a new file or pass --overwrite")
    if opts.pairs != "wordnet":
        for part in opts.pairs.split("::"):
            src = Path(part).expanduser()
            if not (src.is_dir() or "*" in part or (src.is_file() and data_suffix(src) in FORMATS)):
                raise MineError(f"PAIRS={part}: not an existing {formats_named(FORMATS)} file or save_to_disk folder")
            if src.resolve() == out.resolve():
                raise MineError(f"--out={out} is the input; write the embeddings to a new file")
    return out


def read_rows(pairs: str, columns: Sequence[str], corpus: str = "") -> list[tuple[str, ...]]:
    """The rows of PAIRS: (query, positive(s), negatives...) texts, lists of positives and rows of any width read
    (what a run with data.negatives_per_row reads too); `corpus`: the documents they name by id."""
    if pairs == "wordnet":
        from titan_contrastive.datasets.wordnet import BUNDLE_DIR, load_rows

        return [tuple(row) for row in load_rows(BUNDLE_DIR, "train")]
    from titan_contrastive.datasets.corpus import resolve_documents
    from titan_contrastive.datasets.pair_rows import read_rows as read_pairs

    parts, seen = pairs.split("::"), {}
    files = [read_pairs(part, columns, pooled=True, seen=seen, by_id=bool(corpus)) for part in parts]
    files = resolve_documents(files, parts, corpus, seen, 0.001) if corpus else files
    return [tuple(row) for f in files for row in f.texts]


def read_texts(rows: Sequence[Sequence[str]]) -> tuple[list[str], list[str]]:
    """The distinct query texts and the distinct document texts (positives, then negatives) of the rows, in order."""
    queries = list(dict.fromkeys(row[0] for row in rows))
    docs = list(dict.fromkeys(text for row in rows for text in row[1:]))
    return queries, docs


def sources(rows: Sequence[Sequence[str]]) -> dict[str, str]:
    """Each translation's source in parallel rows (source, translation); a MineError for a row with more texts or
    a translation of two different sources."""
    source: dict[str, str] = {}
    for row in rows:
        if len(row) != 2:
            raise MineError(
                f"--parallel: the row of {row[0]!r} has {len(row) - 2} hard negative(s); parallel sentences are "
                "(source, translation) rows: give --columns source,translation"
            )
        first = source.setdefault(row[1], row[0])
        if first != row[0]:
            raise MineError(
                f"--parallel: {row[1]!r} translates both {first!r} and {row[0]!r}, and one text has one label; "
                "drop one of the rows"
            )
    return source


def prompts(model: Any, query: str | None, doc: str | None) -> tuple[str, str]:
    """The query and document prompts: the given ones, else the model's (sentence-transformers' names)."""
    own = dict(getattr(model, "prompts", None) or {})
    if query is None:
        query = own.get("query", "")
    if doc is None:
        doc = next((own[name] for name in DOCUMENT_PROMPTS if name in own), "")
    return query, doc


def write(
    out: Path, sides: Sequence[tuple[str, list[str], np.ndarray]], metadata: dict[str, str] | None = None
) -> None:
    """(side, texts, their embeddings [n, d]) rows into `out` (`write_rows`)."""
    vectors = np.concatenate([v for _, _, v in sides])
    texts = [t for _, texts, _ in sides for t in texts]
    write_rows(out, [(side, len(texts)) for side, texts, _ in sides], texts, vectors, metadata)


def write_rows(
    out: Path,
    sides: Sequence[tuple[str, int]],
    texts: Any,
    vectors: np.ndarray,
    metadata: dict[str, str] | None = None,
) -> None:
    """Rows into `out` (by its suffix), through a temporary file: `sides` (each side and its number of rows, in order),
    the rows' `texts` (strs, or a pyarrow string array such as `RowSpool.rows` maps) and their `vectors` [N, d] (an
    array mapped from disk is read as the file is written, never held whole); `metadata`: key-value pairs a .parquet or
    .arrow file keeps in its schema (a .jsonl file has none). An .arrow file is one uncompressed record batch: its
    float32 vectors one contiguous block that readers map. The rows of a .parquet or .arrow file are checked as a run
    checks a file it reads whole (a bad one leaves nothing: the file is not renamed), and its index is written beside
    it (`frozen_index`) before it is renamed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    vectors = np.asarray(vectors, dtype=np.float32)  # no copy of float32

    def columnar(tmp: Path) -> None:
        import pyarrow as pa

        named = [pa.repeat(side, n) for side, n in sides]
        table = pa.table(
            {
                "side": pa.concat_arrays(named) if named else pa.array([], pa.string()),
                "text": texts if isinstance(texts, pa.Array) else pa.array(texts, pa.string()),
                "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), vectors.shape[1]),
            }
        )
        table = table.replace_schema_metadata(metadata) if metadata else table
        if out.suffix == ".arrow":
            with pa.ipc.new_file(str(tmp), table.schema) as writer:
                writer.write_table(table)
        else:
            import pyarrow.parquet as pq

            pq.write_table(table, tmp, row_group_size=ROW_GROUP)
        del table
        checked = EmbeddingTable.of_rows(f"--out={out}", sides, texts, vectors)  # after the write (benchmarks/NOTES.md)
        save(out, checked.saved(), tmp)  # its index, naming the file as written (a rename keeps its size and time)

    def jsonl(tmp: Path) -> None:
        named = itertools.chain.from_iterable(itertools.repeat(side, n) for side, n in sides)
        with open(tmp, "w", encoding="utf-8") as f:
            for start in range(0, len(texts), ROW_GROUP):
                part = texts[start : start + ROW_GROUP]
                part = part.to_pylist() if hasattr(part, "to_pylist") else part  # an Arrow array's slice
                for text, vector in zip(part, vectors[start : start + ROW_GROUP].tolist()):
                    row = {"side": next(named), "text": text, "embedding": vector}
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")

    write_atomically(out, jsonl if out.suffix == ".jsonl" else columnar)


def run(opts: argparse.Namespace) -> tuple[Path, int, int, int]:
    """Embed and write; (the file, query texts, document texts, the embeddings' width)."""
    import torch

    from titan_contrastive.mine import device_list, sentence_model
    from titan_contrastive.row_spool import RowSpool

    out = check(opts)
    columns = [c.strip() for c in opts.columns.split(",") if c.strip()]
    rows = read_rows(opts.pairs, columns, opts.corpus)
    queries, docs = read_texts(rows)
    source = sources(rows) if opts.parallel else {}
    devices = device_list(opts.device)
    out.parent.mkdir(parents=True, exist_ok=True)
    with (
        sentence_model(opts.model, opts.tower, devices[0] if devices else None, opts.trust_remote_code) as model,
        RowSpool(["query", "document"], out.parent, 1, torch.device("cpu")) as spool,
    ):
        query_prompt, doc_prompt = prompts(model, opts.query_prompt, opts.doc_prompt)
        pool = model.start_multi_process_pool(devices) if len(devices) > 1 else None  # a process per device

        def encode(block: int, texts: list[str], prompt: str, task: str) -> None:  # a Router's route: the task
            for start in range(0, len(texts), ENCODE_ROWS):
                part = texts[start : start + ENCODE_ROWS]
                vectors = model.encode(
                    part, prompt=prompt, task=task, batch_size=opts.batch_size, convert_to_numpy=True, pool=pool
                )
                spool.send(block, part, torch.from_numpy(vectors))

        try:
            encode(0, queries, query_prompt, "query")
            if opts.parallel:  # each translation its source's row
                where, embedded = {text: i for i, text in enumerate(queries)}, spool.block(0)
                for start in range(0, len(docs), ENCODE_ROWS):
                    part = docs[start : start + ENCODE_ROWS]
                    spool.send(1, part, torch.from_numpy(embedded[[where[source[d]] for d in part]]))
            else:
                encode(1, docs, doc_prompt, "document")
        finally:
            if pool is not None:
                model.stop_multi_process_pool(pool)
        sides, texts, vectors = spool.rows()
        write_rows(out, sides, texts, vectors)
    return out, len(queries), len(docs), vectors.shape[1]


def main(argv: list[str] | None = None) -> int:
    opts = parser().parse_args(argv)
    try:
        out, queries, docs, width = run(opts)
    except ImportError as e:
        print(f"error: {import_failure(e, 'embedding', 'hf,data')}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:  # MineError, DataError, sentence-transformers' own checks
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"wrote {out}: {width}-wide embeddings of {queries} query text(s) and {docs} document text(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
