"""Damaged user data is never lost silently (test data written at test time).

- a garbage tar among good shards, and a tar cut mid-member or inside a header, are logged (one
  warning naming the shard, the reason and what was lost) and counted (`source.losses`, the data
  line, `bad_shards` metrics); the samples before the break are kept, the cut one is left out;
- a shard that reads fewer samples than shards.json lists gives `truncated_shard` bad samples;
- every shard garbage: one-line DataError (brace pattern and shards.json);
- 16-bit grayscale images decode like their 8-bit versions (Pillow's own conversion clips);
- CSV / TSV / JSONL / template files with a UTF-8 byte-order mark read like those without;
- a FIFO named as an image or shard is refused at once, never opened (the reads run in a thread,
  so a regression fails on a timeout instead of hanging the suite).
"""

from __future__ import annotations

import csv
import json
import logging
import os
import shutil
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from titan_contrastive.config.data import Data
from titan_contrastive.datasets import DataError
from titan_contrastive.datasets.bad_samples import BAD_SAMPLES
from titan_contrastive.datasets.build import DataBundle, open_source
from titan_contrastive.datasets.files import FileImageTextDataset
from titan_contrastive.datasets.image_transforms import decode_image
from titan_contrastive.datasets.loader import build_dataloader
from titan_contrastive.datasets.make_shards import ShardError, read_csv, write_shards
from titan_contrastive.datasets.tokenizer import ByteTokenizer

PER_SHARD = 16


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """32 small PNGs with captions, written by make_shards as 2 shards of 16 (+ _stats.json, shards.json)."""
    root = tmp_path_factory.mktemp("faults")
    rng = np.random.default_rng(0)
    rows = []
    for i in range(2 * PER_SHARD):
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(root / f"{i:02d}.png")
        rows.append((str(root / f"{i:02d}.png"), f"caption {i}"))
    write_shards(rows, root / "shards", samples_per_shard=PER_SHARD)
    return root / "shards"


def _copy(shards: Path, tmp_path: Path) -> Path:
    out = tmp_path / "shards"
    shutil.copytree(shards, out)
    return out


def _member(tar: Path, name: str) -> tarfile.TarInfo:
    with tarfile.open(tar) as t:
        return t.getmember(name)


def _cut(tar: Path, at: int) -> None:
    tar.write_bytes(tar.read_bytes()[:at])


def _dataset(
    path: str, kind: str = "webdataset", *, split: str = "train", context: int = 16, image_size: int = 8
) -> FileImageTextDataset:
    return FileImageTextDataset(
        name=kind,
        split=split,
        source=open_source(kind, path, Data()),
        tokenizer=ByteTokenizer(context),
        image_size=image_size,
        seed=0,
        augment=False,
    )


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "titan_contrastive" and r.levelno == logging.WARNING]


def test_garbage_shard_among_good_ones_is_logged_and_counted(
    shards: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = _copy(shards, tmp_path)
    (out / "junk.tar").write_bytes(b"this is not a tar file" * 40)
    caplog.set_level(logging.WARNING, logger="titan_contrastive")
    ds = _dataset(f"{out / '00000.tar'},{out / 'junk.tar'},{out / '00001.tar'}")
    assert len(ds) == 2 * PER_SHARD
    (warning,) = _warnings(caplog)
    assert "junk.tar" in warning and "unreadable_shard" in warning and "not a tar" in warning and "left out" in warning
    assert [(loss.reason, Path(loss.where).name) for loss in ds.shard_losses] == [("unreadable_shard", "junk.tar")]
    loader = build_dataloader(ds, local_batch_size=8, dp_rank=0, dp_world_size=1, seed=0)
    assert next(loader)["image"].shape == (8, 3, 8, 8)
    assert loader.bad_samples.values() == {
        "bad_shards": 1,
        "bad_shards/unreadable_shard": 1,
        "bad_shards/samples_lost": 0,
    }
    line = DataBundle(ds, None, None, loader, 16).describe()
    assert (
        "train: 1 bad shard(s) left out or cut short (1 unreadable_shard; 0 samples lost, plus any more in the 1 "
        "without" in line
    )


def test_tar_cut_mid_member_keeps_the_whole_samples_and_counts_the_rest(
    shards: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """wids alone indexes 9 samples of the cut shard (the 9th with half an image) and says nothing."""
    out = _copy(shards, tmp_path)
    png = _member(out / "00000.tar", "000000008.png")
    _cut(out / "00000.tar", png.offset_data + png.size // 2)
    caplog.set_level(logging.WARNING, logger="titan_contrastive")
    ds = _dataset(str(out / "{00000..00001}.tar"))
    assert len(ds) == PER_SHARD + 8
    batch = ds.__getitems__(range(len(ds)))
    assert batch[BAD_SAMPLES] == [] and batch["image"].shape == (24, 3, 8, 8)  # every indexed sample is whole
    (warning,) = _warnings(caplog)
    assert "00000.tar" in warning and "truncated_shard" in warning and "000000008" in warning, warning
    assert "kept its first 8 samples, lost 8 of the 16 samples 00000_stats.json lists" in warning, warning
    (loss,) = ds.shard_losses
    assert (loss.reason, loss.kept, loss.lost) == ("truncated_shard", 8, 8)
    loader = build_dataloader(ds, local_batch_size=8, dp_rank=0, dp_world_size=1, seed=0)
    assert loader.bad_samples.values() == {
        "bad_shards": 1,
        "bad_shards/truncated_shard": 1,
        "bad_shards/samples_lost": 8,
    }
    assert "(1 truncated_shard; 8 samples lost" in DataBundle(ds, None, None, loader, 16).describe()

    (out / "00000_stats.json").unlink()  # nothing says how many there were: the loss is still named, as a lower bound
    caplog.clear()
    ds = _dataset(str(out / "{00000..00001}.tar"))
    assert len(ds) == PER_SHARD + 8 and [(loss.kept, loss.lost) for loss in ds.shard_losses] == [(8, 1)]
    assert "lost whatever followed the break" in _warnings(caplog)[0]


def test_tar_cut_inside_a_header_keeps_the_samples_before_it(
    shards: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """wids alone fails on the cut header, and the whole shard goes with it."""
    out = _copy(shards, tmp_path)
    _cut(out / "00001.tar", _member(out / "00001.tar", "000010005.json").offset + 100)
    caplog.set_level(logging.WARNING, logger="titan_contrastive")
    ds = _dataset(str(out / "{00000..00001}.tar"))
    assert len(ds) == PER_SHARD + 5 and ds.__getitems__([PER_SHARD + 4])[BAD_SAMPLES] == []
    assert [(loss.reason, loss.kept, loss.lost) for loss in ds.shard_losses] == [("truncated_shard", 5, 11)]
    assert "lost 11 of the 16 samples 00001_stats.json lists" in _warnings(caplog)[0]


def test_shards_json_and_the_cut_shard_it_lists(shards: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """With shards.json a shard whose size changed is scanned at start (the same index as the brace
    pattern); without a filesize to compare, the samples it lists and cannot read are bad samples
    with reason truncated_shard, each counted when read."""
    out = _copy(shards, tmp_path)
    png = _member(out / "00000.tar", "000000003.png")
    _cut(out / "00000.tar", png.offset_data + 10)
    caplog.set_level(logging.WARNING, logger="titan_contrastive")
    ds = _dataset(str(out / "shards.json"))
    assert len(ds) == PER_SHARD + 3 and "lost 13 of the 16 samples shards.json lists" in _warnings(caplog)[0]

    index = json.loads((out / "shards.json").read_text())
    for shard in index["shardlist"]:
        del shard["filesize"]
    (out / "shards.json").write_text(json.dumps(index))
    ds = _dataset(str(out / "shards.json"))
    assert len(ds) == 2 * PER_SHARD and ds.shard_losses == []
    loader = build_dataloader(
        ds, local_batch_size=2 * PER_SHARD, dp_rank=0, dp_world_size=1, seed=0, shuffle=False, max_bad_fraction=1.0
    )
    # slots 3..15 each take the next readable sample (16), counting the skips on the way: 13 + 12 + ... + 1
    next(loader)
    assert loader.bad_samples.values() == {"bad_samples": 91, "bad_samples/truncated_shard": 91}
    assert any(
        "truncated_shard (3 of its 16 indexed samples can be read; cut inside member 000000003.png" in w
        for w in _warnings(caplog)
    )


def test_every_shard_garbage_is_one_data_error(tmp_path: Path) -> None:
    for name in ("a.tar", "b.tar"):
        (tmp_path / name).write_bytes(os.urandom(4096))
    (tmp_path / "shards.json").write_text(
        json.dumps({"shardlist": [{"url": "a.tar", "nsamples": 16}, {"url": "b.tar", "nsamples": 16}]})
    )
    for path in (f"{tmp_path / 'a.tar'},{tmp_path / 'b.tar'}", str(tmp_path / "shards.json")):
        with pytest.raises(DataError) as err:
            open_source("webdataset", path, Data())
        message = str(err.value)
        assert (
            len(message.splitlines()) == 1 and "no readable samples in 2 shard(s)" in message and "a.tar" in message
        ), message


def _gradient_pngs(tmp_path: Path) -> tuple[np.ndarray, Path, Path]:
    wide = np.linspace(0, 65535, 48 * 40).reshape(40, 48).round().astype(np.uint16)
    narrow = (wide / 257).round().astype(np.uint8)
    Image.fromarray(wide).save(tmp_path / "g16.png")
    Image.fromarray(narrow).save(tmp_path / "g8.png")
    return narrow, tmp_path / "g16.png", tmp_path / "g8.png"


def test_16bit_grayscale_decodes_like_its_8bit_version(tmp_path: Path) -> None:
    narrow, png16, png8 = _gradient_pngs(tmp_path)
    assert Image.open(png16).mode in ("I;16", "I")  # Pillow 10.0 opens 16-bit grayscale PNGs as 'I'
    want = np.asarray(decode_image(png8.read_bytes())).astype(int)
    for image in (
        png16.read_bytes(),
        Image.open(png16).convert("I"),
        Image.frombytes("I;16B", (48, 40), (narrow.astype(np.uint16) * 257).astype(">u2").tobytes()),
    ):
        got = np.asarray(decode_image(image)).astype(int)
        assert got.shape == (40, 48, 3) and np.abs(got - want).max() <= 1
    # through a CSV dataset: the same tensors within one level
    (tmp_path / "d.csv").write_text(f"filepath\ttitle\n{png16.name}\ta\n{png8.name}\ta\n")
    ds = _dataset(str(tmp_path / "d.csv"), "csv", split="test", context=8, image_size=40)
    image = ds.__getitems__([0, 1])["image"]
    level = 1 / (255 * 0.26)  # one 8-bit level after normalization, at the largest of CLIP's stds
    assert torch.allclose(image[0], image[1], atol=level)


def test_byte_order_mark_is_not_part_of_the_first_column(tmp_path: Path) -> None:
    from titan_contrastive.datasets.image_folder import load_templates
    from titan_contrastive.datasets.pair_rows import read_rows

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "bom.csv").write_text("\ufefffilepath\ttitle\na.png\ta cat\n", encoding="utf-8")
    source = open_source("csv", str(tmp_path / "bom.csv"), Data())
    assert len(source) == 1 and source.read(0).caption == "a cat"
    assert read_csv(tmp_path / "bom.csv", "filepath", "title", "\t") == [("a.png", "a cat")]
    (tmp_path / "p.tsv").write_text("\ufeffq\td\nwhat is a cat\tcat\n", encoding="utf-8")
    assert read_rows(str(tmp_path / "p.tsv"), ("q", "d"), max_bad_fraction=0.0).texts == [["what is a cat", "cat"]]
    (tmp_path / "p.jsonl").write_text('\ufeff{"q": "frozen water", "d": "ice"}\n', encoding="utf-8")
    assert read_rows(str(tmp_path / "p.jsonl"), (), max_bad_fraction=0.0).texts == [["frozen water", "ice"]]
    (tmp_path / "t.txt").write_text("\ufeffa photo of {}.\n", encoding="utf-8")
    assert load_templates(str(tmp_path / "t.txt")) == ["a photo of {}."]


def _returns_within(seconds: float, fn, fifo: Path):
    """fn() run in a thread: its result, or a failure after `seconds` (the FIFO is then given a
    writer, so the blocked open returns and the thread ends)."""
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a writer that leaves at once: the reader sees EOF
        thread.join(5)
        pytest.fail(f"reading {fifo} blocked for {seconds} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_as_an_image_or_shard_is_refused_at_once(shards: Path, tmp_path: Path) -> None:
    from titan_contrastive.datasets.image_folder import ImageFolderZeroShot

    Image.new("RGB", (8, 8), "red").save(tmp_path / "ok.png")
    os.mkfifo(tmp_path / "pipe.png")
    with open(tmp_path / "d.csv", "w", newline="") as f:
        csv.writer(f, delimiter="\t").writerows([["filepath", "title"], ["pipe.png", "a pipe"], ["ok.png", "red"]])
    ds = _dataset(str(tmp_path / "d.csv"), "csv", split="test", context=8)
    batch = _returns_within(10, lambda: ds.__getitems__([0]), tmp_path / "pipe.png")
    (skip,) = batch[BAD_SAMPLES]
    assert skip.reason == "not_a_regular_file" and "FIFO" in str(skip) and "pipe.png" in str(skip)

    with pytest.raises(ShardError, match="not a regular file"):  # make_shards from the same CSV
        _returns_within(
            10,
            lambda: write_shards(
                read_csv(tmp_path / "d.csv", "filepath", "title", "\t"), tmp_path / "o", root=tmp_path
            ),
            tmp_path / "pipe.png",
        )
    for name in ("cat", "dog"):
        (tmp_path / "zs" / name).mkdir(parents=True)
        shutil.copy(tmp_path / "ok.png", tmp_path / "zs" / name / "0.png")
    os.mkfifo(tmp_path / "zs" / "dog" / "1.png")
    zero_shot = ImageFolderZeroShot(
        str(tmp_path / "zs"), names_file="", templates=["{}"], tokenizer=ByteTokenizer(8), image_size=8
    )
    with pytest.raises(DataError, match="1.png: not a readable image"):
        _returns_within(10, lambda: zero_shot.__getitems__([2]), tmp_path / "zs" / "dog" / "1.png")

    out = _copy(shards, tmp_path)
    (out / "00001.tar").unlink()
    os.mkfifo(out / "00001.tar")
    for path in (str(out / "shards.json"), str(out / "{00000..00001}.tar")):
        with pytest.raises(DataError, match="00001.tar is not a regular file"):
            _returns_within(10, lambda path=path: open_source("webdataset", path, Data()), out / "00001.tar")


def test_trainer_logs_and_reports_bad_shards(shards: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Through the trainer: the warnings, the data line at start and bad_shards in metrics.jsonl."""
    from titan_contrastive.train import main

    out = _copy(shards, tmp_path)
    (out / "00002.tar").write_bytes(b"\0" * 100 + b"garbage" * 100)
    _cut(out / "00001.tar", _member(out / "00001.tar", "000010010.png").offset_data + 5)
    caplog.set_level(logging.INFO, logger="titan_contrastive")
    args = [
        "--data.dataset=webdataset",
        f"--data.path={out / '{00000..00002}.tar'}",
        "--data.image_size=8",
        "--training.local_batch_size=8",
        "--training.steps=2",
        "--metrics.log_freq=1",
        "--metrics.enable_tensorboard=false",
        f"--job.dump_folder={tmp_path / 'run'}",
    ]
    assert main(args) == 0
    data_line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("data: "))
    assert (
        "train 26 samples" in data_line
        and "2 bad shard(s) left out or cut short (1 truncated_shard, 1 unreadable_shard" in data_line
    )
    assert sum("bad shard" in w for w in _warnings(caplog)) == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if r["kind"] == "train"][-1]
    assert (last["bad_shards"], last["bad_shards/truncated_shard"], last["bad_shards/unreadable_shard"]) == (2, 1, 1)
    assert last["bad_shards/samples_lost"] == 6
