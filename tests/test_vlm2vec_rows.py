"""VLM2Vec's MMEB-train rows (`qry`, `qry_image_path`, `pos_text`, `pos_image_path`, in Parquet, apart from an
`images/` tree) read as vl_pairs rows of ours (`datasets/vl_rows.py`): the same fields as the rows written in our
columns, the image placeholders VLM2Vec writes into its texts taken out; a qwen_vl run trains m2t on them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from tests.needs import needs, require
from titan_contrastive.datasets.vl_pairs import VLPairsDataset
from titan_contrastive.datasets.vl_rows import from_vlm2vec

QUESTIONS = ["what is on the roof", "is there a dog", "how many cats", "where is the water"]
ANSWERS = ["a cat", "a dog", "a cat on a warm roof", "frozen water"]


def test_vlm2vec_columns_and_placeholders() -> None:
    row = {"qry": "<|image_1|>\nRepresent the given image with the following question: is it red?", "pos_text": "yes"}
    assert from_vlm2vec({**row, "qry_image_path": "images/0.png", "pos_image_path": "", "neg_text": ""}) == {
        "query_text": "Represent the given image with the following question: is it red?",
        "query_image": "images/0.png",
        "doc_text": "yes",
        "doc_image": "",
        "neg_text": "",
        "doc_negatives": [],
    }
    assert from_vlm2vec({"qry": "find it", "pos_text": "<image> Represent the given image."})["doc_text"] == (
        "Represent the given image."
    )
    ours = {"qry": "a column of its own", "query_text": "q", "doc_text": "d", "neg_text": "n"}
    assert from_vlm2vec(ours) is ours and from_vlm2vec({"query_text": "q"}) == {"query_text": "q"}


def test_vlm2vec_hard_negatives() -> None:
    """VLM2Vec's `neg_text` / `neg_image_path` (a value each, or side-by-side lists with "" for none) become the
    documents' kind's `doc_negatives`, placeholders out and empty ones left out; a row's own `doc_negatives` wins."""
    texts, paths = ["<|image_1|> a red one", "", "<image>a blue one"], ["n/0.png", "n/1.png", ""]
    row = {"qry": "q", "pos_text": "d", "neg_text": texts, "neg_image_path": paths}
    assert from_vlm2vec(row)["doc_negatives"] == ["a red one", "a blue one"]
    assert from_vlm2vec(row, "image")["doc_negatives"] == ["n/0.png", "n/1.png"]
    assert from_vlm2vec(row, "multi")["doc_negatives"] == [
        {"text": "a red one", "image": "n/0.png"},
        {"text": "", "image": "n/1.png"},
        {"text": "a blue one", "image": ""},
    ]
    assert from_vlm2vec({"qry": "q", "neg_text": "<image> one"})["doc_negatives"] == ["one"]
    assert from_vlm2vec({"qry": "q", "neg_text": [""], "neg_image_path": [None]}, "image")["doc_negatives"] == []
    assert from_vlm2vec({"qry": "q", "neg_text": "x", "doc_negatives": ["y"]})["doc_negatives"] == ["y"]


def _mmeb(root: Path, negatives: bool = False) -> tuple[Path, Path]:
    """(a Parquet file of VLM2Vec rows in `root/annotations`, their images' root `root/mmeb`), and our rows of the
    same samples beside the images (`root/mmeb/ours.jsonl`)."""
    require("data")
    import pyarrow as pa
    import pyarrow.parquet as pq

    g = np.random.default_rng(4)
    (root / "mmeb" / "images" / "VQA").mkdir(parents=True)
    paths = []
    for i in range(len(QUESTIONS)):
        picture = Image.fromarray(g.integers(0, 256, (28 + 28 * (i % 2), 56, 3), dtype=np.uint8))
        picture.save(root / "mmeb" / "images" / "VQA" / f"{i}.png")
        paths.append(f"images/VQA/{i}.png")
    theirs = {
        "qry": [f"<|image_1|>\nRepresent the given image with the following question: {q}" for q in QUESTIONS],
        "qry_image_path": paths,
        "pos_text": ANSWERS,
        "pos_image_path": [""] * len(paths),
    }
    if negatives:  # VLM2Vec's lists of hard negatives: each row's other answers, "" for none beside each text
        theirs["neg_text"] = [[f"<|image_1|> {a}" for a in ANSWERS if a != answer] for answer in ANSWERS]
        theirs["neg_image_path"] = [[""] * (len(ANSWERS) - 1)] * len(ANSWERS)
    (root / "annotations").mkdir()
    pq.write_table(pa.table(theirs), root / "annotations" / "VQA.parquet")
    ours = [
        {"query_text": f"Represent the given image with the following question: {q}", "query_image": p, "doc_text": a}
        | ({"doc_negatives": [b for b in ANSWERS if b != a]} if negatives else {})
        for q, p, a in zip(QUESTIONS, paths, ANSWERS)
    ]
    (root / "mmeb" / "ours.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ours))
    return root / "annotations" / "VQA.parquet", root / "mmeb"


def test_mmeb_rows_are_read_as_ours(tmp_path: Path) -> None:
    parquet, images = _mmeb(tmp_path)
    theirs = VLPairsDataset(split="train", path=str(parquet), mode="m2t", image_root=str(images))
    ours = VLPairsDataset(split="train", path=str(images / "ours.jsonl"), mode="m2t")
    got, want = ([ds._fields(0, i) for i in range(4)] for ds in (theirs, ours))
    assert [g.keys() for g in got] == [w.keys() for w in want] == [{"query_image", "query_text", "doc_text"}] * 4
    assert all(np.array_equal(g[k], w[k]) for g, w in zip(got, want) for k in w)
    assert got[2]["doc_text"] == "a cat on a warm roof" and got[1]["query_image"].shape == (56, 56, 3)


def test_mmeb_hard_negatives_are_served_as_ours(tmp_path: Path) -> None:
    parquet, images = _mmeb(tmp_path, negatives=True)
    theirs = VLPairsDataset(split="train", path=str(parquet), mode="m2t", image_root=str(images))
    ours = VLPairsDataset(split="train", path=str(images / "ours.jsonl"), mode="m2t")
    assert theirs.num_negatives == ours.num_negatives == 3
    got, want = ([ds._fields(0, i)["doc_negatives"] for i in range(4)] for ds in (theirs, ours))
    assert got == want and got[0] == ["a dog", "a cat on a warm roof", "frozen water"]
    drawn = VLPairsDataset(split="train", path=str(parquet), mode="m2t", image_root=str(images), negatives_per_row=1)
    assert all(drawn._fields(0, i)["doc_negatives"][0] in want[i] for i in range(4))


@needs("hf")
def test_a_run_trains_m2t_on_mmeb_rows(tmp_path: Path) -> None:
    from tests.test_qwen_vl import vl_run

    parquet, images = _mmeb(tmp_path)
    trainer = vl_run(
        tmp_path,
        "qwen2_vl",
        "--data.dataset=vl_pairs",
        f"--data.path={parquet}",
        f"--data.image_root={images}",
        "--data.retrieval_mode=m2t",
        "--training.local_batch_size=4",
        "--training.steps=1",
        sizes=(),
    )
    trainer.train()
    trainer.metrics.close()
    assert trainer.step == 1 and not trainer.loader.bad_samples.values()
