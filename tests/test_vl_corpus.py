"""vl_pairs rows of document ids against a corpus of images and texts (`data.corpus`, `datasets/vl_corpus.py`):
tevatron's multimodal rows (`query_text`, `query_image`, `positive_document_ids`, `negative_document_ids`) beside
`{docid, image, text}` rows serve what the same rows with their documents in place serve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.needs import needs
from tests.test_held_images import same_batches, same_fields
from tests.test_qwen_vl_pairs import _vl_pairs
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.vl_pairs import VLPairsDataset

pytestmark = needs("data")


def _by_id(root: Path, negatives: str, positives: int = 1) -> tuple[Path, Path, Path]:
    """(`_vl_pairs`' nine rows with two hard negatives each, their documents in place; the same rows naming their
    documents by id, beside them; the corpus of those documents in another folder, a Parquet file holding half of
    the images in its cells and naming the others by a path relative to its own folder). `positives` 2: each row
    names a second positive, `e{i}`, its query's image."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = _vl_pairs(root / "files", negatives=negatives)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    docs: dict[str, dict] = {}
    ids = []
    for i, row in enumerate(rows):
        docs[f"d{i}"] = {"image": row["doc_image"], "text": row["doc_text"]}
        docs[f"e{i}"] = {"image": row["query_image"], "text": row["query_text"]}
        for j, neg in enumerate(row["doc_negatives"]):
            docs[f"n{i}-{j}"] = {"image": {"image": neg, "text": ""}, "text": {"image": "", "text": neg}}.get(
                negatives, neg
            )
        ids.append(
            {
                "query_id": str(i),
                "query_text": row["query_text"],
                "query_image": row["query_image"],
                "positive_document_ids": [f"d{i}", f"e{i}"][:positives],
                "negative_document_ids": [f"n{i}-{j}" for j in range(2)],
            }
        )
    (jsonl.parent / "ids.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ids))
    (root / "corpus").mkdir()
    images = [
        None
        if not d["image"]
        else {"bytes": (jsonl.parent / d["image"]).read_bytes(), "path": None}
        if n % 2
        else {"bytes": None, "path": f"../files/{d['image']}"}
        for n, d in enumerate(docs.values())
    ]
    table = pa.table({"docid": list(docs), "image": images, "text": [d["text"] for d in docs.values()]})
    pq.write_table(table, root / "corpus" / "corpus.parquet")
    paths = [{"docid": i, "image": d["image"] and f"../files/{d['image']}", "text": d["text"]} for i, d in docs.items()]
    (root / "corpus" / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in paths))  # paths only
    return jsonl, jsonl.parent / "ids.jsonl", root / "corpus" / "corpus.parquet"


@pytest.mark.parametrize(("mode", "negatives"), [("m2i", "image"), ("m2m", "multi"), ("m2t", "text")])
def test_rows_of_ids_serve_their_documents(tmp_path: Path, mode: str, negatives: str) -> None:
    """m2i (image documents), m2m (an image and a text each) and m2t (texts): every row of ids reads the query, the
    document and
    the two negatives of the row that holds them, the corpus's images held in its cells or named by a path relative
    to its folder; negatives drawn per epoch (`data.negatives_per_row`) draw the same places."""
    jsonl, ids, corpus = _by_id(tmp_path, negatives)
    cache = str(tmp_path / "cache")
    for k in (0, 1):
        common = {"split": "train", "mode": mode, "negatives_per_row": k, "seed": 3}
        theirs = VLPairsDataset(path=str(ids), corpus=str(corpus), image_cache=cache, **common)
        ours = VLPairsDataset(path=str(jsonl), **common)
        for epoch in range(3):
            theirs.epoch = ours.epoch = epoch
            for i in range(9):
                same_fields(theirs._read(i, [])[1], ours._read(i, [])[1])


def test_several_positives_are_drawn_per_epoch(tmp_path: Path) -> None:
    """Rows naming two positives serve one per epoch with data.negatives_per_row, both over epochs, as its pools
    draw them; without it, one line naming the fix."""
    _, ids, corpus = _by_id(tmp_path, "image", positives=2)
    common = {"split": "train", "path": str(ids), "mode": "m2i", "corpus": str(corpus), "image_cache": str(tmp_path)}
    data = VLPairsDataset(negatives_per_row=1, seed=5, **common)
    assert data._files[0].positives.tolist() == [2] * 9
    docs = VLPairsDataset(split="test", path=str(ids), mode="m2i", corpus=str(corpus), image_cache=str(tmp_path))
    served = {i: set() for i in range(9)}
    for epoch in range(4):
        data.epoch = epoch
        for i in range(9):
            image = data._read(i, [])[1]["doc_image"]
            served[i].add(image.tobytes())
            row = docs._read(i, [])[1]
            assert image.tobytes() in {row["doc_image"].tobytes(), row["query_image"].tobytes()}
    assert all(len(images) == 2 for images in served.values())
    prompts = {"query_templates": ["{image} {text}"], "doc_templates": ["{image}"]}  # no processor needed
    ahead = VLPairsDataset(negatives_per_row=1, **prompts, **common).frozen_items()["document"]
    rows = [json.loads(line) for line in ids.read_text().splitlines()]
    named = {i for r in rows for i in r["positive_document_ids"] + r["negative_document_ids"]}
    assert len(ahead) == len(named) == 36 and len({item.image for item in ahead}) == 36  # each positive embedded
    with pytest.raises(DataError, match=r"ids.jsonl: rows of .* name several positive_document_ids.*negatives_per_row"):
        VLPairsDataset(**common)


def test_unknown_documents_and_bad_corpora(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A row naming a document the corpus does not hold is a bad sample when served (the next row takes its slot),
    said at load; a corpus holding none of the documents, a corpus row without an id, and data.corpus for data
    without rows of ids are one line each."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    _, ids, corpus = _by_id(tmp_path, "image")
    rows = [json.loads(line) for line in ids.read_text().splitlines()]
    rows[4]["negative_document_ids"][1] = "nowhere"
    ids.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = {"split": "train", "path": str(ids), "mode": "m2i", "image_cache": str(tmp_path)}
    for given in (corpus, corpus.with_suffix(".jsonl")):  # chosen by Arrow, and a line at a time
        caplog.clear()
        with caplog.at_level("INFO", logger="titan_contrastive"):
            data = VLPairsDataset(corpus=str(given), **common)
        assert "26 of the 27 documents" in caplog.text and "1 row(s) name one it does not hold" in caplog.text
    bad: list = []
    _, fields = data._read(4, bad)
    assert [(b.reason, b.key) for b in bad] == [("missing_image", "4")]
    same_fields(fields, data._read(5, [])[1])
    pq.write_table(pa.table({"docid": ["x"], "text": ["a dog"]}), tmp_path / "other.parquet")
    with pytest.raises(DataError, match=r"^data.corpus=.*other.parquet: holds none of the 27 documents .*ids.jsonl"):
        VLPairsDataset(corpus=str(tmp_path / "other.parquet"), **common)
    pq.write_table(pa.table({"name": ["d0"], "text": ["a dog"]}), tmp_path / "unnamed.parquet")
    with pytest.raises(DataError, match=r"unnamed.parquet row 1: a vl_pairs corpus row holds an id \(docid/_id/id\)"):
        VLPairsDataset(corpus=str(tmp_path / "unnamed.parquet"), **common)
    with pytest.raises(
        DataError,
        match=r"without_query_image.jsonl: no column query_image; .* needs query_image, positive_document_ids",
    ):
        VLPairsDataset(corpus=str(corpus), **{**common, "mode": "i2i", "path": str(_drop(ids, "query_image"))})


def _drop(rows: Path, column: str) -> Path:
    out = rows.with_name(f"without_{column}.jsonl")
    kept = [{k: v for k, v in json.loads(line).items() if k != column} for line in rows.read_text().splitlines()]
    out.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return out


@needs("hf")
def test_a_run_with_a_corpus_serves_the_batches_of_the_rows_it_names(tmp_path: Path) -> None:
    """The trainer with `--data.corpus` serves, through the Qwen-VL processor, the batches of the rows holding their
    documents: ids, patches, grids, negatives."""
    jsonl, ids, corpus = _by_id(tmp_path, "image")
    same_batches(tmp_path, jsonl, f"--data.path={ids}", f"--data.corpus={corpus}")
