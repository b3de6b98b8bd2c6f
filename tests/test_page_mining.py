"""Hard negative pages mined for query-page rows by a Qwen-VL model (`mine_pages.py`, through
`python -m titan_contrastive.mine`): sentence-transformers' miner over `PageEncoder` picks, for each row, the pages
the definition picks (every distinct page of the file, without the query's own, ranked by the model's score of each
query and page embedded alone: the dot product, or MaxSim for a ColQwen folder; float64); the file it writes trains
as `vl_pairs` rows with hard negatives (with `--keep-fewer`, rows of fewer, drawn from per epoch); what a page model
cannot take is one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.hf_folders import vl_folder
from tests.needs import require
from tests.test_page_retrieval import _colqwen_folder, alone
from tests.test_qwen_vl import vl_run

require("hf")
require("data")

ROWS = [
    ("small cat", "p0.png"),
    ("the piano with black keys", "p1.png"),
    ("small cat", "p2.png"),  # a second page of one query: both are its positives
    ("a car on the water", "p3.png"),
    ("winter snow", "p4.png"),
    ("a dog with a pilot", "p5.png"),
    ("a guitar", "p1.png"),  # a page two queries share: one document of the corpus
]
SHAPES = ((28, 56), (56, 56), (84, 28), (28, 28), (56, 84), (56, 28))


def rows_file(root: Path) -> Path:
    """The rows as a vl_pairs JSONL beside `pages/`, six pages of different shapes."""
    rng = np.random.default_rng(5)
    (root / "pages").mkdir(parents=True)
    for i, shape in enumerate(SHAPES):
        Image.fromarray(rng.integers(0, 256, (*shape, 3), dtype=np.uint8)).save(root / "pages" / f"p{i}.png")
    lines = [json.dumps({"query_text": q, "doc_image": f"pages/{p}"}) for q, p in ROWS]
    (root / "rows.jsonl").write_text("\n".join(lines) + "\n")
    return root / "rows.jsonl"


def options(rows: Path, model: Path, out: Path, *extra: str):
    from titan_contrastive.mine import parser

    return parser().parse_args([str(rows), "--model", str(model), "--out", str(out), *extra])


def assert_the_definitions_choice(rows: Path, folder: Path, k: int, corpus: list[str] | None = None) -> None:
    """Mine k negatives for `rows` with the model of `folder` in float64 (and `corpus`'s pages): each row's are the
    pages (the rows' and the corpus's) that the score of each query and page embedded alone ranks first, without the
    query's own pages."""
    from titan_contrastive.datasets.beir_folder import BeirSet, CorpusImages
    from titan_contrastive.mine_pages import PageEncoder, page_encoder, read_pairs
    from titan_contrastive.mining import mine

    opts = options(rows, folder, rows.parent / "out.jsonl", "--negatives", str(k), "--relative-margin", "none")
    built = page_encoder(opts, rows.parent)
    model = built.model.double()
    encoder = PageEncoder(model, built.process, rows.parent, torch.device("cpu"), torch.float64)
    pairs = read_pairs(rows)
    mined = mine([list(p) for p in pairs], encoder, opts, corpus)

    pages, queries = sorted({p for _, p in pairs} | set(corpus or ())), sorted({q for q, _ in pairs})
    images = CorpusImages(pages, [str(rows.parent / p) for p in pages])
    scores = alone(model, built.process, BeirSet(queries, queries, pages, [""] * len(pages), {}, images))
    for (query, page), got in zip(pairs, mined):
        own = {p for q, p in pairs if q == query}
        row = scores[queries.index(query)]
        ranked = sorted((p for p in pages if p not in own), key=lambda p: -row[pages.index(p)].item())
        assert got == [query, page, *ranked[:k]], (query, page)


@pytest.mark.parametrize("colqwen", [False, True], ids=["qwen2_vl", "colqwen"])
def test_mined_pages_are_the_definitions_choice(tmp_path: Path, colqwen: bool) -> None:
    from titan_contrastive.mine_pages import page_encoder

    folder = _colqwen_folder(tmp_path) if colqwen else vl_folder(tmp_path, "qwen2_vl", dropout=0.0)
    rows = rows_file(tmp_path / "data")
    built = page_encoder(options(rows, folder, tmp_path / "out.jsonl"), rows.parent)
    assert built.token_dim == (8 if colqwen else 0)
    assert_the_definitions_choice(rows, folder, 2)


def test_a_corpus_folder_adds_its_pages(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`--corpus DIR`: every image below DIR joins the candidates, a positive found there under another spelling
    (the rows name one page `./pages/p4.png`) once; the picks are the definition's over that union (float64), and
    the command writes them relative to its output, every corpus page a file."""
    from titan_contrastive.mine import main
    from titan_contrastive.mine_pages import corpus_pages, read_pairs

    folder = vl_folder(tmp_path, "qwen2_vl", dropout=0.0)
    rows = rows_file(tmp_path / "data")
    rows.write_text(rows.read_text().replace('"pages/p4.png"', '"./pages/p4.png"'))
    rng = np.random.default_rng(9)
    (rows.parent / "scans" / "sub").mkdir(parents=True)
    for name, shape in (("scans/e0.png", (28, 84)), ("scans/sub/e1.jpg", (84, 56))):
        Image.fromarray(rng.integers(0, 256, (*shape, 3), dtype=np.uint8)).save(rows.parent / name)
    (rows.parent / "scans" / "notes.txt").write_text("not a page")
    corpus = corpus_pages(str(rows.parent), rows.parent)
    assert corpus == [*(f"pages/p{i}.png" for i in range(6)), "scans/e0.png", "scans/sub/e1.jpg"]
    absolute = str(rows.parent / "pages" / "p1.png")  # a row naming its page by an absolute path: that spelling
    assert corpus_pages(str(rows.parent), rows.parent, [absolute])[1:3] == [absolute, "pages/p2.png"]

    assert read_pairs(rows)[4] == ("winter snow", "pages/p4.png")
    theirs = rows.parent / "vlm2vec.jsonl"  # VLM2Vec's t2i columns, the instruction's placeholder in pos_text
    lines = [json.loads(line) for line in rows.read_text().splitlines()]
    entries = [
        {"qry": r["query_text"], "pos_text": "<|image_1|> Represent the page.", "pos_image_path": r["doc_image"]}
        for r in lines
    ]
    theirs.write_text("".join(json.dumps(r) + "\n" for r in entries))
    assert read_pairs(theirs) == read_pairs(rows)
    assert_the_definitions_choice(rows, folder, 6, corpus)  # 6 of 6 or 7 candidates: a scanned page among them

    out = tmp_path / "mined" / "rows.jsonl"
    argv = [str(rows), "--model", str(folder), "--out", str(out), "--negatives", "6", "--relative-margin", "none"]
    assert main([*argv, "--corpus", str(rows.parent)]) == 0
    assert "7 row(s) with 6 mined negative(s) each" in capsys.readouterr().out
    written = [json.loads(line) for line in out.read_text().splitlines()]
    for r in written:
        negatives = r["doc_negatives"]
        assert len(set(negatives)) == 6 and r["doc_image"] not in negatives
        assert any("scans" in n for n in negatives) and all((out.parent / n).is_file() for n in negatives)


def test_the_mined_file_trains_as_vl_pairs_with_hard_negatives(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The command writes the rows with their negatives, paths relative to the output's folder; a t2i run reads
    them back, each row's two negative pages packed beside its positive."""
    from titan_contrastive.mine import main

    folder = vl_folder(tmp_path, "qwen2_vl", dropout=0.0)
    rows = rows_file(tmp_path / "data")
    out = tmp_path / "mined" / "rows.jsonl"
    assert (
        main([str(rows), "--model", str(folder), "--out", str(out), "--negatives", "2", "--relative-margin", "none"])
        == 0
    )
    assert f"wrote {out}: 7 row(s) with 2 mined negative(s) each" in capsys.readouterr().out
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["query_text"], r["doc_image"]) for r in written] == [(q, f"../data/pages/{p}") for q, p in ROWS]
    assert all(len(r["doc_negatives"]) == 2 and r["doc_image"] not in r["doc_negatives"] for r in written)
    assert all((out.parent / n).is_file() for r in written for n in r["doc_negatives"])
    trainer = vl_run(
        tmp_path,
        "qwen2_vl",
        "--data.dataset=vl_pairs",
        f"--data.path={out}",
        "--data.hard_negatives=true",
        "--training.local_batch_size=3",
        sizes=(),
    )
    batch = trainer.train_set.__getitems__([0, 1, 2])
    assert batch["neg"].shape[:2] == (3, 2) and len(batch["neg_image_grid_thw"]) == 6
    trainer.metrics.close()


def test_rows_apart_from_their_pages_mine_and_train_through_the_image_root(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Rows kept apart from their pages (`--image-root`, `data.image_root`): the mined negatives are the ones mined
    beside the pages, their paths still relative to that root, and a run given the root reads them."""
    from titan_contrastive.mine import main

    folder = vl_folder(tmp_path, "qwen2_vl", dropout=0.0)
    rows = rows_file(tmp_path / "data")
    (tmp_path / "annotations").mkdir()
    apart = rows.rename(tmp_path / "annotations" / "rows.jsonl")
    argv = ["--model", str(folder), "--negatives", "2", "--relative-margin", "none"]
    assert main([str(apart), *argv, "--out", str(tmp_path / "a.jsonl"), "--image-root", str(tmp_path / "data")]) == 0
    beside = tmp_path / "data" / "rows.jsonl"
    beside.write_text(apart.read_text())
    assert main([str(beside), *argv, "--out", str(tmp_path / "data" / "b.jsonl")]) == 0
    capsys.readouterr()
    mined, reference = (
        [json.loads(line) for line in f.read_text().splitlines()]
        for f in (tmp_path / "a.jsonl", tmp_path / "data" / "b.jsonl")
    )
    assert mined == reference and all(n.startswith("pages/") for r in mined for n in r["doc_negatives"])
    trainer = vl_run(
        tmp_path,
        "qwen2_vl",
        "--data.dataset=vl_pairs",
        f"--data.path={tmp_path / 'a.jsonl'}",
        f"--data.image_root={tmp_path / 'data'}",
        "--training.local_batch_size=3",
        sizes=(),
    )
    batch = trainer.train_set.__getitems__([0, 1, 2])
    assert batch["neg"].shape[:2] == (3, 2) and len(batch["neg_image_grid_thw"]) == 6
    trainer.metrics.close()


def test_keep_fewer_keeps_a_query_with_fewer_pages_to_draw_from(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--keep-fewer with 5 negatives of 6 pages: the query with two pages of its own keeps the 4 others (left out
    without the flag), every other row 5; a run draws 2 of each row's per epoch (data.negatives_per_row)."""
    from titan_contrastive.mine import main

    folder = vl_folder(tmp_path, "qwen2_vl", dropout=0.0)
    rows = rows_file(tmp_path / "data")
    out = tmp_path / "mined" / "rows.jsonl"
    argv = [str(rows), "--model", str(folder), "--out", str(out), "--negatives", "5", "--relative-margin", "none"]
    assert main([*argv, "--keep-fewer"]) == 0
    assert f"wrote {out}: 7 row(s) with 1 to 5 mined negatives each" in capsys.readouterr().out
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [len(r["doc_negatives"]) for r in written] == [4, 5, 4, 5, 5, 5, 5]
    assert main([*argv, "--overwrite"]) == 0
    assert "5 row(s) with 5 mined negative(s) each; 2 row(s) left out" in capsys.readouterr().out
    assert main([*argv, "--overwrite", "--keep-fewer"]) == 0
    trainer = vl_run(
        tmp_path,
        "qwen2_vl",
        "--data.dataset=vl_pairs",
        f"--data.path={out}",
        "--data.negatives_per_row=2",
        "--training.local_batch_size=3",
        sizes=(),
    )
    batch = trainer.train_set.__getitems__([0, 1, 2])
    assert batch["neg"].shape[:2] == (3, 2) and len(batch["neg_image_grid_thw"]) == 6
    trainer.metrics.close()


def test_what_page_mining_cannot_take_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from titan_contrastive.mine import main

    folder = vl_folder(tmp_path, "qwen2_vl", dropout=0.0)
    rows = rows_file(tmp_path / "data")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"query_text": "small cat", "doc_text": "a page as text"}) + "\n")
    cases = [
        ([str(rows), "--scores"], "--scores: for text pairs;"),
        ([str(rows), "--query-prompt", "query: "], "--query-prompt: for text pairs;"),
        ([str(rows), "--negatives", "2", "--out", str(tmp_path / "o.csv")], "a CSV cell holds one negative page"),
        ([str(bad)], "row 0 has no query_text and doc_image"),
        ([str(rows), "--corpus", str(rows)], f"--corpus={rows}: not a folder; a page model mines from a folder"),
        ([str(rows), "--corpus", str(tmp_path / "empty")], "no images (jpg, jpeg, png, webp) below it"),
        ([str(rows), "--image-root", str(tmp_path / "nope")], f"--image-root={tmp_path / 'nope'}: no such folder"),
    ]
    (tmp_path / "empty").mkdir()
    for argv, message in cases:
        out = [] if "--out" in argv else ["--out", str(tmp_path / "o.jsonl")]
        assert main([*argv, "--model", str(folder), *out]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err and "\n" not in err, err


def test_pages_held_in_the_cells_mine_as_their_files(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """colpali-engine's rows (`query`, a page `image` held in its Parquet cell) mine the pages the same rows with
    their files mine: each page written once to `--image-cache`, the rows naming those files (absolute paths)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from titan_contrastive.mine import main

    folder = vl_folder(tmp_path, "qwen2_vl", dropout=0.0)
    rows = rows_file(tmp_path / "data")
    images = [{"bytes": (rows.parent / "pages" / p).read_bytes(), "path": p} for _, p in ROWS]
    pq.write_table(pa.table({"query": [q for q, _ in ROWS], "image": images}), tmp_path / "held.parquet")
    common = ["--model", str(folder), "--negatives", "2", "--relative-margin", "none"]
    cache = tmp_path / "cache"
    assert main([str(rows), "--out", str(tmp_path / "files.jsonl"), *common]) == 0
    held_rows = [str(tmp_path / "held.parquet"), "--image-cache", str(cache)]
    assert main([*held_rows, "--out", str(tmp_path / "held.jsonl"), *common]) == 0

    def pages(out: Path) -> list[list[bytes]]:  # each row's page and negatives, as the bytes of their files
        written = [json.loads(line) for line in out.read_text().splitlines()]
        return [[(out.parent / p).read_bytes() for p in [r["doc_image"], *r["doc_negatives"]]] for r in written]

    assert pages(tmp_path / "held.jsonl") == pages(tmp_path / "files.jsonl")
    held = [json.loads(line) for line in (tmp_path / "held.jsonl").read_text().splitlines()]
    assert all(Path(p).parent.parent == cache for r in held for p in [r["doc_image"], *r["doc_negatives"]])
