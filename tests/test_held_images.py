"""vl_pairs rows whose images are held in a Parquet file's cells (a Hugging Face Image column's `{"bytes", "path"}`
structs, or encoded bytes), as the hub's datasets write them: written once as files (`datasets/held_images.py`) and
served as the same rows with their images on disk are."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.dist_utils import run_distributed
from tests.needs import needs
from tests.test_qwen_vl import vl_run
from tests.test_qwen_vl_pairs import _vl_pairs
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.image_keys import image_key
from titan_contrastive.datasets.vl_pairs import VLPairsDataset

pytestmark = needs("data")


def _held(root: Path) -> tuple[Path, Path]:
    """(`_vl_pairs`' nine rows with two image negatives each, their files on disk; the same rows in a Parquet file
    holding the images: the query's as encoded bytes, the document's and the negatives' as Image structs)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = _vl_pairs(root / "files", negatives="image")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]

    def struct(path: str) -> dict:
        return {"bytes": (jsonl.parent / path).read_bytes(), "path": Path(path).name}

    table = {
        "query_image": pa.array([(jsonl.parent / r["query_image"]).read_bytes() for r in rows], pa.binary()),
        "query_text": [r["query_text"] for r in rows],
        "doc_image": [struct(r["doc_image"]) for r in rows],
        "doc_text": [r["doc_text"] for r in rows],
        "doc_negatives": [[struct(p) for p in r["doc_negatives"]] for r in rows],
    }
    (root / "held").mkdir()
    pq.write_table(pa.table(table), root / "held" / "rows.parquet")
    return jsonl, root / "held" / "rows.parquet"


def same_fields(a: object, b: object) -> None:
    """Two samples' fields equal: the same keys, texts, numbers and decoded images, in lists and tuples alike."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            same_fields(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b):
            same_fields(x, y)
    else:
        assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b


def test_images_held_in_cells_are_served_as_their_files(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """m2i rows (a query image and text, a document image, two image negatives): the Parquet file's rows decode to
    the same images and texts as the files'; each image is written once, named by its key (the SHA-1 of its bytes,
    as `embed_images` keys it) with its struct's suffix, holding those bytes; a second load writes none."""
    jsonl, parquet = _held(tmp_path)
    cache = tmp_path / "cache"
    files = VLPairsDataset(split="train", path=str(jsonl), mode="m2i")
    with caplog.at_level(logging.INFO, logger="titan_contrastive"):
        held = VLPairsDataset(split="train", path=str(parquet), mode="m2i", image_cache=str(cache))
    assert held.num_negatives == files.num_negatives == 2
    for i in range(9):
        same_fields(held._read(i, [])[1], files._read(i, [])[1])
    written = sorted(p for p in cache.rglob("*") if p.is_file())
    originals = sorted((jsonl.parent / "img").iterdir())
    assert len(written) == len(originals) == 9 * 4
    by_key = {image_key(p.read_bytes()): p for p in originals}
    for file in written:
        assert file.parent.name == file.stem[:2] and file.read_bytes() == by_key[file.stem].read_bytes()
        assert file.suffix == ("" if by_key[file.stem].name.startswith("q") else ".png")  # bytes, or a struct's name
    assert f"36 images held in the cells of {parquet}, read from {cache} (36 written now)" in caplog.text
    caplog.clear()
    before = {p: p.stat().st_mtime_ns for p in written}
    with caplog.at_level(logging.INFO, logger="titan_contrastive"):
        VLPairsDataset(split="train", path=str(parquet), mode="m2i", image_cache=str(cache))
    assert "(0 written now)" in caplog.text and {p: p.stat().st_mtime_ns for p in written} == before


def _shared(jsonl: str, parquet: str, cache: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    held = VLPairsDataset(split="train", path=parquet, mode="m2i", image_cache=cache, group=dist.group.WORLD)
    files = VLPairsDataset(split="train", path=jsonl, mode="m2i")
    for i in range(9):  # every image there once every rank has built the dataset, whichever rank wrote it
        same_fields(held._read(i, [])[1], files._read(i, [])[1])
    keys = [image_key(p.read_bytes()) for p in sorted((Path(jsonl).parent / "img").iterdir())]
    assert held.num_negatives == 2 and len(set(keys)) == 36
    counts = torch.tensor([float(sum(int(k[:8], 16) % world == r for k in keys)) for r in range(world)])
    mine = torch.zeros(world)
    mine[rank] = held.image_store.written
    dist.all_reduce(mine)
    assert torch.equal(mine, counts) and counts.min() > 0  # each rank wrote the images that fall to it, and only those


@pytest.mark.parametrize("world", [2])
def test_the_ranks_of_a_machine_share_the_writes(tmp_path: Path, world: int) -> None:
    """On 2 gloo processes building the dataset at once: each writes the images whose key falls to its local rank
    (their count by the keys), and every rank serves every image once the dataset is built."""
    jsonl, parquet = _held(tmp_path)
    run_distributed(_shared, world, str(jsonl), str(parquet), str(tmp_path / "cache"))


def test_colpali_columns_and_structs_of_paths(tmp_path: Path) -> None:
    """colpali-engine's training set's columns (`query`, a page `image`) are t2i rows; an Image struct without bytes
    is its path, relative to the file's folder as any image path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = _vl_pairs(tmp_path / "files")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    image = [{"bytes": (jsonl.parent / r["doc_image"]).read_bytes(), "path": None} for r in rows[:5]]
    image += [{"bytes": None, "path": r["doc_image"]} for r in rows[5:]]  # beside the file: files/img/...
    pq.write_table(pa.table({"query": [r["query_text"] for r in rows], "image": image}), jsonl.parent / "c.parquet")
    theirs = VLPairsDataset(split="train", path=str(jsonl.parent / "c.parquet"), mode="t2i", image_cache=str(tmp_path))
    ours = VLPairsDataset(split="train", path=str(jsonl), mode="t2i")
    for i in range(9):
        same_fields(theirs._read(i, [])[1], ours._read(i, [])[1])
    assert len([p for p in tmp_path.glob("??/*") if p.is_file()]) == 5


def test_a_cache_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    """A cache folder that cannot be made, or a cache for other data: one line naming data.image_cache and the fix
    (bytes in a text column: `test_packed_rows`)."""
    from titan_contrastive.config.data import Data
    from titan_contrastive.datasets.build import check_image_root

    with pytest.raises(DataError, match=r"^data.image_cache='c': .* data.dataset='csv' reads no such rows; leave it"):
        check_image_root(Data(dataset="csv", image_cache="c"))
    _, parquet = _held(tmp_path)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(DataError, match=r"^data.image_cache='.*a_file/cache': cannot write .* to a writable folder$"):
        VLPairsDataset(split="train", path=str(parquet), mode="m2i", image_cache=str(tmp_path / "a_file" / "cache"))


@needs("hf")
def test_a_run_on_held_images_serves_the_batches_of_their_files(tmp_path: Path) -> None:
    """The trainer on the Parquet file (`--data.image_cache`) serves, through the Qwen-VL processor, the batches the
    rows with their files serve: token ids, patches and grids, the negatives' too."""
    jsonl, parquet = _held(tmp_path)
    same_batches(tmp_path, jsonl, f"--data.path={parquet}")
    assert any((tmp_path / "cache").rglob("*.png"))


def same_batches(tmp: Path, rows: Path, *flags: str) -> None:
    """An m2i run's first batch of 7 (its data given by `flags`, images written to `tmp/cache`) through the Qwen-VL
    processor equals that of the m2i `rows` holding their images as files: ids, patches, grids, negatives'."""
    trainer = vl_run(
        tmp,
        "qwen2_vl",
        "--data.dataset=vl_pairs",
        *flags,
        f"--data.image_cache={tmp / 'cache'}",
        "--data.retrieval_mode=m2i",
        "--training.local_batch_size=7",
        sizes=(),
    )
    files = VLPairsDataset(split="train", path=str(rows), mode="m2i")
    files.serve_processed(trainer.train_set._process)
    mine, theirs = (d.__getitems__(list(range(7))) for d in (trainer.train_set, files))
    tensors = [k for k, v in theirs.items() if isinstance(v, torch.Tensor)]
    assert {"neg", "neg_pixel_values", "doc_pixel_values", "query_pixel_values"} <= set(tensors)
    for key in tensors:
        assert torch.equal(mine[key], theirs[key]), key


@needs("hf")
def test_a_saved_dataset_of_an_image_feature(tmp_path: Path) -> None:
    """A Hugging Face dataset saved to disk (`save_to_disk`), its documents an `Image` feature: the rows of the
    Parquet file's; a path that is neither a file nor such a folder is one line naming both."""
    import datasets
    import pyarrow.parquet as pq

    jsonl, parquet = _held(tmp_path)
    features = datasets.Features(
        {
            "query_image": datasets.Value("binary"),
            "query_text": datasets.Value("string"),
            "doc_image": datasets.Image(),
            "doc_text": datasets.Value("string"),
            "doc_negatives": datasets.Sequence(datasets.Image()),
        }
    )
    rows = pq.read_table(parquet).to_pydict()
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "saved"))  # in memory: no cache
    cache = str(tmp_path / "cache")
    saved = VLPairsDataset(split="train", path=str(tmp_path / "saved"), mode="m2i", image_cache=cache)
    files = VLPairsDataset(split="train", path=str(jsonl), mode="m2i")
    for i in range(9):
        same_fields(saved._read(i, [])[1], files._read(i, [])[1])
    with pytest.raises(
        DataError, match=r"^data.path=.*nowhere: not an existing .*\.arrow .*file or save_to_disk folder;"
    ):
        VLPairsDataset(split="train", path=str(tmp_path / "nowhere"), mode="m2i")


def _embed_held(out: str, flags: list[str], teacher: str) -> None:
    """One rank of `embed_images` on `flags`' rows; its count of images written goes to `written.<rank>` beside
    `out`, read from the dataset's log line."""
    from tests.test_vl_teacher_ahead import embed

    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("titan_contrastive")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    embed(Path(out), flags, Path(teacher))
    [line] = [x for x in lines if "images held in the cells" in x]
    (Path(out).parent / f"written.{os.environ['RANK']}").write_text(line.split("(")[-1].split()[0])


@needs("hf")
def test_ranks_embedding_ahead_share_the_writes(tmp_path: Path) -> None:
    """`embed_images` on 2 gloo processes over the Parquet file: each rank writes the images whose key falls to it
    (every image once in all), and the file holds the rows one process writes of the rows holding files (each image
    keyed by its bytes)."""
    from tests.hf_folders import vl_folder
    from tests.test_embed_on_ranks import assert_same_rows
    from tests.test_qwen_vl_teacher import teacher_folder
    from tests.test_vl_teacher_ahead import embed, run_flags

    jsonl, parquet = _held(tmp_path)
    vl_folder(tmp_path)
    teacher = teacher_folder(tmp_path)
    want = embed(tmp_path / "files.parquet", run_flags(tmp_path, str(jsonl)), teacher)
    held = run_flags(tmp_path, str(parquet), f"--data.image_cache={tmp_path / 'cache'}")
    (tmp_path / "out").mkdir()
    run_distributed(_embed_held, 2, str(tmp_path / "out" / "held.parquet"), held, str(teacher))
    assert_same_rows(tmp_path / "out" / "held.parquet", want)
    keys = [image_key(p.read_bytes()) for p in (jsonl.parent / "img").iterdir()]
    written = [int((tmp_path / "out" / f"written.{r}").read_text()) for r in range(2)]
    assert written == [sum(int(k[:8], 16) % 2 == r for k in keys) for r in range(2)] and sum(written) == 36
