"""`python -m titan_contrastive.mine PAIRS --model MODEL --out FILE`: hard negatives for your text pairs (for
query-page rows with a Qwen-VL model: `mine_pages.py`).

PAIRS is a pairs file in any format `data.path` reads for `data.dataset = "pairs"` (JSONL, CSV,
TSV, Parquet, a Hugging Face dataset on disk; `datasets.pairs`), with the same column rules
(`--columns` and `--id-column` are `data.pairs_columns` and `data.pairs_id_column`). MODEL embeds
both sides: one of our bi_encoder or static step folders (`.../checkpoint/step-N`, exported for the purpose
through `export --to sentence-transformers`, which checks the export's embeddings against the
run's; a run of two towers embeds the queries with its query tower and the corpus with its doc tower, as its
Router does, unless `--tower` names one for both), a sentence-transformers folder, or a transformers folder
(mean pooling, as
sentence-transformers builds it). A folder's own model code (config.json `auto_map`) runs only with
`--trust-remote-code`; a step folder's runs as its run's did (`[model] trust_remote_code`).

The mining itself is sentence-transformers' `mine_hard_negatives`: every positive of the file is
the corpus (with `--corpus`, every document of a corpus file as `data.corpus` reads it too: a BEIR `corpus.jsonl`,
MS MARCO's `collection.tsv`, tevatron's corpus; `datasets.corpus`); each query's candidates are
the corpus ranked by cosine, without the query's own positives (every row with that query text),
those within `--relative-margin` of the positive's score (NV-Retriever's TopK-PercPos: at 0.05 a
negative scores at most 95 % of the positive; a query with several positives takes the weakest's),
above `--max-score`, below `--min-score` or within `--absolute-margin`; then the first
`--range-min` candidates left are skipped and `--negatives` are taken from the next ones (`top`,
or at random among those up to `--range-max` with `--sampling random`, seeded). With
`--cross-encoder CE` (a sentence-transformers CrossEncoder folder) the candidates the model
retrieved are scored again by CE, and the filters and `--scores` read CE's scores instead.

FILE (`.jsonl`, `.parquet` or `.csv`) holds the rows in the input's order with sentence-transformers'
columns, `anchor`, `positive`, `negative_1` ... `negative_k`, and `id` when the input has an id
column (what `data.pairs_id_column` reads by default); the input's own negative columns are
replaced. With `--ids` the input's documents are ids into `--corpus` (tevatron's
`positive_document_ids` rows, MS MARCO's triples of ids; a positive the corpus lacks is a bad row) and FILE's
positives and negatives are ids too (a negative's text held under several ids: the first): train on it with
`data.corpus` set to that corpus. With `--scores`, a `scores` column holds the model's cosines (or CE's scores) of each
row's positive and negatives (sentence-transformers' `output_scores`): a teacher's scores for
`loss.distill`. A row
for which fewer than k candidates pass the filters is left out (the count is printed). Train on it
with `data.path=FILE`: every row then serves k hard negatives (`data.hard_negatives`).

FILE is written under a temporary name beside it and renamed when complete; it is never an
existing file unless `--overwrite`, and never the input. Bad arguments are one `error: ...` line
and exit code 2, before any model is loaded. Needs the `hf` and `data` extras.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from titan_contrastive.extras import import_failure
from titan_contrastive.mining import MineError, mine, write_rows

OUT_FORMATS = (".jsonl", ".parquet", ".csv")


def check_options(opts: argparse.Namespace) -> None:
    """A MineError for numbers that cannot select `--negatives` candidates (before any file is read)."""
    if opts.negatives < 1:
        raise MineError(f"--negatives={opts.negatives}: mine at least 1 negative per row")
    if opts.range_min < 0:
        raise MineError(f"--range-min={opts.range_min}: the number of top candidates to skip is 0 or more")
    if opts.range_max is not None and opts.range_max - opts.range_min < opts.negatives:
        raise MineError(
            f"--range-max={opts.range_max}: with --range-min={opts.range_min} it leaves "
            f"{max(0, opts.range_max - opts.range_min)} candidates for --negatives={opts.negatives}; raise --range-max"
        )
    if opts.relative_margin is not None and not 0 <= opts.relative_margin < 1:
        raise MineError(
            f"--relative-margin={opts.relative_margin}: a fraction of the positive's score in [0, 1) (0.05: a "
            "negative scores at most 95 % of its positive)"
        )
    if opts.absolute_margin is not None and opts.absolute_margin < 0:
        raise MineError(f"--absolute-margin={opts.absolute_margin}: a cosine margin of 0 or more")
    if opts.batch_size < 1:
        raise MineError(f"--batch-size={opts.batch_size}: texts per forward, 1 or more")
    filters = (opts.relative_margin, opts.absolute_margin, opts.max_score, opts.min_score)
    if opts.cross_encoder and all(f is None for f in filters):
        raise MineError(
            f"--cross-encoder={opts.cross_encoder}: it scores the candidates the filters judge, and no filter is "
            "set (--relative-margin none); set one (e.g. --max-score) or leave out the cross-encoder"
        )
    if opts.cross_encoder and not (Path(opts.cross_encoder).expanduser() / "config.json").is_file():
        raise MineError(f"--cross-encoder={opts.cross_encoder}: not a cross-encoder folder (no config.json)")


def check_paths(pairs: str, out: Path, overwrite: bool) -> Path:
    """The resolved output file, or a MineError for an input that is not there or an output that may
    not be written."""
    from titan_contrastive.datasets.formats import data_suffix, formats_named
    from titan_contrastive.datasets.pair_rows import FORMATS

    src = Path(pairs).expanduser()
    if "::" in pairs:
        raise MineError(f"PAIRS={pairs}: mine one file at a time (each file's positives are its own corpus)")
    if not (src.is_dir() or (src.is_file() and data_suffix(src) in FORMATS)):
        raise MineError(f"PAIRS={pairs}: not an existing {formats_named(FORMATS)} file or save_to_disk folder")
    out = Path(out).expanduser()
    if out.suffix not in OUT_FORMATS:
        raise MineError(f"--out={out}: write {'/'.join(OUT_FORMATS)} (the formats data.path reads back)")
    if out.resolve() == src.resolve():
        raise MineError(f"--out={out} is the input; write the mined rows to a new file")
    if out.is_dir() or out.is_symlink():
        raise MineError(f"--out={out} is a folder or a link; give a file name")
    if out.exists() and not overwrite:
        raise MineError(f"--out={out} exists; choose a new file or pass --overwrite")
    return out


@contextlib.contextmanager
def sentence_model(path: str, tower: str | None, device: str | None, trust: bool = False) -> Iterator[Any]:
    """A SentenceTransformer of `path` ('': the bundled MiniLM): one of our bi_encoder or static step folders through
    a verified export into a temporary folder (removed after; its own code runs as its run's did), else a
    sentence-transformers or transformers folder (its own code runs with `trust`)."""
    from sentence_transformers import SentenceTransformer

    if not path:  # as evaluate reads it: the bundled all-MiniLM-L6-v2
        from titan_contrastive.models.bi_encoder.folder import bundled_minilm

        path = str(bundled_minilm())
    folder = Path(path).expanduser()
    manifest = folder / "manifest.json"
    if manifest.is_file():
        try:
            model = json.loads(manifest.read_text())["model"]
            family = model["family"]
            trust = bool(model["args"].get("trust_remote_code", False))
        except (OSError, ValueError, KeyError, TypeError):
            raise MineError(
                f"--model={path}: its manifest.json names no model; give a step folder of this version"
            ) from None
        if family not in ("bi_encoder", "static"):
            raise MineError(
                f"--model={path}: a {family} checkpoint; mining embeds texts with a bi_encoder or static one"
            )
        pooling = model["args"].get("pooling")
        if pooling in ("splade", "colbert"):
            raise MineError(
                f"--model={path}: a {pooling} run (model.pooling={pooling!r}), and sentence-transformers' miner ranks "
                f"dense embeddings by cosine; mine with a dense model and train {pooling} on its negatives"
            )
        from titan_contrastive.export import export

        with tempfile.TemporaryDirectory(prefix="titan_contrastive_mine-") as tmp:
            out = export(str(folder), Path(tmp) / "model", "sentence-transformers", tower=tower)
            yield SentenceTransformer(str(out), device=device, trust_remote_code=trust)
        return
    if not ((folder / "modules.json").is_file() or (folder / "config.json").is_file()):
        raise MineError(
            f"--model={path}: not a bi_encoder step folder (manifest.json), a sentence-transformers folder "
            "(modules.json) or a transformers folder (config.json)"
        )
    yield SentenceTransformer(str(folder), device=device, trust_remote_code=trust)


def as_ids(
    mined: list[list[Any] | None], positives: list[str], documents: dict[str, str], k: int, fewer: bool
) -> list[list[Any] | None]:
    """The mined rows (`mining.mine`'s) with their documents as ids into the corpus `documents` ({id: text}): each
    row's own positive id, and for a negative the first id holding its text."""
    first: dict[str, str] = {}
    for ident, text in documents.items():
        first.setdefault(text, ident)
    out: list[list[Any] | None] = []
    for row, positive in zip(mined, positives):
        if row is None:
            out.append(None)
            continue
        negatives = [[first[t] for t in row[2]]] if fewer else [first[t] for t in row[2 : 2 + k]]
        out.append([row[0], positive, *negatives, *row[3 if fewer else 2 + k :]])
    return out


def device_list(text: str | None) -> list[str]:
    """`--device`'s devices: none (sentence-transformers' choice), one, or several (a process each, comma-separated)."""
    return [d.strip() for d in (text or "").split(",") if d.strip()]


def number_or_none(text: str) -> float | None:
    """A float, or None for "none" (no such filter)."""
    return None if text.strip().lower() == "none" else float(text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m titan_contrastive.mine", description=__doc__.split("\n\n")[0])
    p.add_argument("pairs", metavar="PAIRS", help="a pairs file (query, positive[, negatives...]) as data.path reads")
    p.add_argument(
        "--model",
        required=True,
        help="a bi_encoder or static step folder, or a sentence-transformers / transformers folder ('': the bundled "
        "all-MiniLM-L6-v2)",
    )
    p.add_argument("--out", type=Path, required=True, help="the file to write: .jsonl, .parquet or .csv")
    p.add_argument("--negatives", type=int, default=1, help="negatives per row (default: 1)")
    p.add_argument(
        "--keep-fewer",
        action="store_true",
        help="keep rows where 1 to --negatives candidates pass, their negatives as a list (train with "
        "data.negatives_per_row); default: rows with fewer are left out",
    )
    p.add_argument("--range-min", type=int, default=0, help="skip this many top candidates (default: 0)")
    p.add_argument("--range-max", type=int, default=None, help="consider candidates up to this rank (default: derived)")
    p.add_argument(
        "--relative-margin",
        type=number_or_none,
        default=0.05,
        help="drop candidates scoring above (1 - m) x the positive (default: 0.05, NV-Retriever's TopK-PercPos; "
        "none: no such filter)",
    )
    p.add_argument("--absolute-margin", type=float, default=None, help="drop candidates within m of the positive")
    p.add_argument("--max-score", type=float, default=None, help="drop candidates scoring above this cosine")
    p.add_argument("--min-score", type=float, default=None, help="drop candidates scoring below this cosine")
    p.add_argument("--sampling", choices=("top", "random"), default="top", help="the best candidates, or random ones")
    p.add_argument("--seed", type=int, default=0, help="seed of --sampling random (default: 0)")
    p.add_argument(
        "--corpus",
        default="",
        help="also mine from this corpus file (id and text rows, as data.corpus reads), or for a page model every "
        "image below this folder (default: the positives only)",
    )
    p.add_argument(
        "--image-root",
        default="",
        help="page rows: the folder their relative page paths start from (data.image_root; default: the rows' folder)",
    )
    p.add_argument(
        "--image-cache",
        default="",
        help="page rows: where the images held in their cells are written (data.image_cache; default: your cache)",
    )
    p.add_argument(
        "--ids",
        action="store_true",
        help="the rows' documents are ids into --corpus (as with data.corpus); the mined ones are written as ids",
    )
    p.add_argument("--columns", default="", help="query,positive column names (data.pairs_columns); default: in order")
    p.add_argument("--id-column", default="id", help="the positive's id column (data.pairs_id_column), written as `id`")
    p.add_argument("--query-prompt", default=None, help="text before each query (default: the model's 'query' prompt)")
    p.add_argument("--doc-prompt", default=None, help="text before each document (default: the model's 'document' one)")
    p.add_argument(
        "--tower",
        choices=("query", "doc"),
        default=None,
        help="a checkpoint with two towers: embed both sides with this one (default: each side with its own)",
    )
    p.add_argument("--batch-size", type=int, default=64, help="texts per forward (default: 64)")
    p.add_argument(
        "--device",
        default=None,
        help="cpu, cuda, cuda:1 ..., or several (cuda:0,cuda:1): one encoding process each (default: "
        "sentence-transformers' choice of one)",
    )
    p.add_argument(
        "--cross-encoder", default="", help="a CrossEncoder folder that scores the candidates again (default: none)"
    )
    p.add_argument(
        "--scores", action="store_true", help="also write the scores of the positive and negatives (teacher scores)"
    )
    p.add_argument(
        "--trust-remote-code", action="store_true", help="run the code a model folder ships (config.json auto_map)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace --out when it exists")
    return p


def run(opts: argparse.Namespace) -> tuple[Path, int, int]:
    """Mine and write; (the file, rows written, rows left out)."""
    from titan_contrastive.datasets.corpus import corpus_texts, resolved
    from titan_contrastive.datasets.pair_rows import read_rows

    check_options(opts)
    out = check_paths(opts.pairs, opts.out, opts.overwrite)
    if opts.keep_fewer and out.suffix == ".csv":
        raise MineError(f"--out={out}: --keep-fewer writes each row's negatives as a list; write .jsonl or .parquet")
    from titan_contrastive.mine_pages import is_page_model, run_pages

    if is_page_model(opts.model):  # a qwen_vl run or a Qwen-VL folder: negative pages for query-page rows
        if opts.ids:
            raise MineError(f"--ids: --model={opts.model} mines pages, which are files, not ids; leave --ids out")
        return run_pages(opts, out)
    for given in ("image_root", "image_cache"):
        if getattr(opts, given):
            flag = "--" + given.replace("_", "-")
            raise MineError(f"{flag}: for page rows; --model={opts.model} mines texts, leave it out")
    columns = [c.strip() for c in opts.columns.split(",") if c.strip()]
    if columns and len(columns) != 2:
        raise MineError(f"--columns={opts.columns}: name two columns, the query's and the positive's")
    if opts.ids and not opts.corpus:
        raise MineError("--ids: the rows' documents are ids into a corpus; give its file with --corpus")
    read = read_rows(opts.pairs, columns, opts.id_column, by_id=opts.ids)
    if len(read.texts[0]) > 2:
        print(f"{opts.pairs}: its {len(read.texts[0]) - 2} negative column(s) are replaced by the mined ones")
    documents = corpus_texts(opts.corpus, None, {}, "--corpus") if opts.corpus else {}
    positives = [row[1] for row in read.texts if row[1] in documents] if opts.ids else []  # the rows resolved keeps
    if opts.ids:  # bad rows past data.max_bad_fraction's default stop it, as they stop a run
        pairs = read._replace(texts=[row[:2] for row in read.texts])
        read = resolved(pairs, opts.pairs, f"--corpus={opts.corpus}", documents, 0.001)
    devices = device_list(opts.device)
    cross_encoder = None
    if opts.cross_encoder:
        from sentence_transformers import CrossEncoder

        cross_encoder = CrossEncoder(str(Path(opts.cross_encoder).expanduser()), device=devices[0] if devices else None)
    with sentence_model(opts.model, opts.tower, devices[0] if devices else None, opts.trust_remote_code) as model:
        mined = mine(
            read.texts,
            model,
            opts,
            list(dict.fromkeys(documents.values())),  # a text under several ids is one candidate
            pool=devices if len(devices) > 1 else None,
            cross_encoder=cross_encoder,
        )
    if opts.ids:
        mined = as_ids(mined, positives, documents, opts.negatives, opts.keep_fewer)
    kept = [(row, i) for row, i in zip(mined, read.ids or [None] * len(mined)) if row is not None]
    if not kept:
        raise MineError(
            f"--negatives={opts.negatives}: no row has {'a candidate' if opts.keep_fewer else 'that many candidates'} "
            "passing the filters; loosen --relative-margin / --max-score / --range-min, or raise --range-max"
        )
    negatives = ["negatives"] if opts.keep_fewer else [f"negative_{i}" for i in range(1, opts.negatives + 1)]
    names = ["anchor", "positive", *negatives]
    names += ["scores"] if opts.scores else []
    with_ids = read.ids is not None
    rows = [[*row, i] if with_ids else row for row, i in kept]
    write_rows(out, [*names, "id"] if with_ids else names, rows)  # "id": data.pairs_id_column's default
    return out, len(kept), len(mined) - len(kept)


def main(argv: list[str] | None = None) -> int:
    opts = parser().parse_args(argv)
    try:
        out, written, left = run(opts)
    except ImportError as e:
        print(f"error: {import_failure(e, 'mining', 'hf,data')}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:  # MineError, DataError, WeightsError, sentence-transformers' own checks
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    need = "no candidate" if opts.keep_fewer else f"fewer than {opts.negatives} candidate(s)"
    note = f"; {left} row(s) left out: {need} passed the filters" if left else ""
    scores = " and their scores" if opts.scores else ""
    each = f"{opts.negatives} mined negative(s) each"
    each = (
        f"1 to {opts.negatives} mined negatives each (data.negatives_per_row draws from them)"
        if opts.keep_fewer
        else each
    )
    ids = f"; its documents are ids: train with data.corpus={opts.corpus}" if opts.ids else ""
    print(f"wrote {out}: {written} row(s) with {each}{scores}{note}{ids}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
