"""Hard negative pages for query-page rows: `python -m titan_contrastive.mine ROWS --model MODEL --out FILE` where
MODEL is a qwen_vl step folder or a Qwen-VL folder (a ColQwen one too: late interaction, scored by MaxSim).

ROWS is a `vl_pairs` file of the t2i kind (`.jsonl`, `.csv`, `.tsv`, `.parquet`: `query_text` and `doc_image`, or
VLM2Vec's `qry` and `pos_image_path`, or colpali-engine's `query` and `image`; image paths relative to the file's
folder, or the pages held in the cells, written once to `--image-cache`; `datasets.vl_pairs`). Every distinct
page of the file is the corpus, and with `--corpus DIR` every image below DIR too (the pages of your documents that
no query names); each query's candidates are the pages ranked by the model (queries and pages embedded as the run
embeds them: `beir_eval.side_embedders`), without the query's own pages (every row with that query text), filtered
and taken as for text pairs (`--relative-margin`, `--range-min`, `--sampling`, ...): the mining is
sentence-transformers' `mine_hard_negatives`, to which `PageEncoder` presents the model as the encoder it calls.

FILE (`.jsonl` or `.parquet`; `.csv` for one negative) holds the rows in the input's order with `query_text`,
`doc_image` and `doc_negatives` (the mined pages), every path relative to FILE's folder (an absolute one stays
absolute): train on it with `data.dataset = "vl_pairs"`, `data.path = FILE`, `data.hard_negatives = true`.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from titan_contrastive.mining import MineError, mine, write_rows

COLUMNS = ("query_text", "doc_image")
TEXT_ONLY = ("cross_encoder", "scores", "tower", "query_prompt", "doc_prompt")
"""mine's options for text pairs that a page model does not take (its templates are its run's)."""


def is_page_model(path: str) -> bool:
    """Whether `path` is a qwen_vl step folder or a Qwen-VL model folder."""
    from titan_contrastive.evaluate import is_vl_folder

    manifest = Path(path).expanduser() / "manifest.json"
    if manifest.is_file():
        try:
            return json.loads(manifest.read_text())["model"]["family"] == "qwen_vl"
        except (OSError, ValueError, KeyError, TypeError):
            return False
    return is_vl_folder(path)


class PageEncoder:
    """A qwen_vl model (in eval mode, with its `SideProcessor`) behind the calls sentence-transformers' miner makes
    of a SentenceTransformer: `encode_query` (texts), `encode_document` (page paths, read relative to `root`),
    `similarity` and `similarity_pairwise` (the dot product of the unit vectors, or MaxSim of ColQwen's tokens)."""

    def __init__(self, model: Any, process: Any, root: Path, device: torch.device, dtype: torch.dtype) -> None:
        from titan_contrastive.components.beir_eval import device_forward, side_embedders

        self.model, self.process, self.root, self.device, self.dtype = model, process, root, device, dtype
        self.token_dim = int(getattr(model, "token_dim", 0))
        self._queries, self._pages = side_embedders(device_forward(model, device, dtype), process)

    def _encode(self, embed: Any, items: Sequence[Any], batch_size: int) -> np.ndarray:
        from titan_contrastive.components.beir_eval import embed_texts

        with torch.no_grad():
            rows = embed_texts(embed, items, batch_size=batch_size, rank=0, world_size=1)
        return rows.double().cpu().numpy()

    def encode_query(self, texts: Sequence[str], batch_size: int = 32, **_: Any) -> np.ndarray:
        return self._encode(self._queries, list(texts), batch_size)

    def encode_document(self, paths: Sequence[str], batch_size: int = 32, **_: Any) -> np.ndarray:
        from titan_contrastive.datasets.beir_folder import CorpusImages

        files = [str(self.root / p) for p in paths]  # an absolute path stays as it is
        return self._encode(self._pages, CorpusImages(list(paths), files), batch_size)

    def similarity(self, queries: Any, pages: Any) -> torch.Tensor:
        q, p = torch.as_tensor(queries), torch.as_tensor(pages)
        if not self.token_dim:
            return q @ p.T
        from titan_contrastive.losses.maxsim import scores

        return scores(q, p, dim=self.token_dim)

    def similarity_pairwise(self, queries: Any, pages: Any) -> torch.Tensor:
        q, p = torch.as_tensor(queries), torch.as_tensor(pages)
        return (
            torch.stack([self.similarity(a[None], b[None])[0, 0] for a, b in zip(q, p)]) if len(q) else q.new_zeros(0)
        )

    def get_embedding_dimension(self) -> int:
        raise MineError("--model: a page model's embeddings are searched exactly; FAISS is not used for them")


def read_pairs(path: Path, cache: str = "") -> list[tuple[str, str]]:
    """(query text, page path) of each row of a t2i `vl_pairs` file (or of VLM2Vec's or colpali-engine's columns,
    `vl_rows`), a page held in its cell written to `cache` (`held_images`; "": the default folder) and named by that
    file's absolute path; or a MineError naming the row."""
    from titan_contrastive.datasets.held_images import ImageStore, default_folder
    from titan_contrastive.datasets.tables import guarded_rows, opened_rows
    from titan_contrastive.datasets.vl_rows import from_colpali, from_vlm2vec

    _, read = opened_rows(path, COLUMNS, "train")
    rows = guarded_rows(path, read)  # a row at a time: a page held in its cell is let go once written
    store, pairs = ImageStore(cache or default_folder()), []
    for n, row in enumerate(rows):
        row = from_colpali(from_vlm2vec(row, "image")) if isinstance(row, dict) else row
        row = {**row, "doc_image": store.path(row.get("doc_image"))} if isinstance(row, dict) else row
        if not isinstance(row, dict) or not all(isinstance(row.get(c), str) and row[c].strip() for c in COLUMNS):
            raise MineError(
                f"ROWS={path}: row {n} has no {' and '.join(COLUMNS)}; a page model mines t2i rows (a query's text "
                "and its page's image path, relative to the file's folder)"
            )
        pairs.append((row["query_text"].strip(), os.path.normpath(row["doc_image"].strip())))
    return pairs


def corpus_pages(corpus: str, root: Path, named: Sequence[str] = ()) -> list[str]:
    """Every image below the folder `corpus` (recursively, sorted), as a path relative to `root` (the rows' folder,
    as the rows name their pages), or as the rows name it where it is one of their pages `named` (relative to
    `root`, or absolute); or a MineError."""
    from titan_contrastive.datasets.sources import IMAGE_EXTENSIONS

    folder = Path(corpus).expanduser()
    if not folder.is_dir():
        raise MineError(f"--corpus={corpus}: not a folder; a page model mines from a folder of page images")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower().lstrip(".") in IMAGE_EXTENSIONS)
    if not files:
        raise MineError(
            f"--corpus={corpus}: no images ({', '.join(IMAGE_EXTENSIONS)}) below it; give the pages' folder"
        )
    base = os.path.abspath(root)
    spelled = {os.path.normpath(os.path.join(base, page)): page for page in named}  # an absolute page joins as itself
    return [spelled.get(os.path.abspath(p), os.path.relpath(os.path.abspath(p), base)) for p in files]


def run_pages(opts: argparse.Namespace, out: Path) -> tuple[Path, int, int]:
    """Mine and write (`mine.run` for a page model); (the file, rows written, rows left out)."""
    given = [f"--{o.replace('_', '-')}" for o in TEXT_ONLY if getattr(opts, o, None)]
    if given:
        raise MineError(f"{' '.join(given)}: for text pairs; --model={opts.model} mines pages, leave it out")
    if out.suffix == ".csv" and opts.negatives > 1:
        raise MineError(
            f"--out={out}: a CSV cell holds one negative page; write .jsonl or .parquet for {opts.negatives}"
        )
    src = Path(opts.pairs).expanduser()
    root = Path(opts.image_root).expanduser() if opts.image_root else src.parent
    if not root.is_dir():
        raise MineError(
            f"--image-root={opts.image_root}: no such folder; give the folder the rows' page paths start from"
        )
    pairs = read_pairs(src, opts.image_cache)
    corpus = corpus_pages(opts.corpus, root, [page for _, page in pairs]) if opts.corpus else None
    encoder = page_encoder(opts, root)
    mined = mine([list(p) for p in pairs], encoder, opts, corpus)
    kept = [row for row in mined if row is not None]
    if not kept:
        raise MineError(
            f"--negatives={opts.negatives}: no row has that many candidates passing the filters; loosen "
            "--relative-margin / --max-score / --range-min, or raise --range-max"
        )

    def moved(path: str) -> str:  # relative to the output's folder, as vl_pairs reads it (or still to --image-root)
        if os.path.isabs(path) or opts.image_root:
            return path
        return os.path.relpath((src.parent / path).resolve(), out.parent.resolve())

    rows = []
    for query, page, *found in kept:
        negatives = [moved(p) for p in (found[0] if opts.keep_fewer else found)]
        rows.append([query, moved(page), negatives[0] if out.suffix == ".csv" else negatives])
    write_rows(out, [*COLUMNS, "doc_negatives"], rows)
    return out, len(kept), len(mined) - len(kept)


def page_encoder(opts: argparse.Namespace, root: Path) -> PageEncoder:
    """The `PageEncoder` of `--model`: a qwen_vl step folder (its run's templates and sizes) or a Qwen-VL folder
    (`evaluate.load_vl_model`: the default templates, a ColQwen folder's projection), t2i."""
    from titan_contrastive.evaluate import load_text_model, load_vl_model

    if (Path(opts.model).expanduser() / "manifest.json").is_file():
        args, model = load_text_model(opts.model, 0, 0)
    else:
        args, model = load_vl_model(opts.model)
    process = args.processor()
    if process.kinds != {"query": "text", "doc": "image"}:
        raise MineError(f"--model={opts.model}: a {args.mode} run; page mining reads t2i ones (text queries, pages)")
    devices = [d.strip() for d in (opts.device or "").split(",") if d.strip()]
    device = torch.device(devices[0] if devices else "cuda" if torch.cuda.is_available() else "cpu")
    return PageEncoder(model.to(device), process, root, device, next(model.parameters()).dtype)
