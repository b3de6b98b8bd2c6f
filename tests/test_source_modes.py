"""`data.retrieval_modes = ["auto"]`: each vl_pairs source's mode read from its first rows (texts, images or both on
each side), in our columns, VLM2Vec's MMEB-train columns and colpali-engine's with images held in Parquet cells; a
run of inferred modes equal to one of the modes given; what cannot be inferred is one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.needs import needs
from tests.test_qwen_vl import vl_run
from tests.test_qwen_vl_pairs import _vl_pairs
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.source_modes import PROBE, source_modes

pytestmark = needs("data")


def _data(path: str, *modes: str, **fields) -> SimpleNamespace:
    given = dict(dataset="vl_pairs", path=path, retrieval_mode="t2i", retrieval_modes=list(modes), corpus="")
    return SimpleNamespace(**(given | fields))


def _rows(file: Path, rows: list[dict]) -> str:
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(file)


def test_each_source_s_rows_say_its_mode(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    image = "img/q0.png"
    ours = {
        "m2t": {"query_image": image, "query_text": "what is it?", "doc_text": "a cat"},
        "t2i": {"query_text": "a cat", "doc_image": image},
        "i2i": {"query_image": image, "doc_image": image, "doc_text": ""},
        "m2m": {"query_image": image, "query_text": "a", "doc_image": image, "doc_text": "b"},
        "t2t": {"query_text": "a", "doc_text": "b"},
    }
    paths = {mode: _rows(tmp_path / f"{mode}.jsonl", [row] * 3) for mode, row in ours.items()}
    for mode, path in paths.items():
        assert source_modes(_data(path, "auto")) == [mode]
    joined = "::".join(paths[m] for m in ("m2t", "t2i", "i2i"))
    assert source_modes(_data(joined, "auto")) == ["m2t", "t2i", "i2i"]  # one "auto" for every source
    assert source_modes(_data(joined, "auto", "i2t", "auto")) == ["m2t", "i2t", "i2i"]  # beside given modes
    vlm2vec = [  # MMEB-train: VQA (m2t); MSCOCO_t2i's image documents keep their instruction (t2m)
        {"qry": "<|image_1|>\nRepresent the given image with the question: why?", "qry_image_path": image,
         "pos_text": "because", "pos_image_path": ""},
        {"qry": "Find me an everyday image that matches the given caption: a cat", "qry_image_path": "",
         "pos_text": "<|image_1|>\nRepresent the given image.", "pos_image_path": image},
    ]  # fmt: skip
    assert source_modes(_data(_rows(tmp_path / "vqa.jsonl", [vlm2vec[0]]), "auto")) == ["m2t"]
    assert source_modes(_data(_rows(tmp_path / "t2i.jsonl", [vlm2vec[1]]), "auto")) == ["t2m"]
    cells = {"query": ["a page"], "image": [{"bytes": b"\x89PNG", "path": None}]}  # colpali-engine's, held
    pq.write_table(pa.table(cells), tmp_path / "colpali.parquet")
    assert source_modes(_data(str(tmp_path / "colpali.parquet"), "auto")) == ["t2i"]
    late = [{"query_text": "a", "doc_image": image}] * 3 + [
        {"query_text": "a", "query_image": image, "doc_image": image}
    ]
    assert source_modes(_data(_rows(tmp_path / "late.jsonl", late), "auto")) == ["m2i"]  # any of the first rows
    beyond = [{"query_text": "a", "doc_image": image}] * PROBE + [{"query_image": image, "doc_image": image}]
    assert source_modes(_data(_rows(tmp_path / "beyond.jsonl", beyond), "auto")) == ["t2i"]  # only the first rows


def test_what_cannot_be_inferred_is_one_line(tmp_path: Path) -> None:
    rows = _rows(tmp_path / "a.jsonl", [{"query_text": "a", "doc_image": "x.png"}])
    cases = [
        (_data(rows, "auto", corpus="corpus.jsonl"), "'auto' reads a source's rows, and rows of document ids"),
        (_data(str(tmp_path / "gone.jsonl"), "auto"), "gone.jsonl does not exist; give an existing file"),
        (_data(_rows(tmp_path / "b.jsonl", [{"query_text": "a"}]), "auto"), "b.jsonl's first rows hold no doc_text"),
        (_data(f"{rows}::{rows}", "auto", "t2i", "auto"), "3 mode(s) for the 2 source(s)"),
        (_data(f"{rows}::{_rows(tmp_path / 't.jsonl', [{'query_text': 'a', 'doc_text': 'b'}])}", "auto"), "a t2t"),
    ]
    for data, needle in cases:
        with pytest.raises(DataError) as err:
            source_modes(data)
        message = str(err.value)
        assert message.startswith("data.retrieval_modes=") and needle in message and "\n" not in message, message


@needs("hf")
def test_a_run_of_inferred_modes_is_the_run_of_given_ones(tmp_path: Path) -> None:
    """m2t rows joined with t2i rows, their modes given or inferred: the same model args and the same batch."""
    first, second = _vl_pairs(tmp_path / "a"), _vl_pairs(tmp_path / "b", count=8)
    first.write_text(first.read_text().replace('"doc_image"', '"other"'))  # m2t rows: no document image
    second.write_text(second.read_text().replace('"doc_text"', '"other"').replace('"query_image"', '"another"'))
    runs = []
    for modes in ("m2t,t2i", "auto"):
        flags = (f"--data.path={first}::{second}", f"--data.retrieval_modes={modes}", "--training.local_batch_size=6")
        runs.append(vl_run(tmp_path / modes, "qwen2_vl", "--data.dataset=vl_pairs", *flags, sizes=()))
    inferred = runs[1]
    same = [dataclasses.replace(r.model.args, path="") for r in runs]  # each its own copy of the model folder
    assert same[0] == same[1] and inferred.model.args.modes == ("m2t", "t2i") and inferred.model.args.mixed
    rows = [0, 9, 1, 10, 11, 2]
    a, b = (r.train_set.__getitems__(rows) for r in runs)
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), key
    for run in runs:
        run.metrics.close()
