"""`data.image_root`: the relative image paths of csv and vl_pairs files read from one folder instead of each file's
own (annotations kept apart from their images, VLM2Vec's `image_dir`): a file, a folder of shards and a held-out file
serve what files beside their images serve; the setting for data without such paths, or a folder that is not there,
is a one-line error before anything is read."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.needs import needs
from tests.test_pairs_data import _one_line
from titan_contrastive.config.data import Data
from titan_contrastive.datasets import DataError
from titan_contrastive.datasets.build import check_image_root
from titan_contrastive.datasets.file_sources import open_source
from titan_contrastive.datasets.sources import BadSample
from titan_contrastive.datasets.vl_pairs import VLPairsDataset


def _images(root: Path, count: int = 4) -> list[str]:
    """`count` PNGs of their own sizes under `root/img`; their paths relative to `root`."""
    g = np.random.default_rng(3)
    (root / "img").mkdir(parents=True)
    for i in range(count):
        Image.fromarray(g.integers(0, 256, (28 + 4 * i, 28, 3), dtype=np.uint8)).save(root / "img" / f"{i}.png")
    return [f"img/{i}.png" for i in range(count)]


def _rows(paths: list[str]) -> list[dict]:
    return [{"query_text": f"query {i}", "doc_image": p} for i, p in enumerate(paths)]


def _fields(ds: VLPairsDataset, source: int = 0) -> list[dict]:
    return [ds._fields(source, i) for i in range(len(ds))]


def _same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


def test_vl_pairs_rows_apart_from_their_images(tmp_path: Path) -> None:
    paths = _images(tmp_path / "dataset")
    beside = tmp_path / "dataset" / "rows.jsonl"  # the reference: the rows beside their images
    beside.write_text("".join(json.dumps(r) + "\n" for r in _rows(paths)))
    (tmp_path / "annotations" / "shards").mkdir(parents=True)
    apart = tmp_path / "annotations" / "train.json"
    apart.write_text(json.dumps(_rows(paths)))
    for n in range(2):  # a folder of shards: each file's paths from the root too, not from its own folder
        shard = tmp_path / "annotations" / "shards" / f"train-{n}.jsonl"
        shard.write_text("".join(json.dumps(r) + "\n" for r in _rows(paths)[n * 2 : (n + 1) * 2]))
    want = _fields(VLPairsDataset(split="train", path=str(beside), mode="t2i"))
    root = str(tmp_path / "dataset")
    for path in (apart, apart.parent / "shards"):
        got = VLPairsDataset(split="train", path=str(path), mode="t2i", image_root=root)
        assert _same(_fields(got), want), path
    assert want[3]["doc_image"].shape == (40, 28, 3)
    held_out = VLPairsDataset(split="test", path=str(apart), mode="t2i", image_root=root)
    assert _same(_fields(held_out), want)
    bad = VLPairsDataset(split="train", path=str(apart), mode="t2i")  # without the root: no such image
    with pytest.raises(BadSample, match=r"annotations/img/0.png sample 0: unreadable_file \(No such file"):
        bad._fields(0, 0)


def test_csv_rows_apart_from_their_images(tmp_path: Path) -> None:
    paths = _images(tmp_path / "dataset")
    (tmp_path / "annotations").mkdir()
    table = tmp_path / "annotations" / "train.csv"
    table.write_text("filepath\ttitle\n" + "".join(f"{p}\ta caption {i}\n" for i, p in enumerate(paths)))
    source = open_source("csv", str(table), Data(image_root=str(tmp_path / "dataset")))
    assert [source._rows[i][0] for i in range(4)] == [str(tmp_path / "dataset" / p) for p in paths]
    assert [source._rows[i][0] for i in range(4)] != [
        open_source("csv", str(table), Data())._rows[i][0] for i in range(4)
    ]


def test_what_image_root_cannot_be_is_one_line(tmp_path: Path) -> None:
    check_image_root(Data(dataset="vl_pairs", image_root=str(tmp_path)))
    check_image_root(Data(dataset="webdataset", val_path="held_out.csv", image_root=str(tmp_path)))  # the CSV's
    for data, needle in (
        (Data(dataset="pairs", image_root=str(tmp_path)), "data.dataset='pairs' has none; leave it empty"),
        (Data(dataset="csv", image_root=str(tmp_path / "nope")), "no such folder"),
    ):
        with pytest.raises(DataError) as err:
            check_image_root(data)
        _one_line(err, f"data.image_root={data.image_root!r}", needle)


@needs("hf")
def test_a_run_trains_and_evaluates_on_rows_apart_from_their_images(tmp_path: Path) -> None:
    """The training rows and the held-out rows in another folder than their images: a qwen_vl run reads both through
    `data.image_root` (`build_data`), trains and evaluates."""
    from tests.test_qwen_vl import vl_run

    paths = _images(tmp_path / "dataset", 8)
    (tmp_path / "annotations").mkdir()
    rows = [{"query_text": "a photo of a cat", "doc_image": p} for p in paths]
    train, held_out = tmp_path / "annotations" / "train.jsonl", tmp_path / "annotations" / "val.json"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held_out.write_text(json.dumps(rows[:4]))
    trainer = vl_run(
        tmp_path,
        "qwen2_vl",
        "--data.dataset=vl_pairs",
        f"--data.path={train}",
        f"--data.val_path={held_out}",
        f"--data.image_root={tmp_path / 'dataset'}",
        "--training.local_batch_size=4",
        "--training.steps=1",
        "--eval.enable=true",
        "--eval.batch_size=4",
        sizes=(),
    )
    results = trainer.train()
    trainer.metrics.close()
    assert trainer.step == 1 and results["num_samples"] == 4 and "query_to_doc_r@1" in results
    assert not trainer.loader.bad_samples.values()  # every image read


@needs("hf")
def test_image_and_text_negatives_are_rooted_per_shard_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pattern over two folders of t2m rows whose hard negatives are `{"image", "text"}` objects: each negative's
    image is read from its own file's folder (the second folder's pixels under the first's names), as that file alone
    reads it."""
    from tests.test_qwen_vl_pairs import _vl_pairs

    monkeypatch.chdir(tmp_path)
    _vl_pairs(tmp_path / "m1", negatives="multi", count=3)
    _vl_pairs(tmp_path / "m2", negatives="multi", count=2)
    for j in range(2):
        Image.fromarray(np.full((28, 42, 3), 40 * j, dtype=np.uint8)).save(tmp_path / "m2" / "img" / f"n1{j}.png")
    both = VLPairsDataset(split="train", path="m*/pairs.jsonl", mode="t2m")
    alone = VLPairsDataset(split="train", path="m2/pairs.jsonl", mode="t2m")
    got, want = both._fields(0, 4)["doc_negatives"], alone._fields(0, 1)["doc_negatives"]
    assert [t for _, t in got] == [t for _, t in want] == ["a cat 1 on a warm roof", "frozen water"]
    assert all(np.array_equal(g, w) for (g, _), (w, _) in zip(got, want))
