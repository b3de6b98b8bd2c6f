"""Your own data: csv, webdataset, hf and pairs sources (test data written at test time).

- every image-text source built from the bundled emoji test split serves exactly the bundled
  loader's tensors (same pixels, same tokens);
- the loader over each source resumes exactly (1 and 2 ranks, 0 and 2 workers, across an epoch
  boundary, with random crops on);
- one epoch's global batches are disjoint and cover the epoch's permutation for world sizes 1, 2, 3;
- bad samples are skipped, counted by reason, deterministic, and stop the run past the limit;
- every error path is one line naming the file or key and the fix.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.marks import slow_ones
from tests.needs import installed, require
from titan_contrastive.config.data import Data
from titan_contrastive.datasets import DataError, build_dataset
from titan_contrastive.datasets.bad_samples import BAD_SAMPLES, BadSampleLog
from titan_contrastive.datasets.build import build_file_dataset
from titan_contrastive.datasets.emoji import MEAN, STD
from titan_contrastive.datasets.file_sources import open_source
from titan_contrastive.datasets.files import FileImageTextDataset
from titan_contrastive.datasets.image_folder import ImageFolderZeroShot, load_templates
from titan_contrastive.datasets.loader import build_dataloader
from titan_contrastive.datasets.make_shards import write_shards
from titan_contrastive.datasets.tokenizer import ByteTokenizer

SOURCES = ("csv", "webdataset", "hf")


@pytest.fixture(scope="module")
def emoji(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    return write_emoji_files(tmp_path_factory.mktemp("emoji"))


def write_emoji_files(root: Path) -> dict[str, object]:
    """The bundled emoji test split (200 images, 32 px) written as PNG files + a CSV, tar shards and a HF dataset."""
    bundled = build_dataset("emoji", "test", augment=False)
    images = bundled._images.permute(0, 2, 3, 1).numpy()
    captions = bundled.captions(range(len(bundled)))
    (root / "img").mkdir()
    rows = []
    for i, (pixels, caption) in enumerate(zip(images, captions)):
        Image.fromarray(pixels).save(root / "img" / f"{i:04d}.png")
        rows.append((f"img/{i:04d}.png", caption))
    with open(root / "train.csv", "w", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(["filepath", "title"])
        writer.writerows(rows)
    write_shards([(str(root / p), c) for p, c in rows], root / "shards", samples_per_shard=64)
    paths = {"csv": str(root / "train.csv"), "webdataset": str(root / "shards" / "{00000..00003}.tar")}
    if installed("data"):
        import datasets

        ds = datasets.Dataset.from_dict({"image": [str(root / p) for p, _ in rows], "text": [c for _, c in rows]})
        ds.cast_column("image", datasets.Image()).save_to_disk(str(root / "hf"))
        paths["hf"] = str(root / "hf")
    return {"root": root, "bundled": bundled, "paths": paths, "rows": rows}


def _dataset(emoji: dict, kind: str, *, augment: bool, split: str = "train", path: str = "") -> FileImageTextDataset:
    if kind == "hf":
        require("data")
    source = open_source(kind, path or emoji["paths"][kind], Data())
    return FileImageTextDataset(
        name=kind,
        split=split,
        source=source,
        tokenizer=ByteTokenizer(32),
        image_size=32,
        seed=3,
        augment=augment,
        mean=MEAN,
        std=STD,
    )


@pytest.mark.parametrize("kind", SOURCES)
def test_source_serves_the_bundled_samples(emoji: dict, kind: str) -> None:
    """Eval transform at the native size is the identity: pixels and tokens equal the bundled loader's."""
    ds = _dataset(emoji, kind, augment=False, split="test")
    indices = [0, 5, 63, 64, 65, 127, 199, 3]
    want, got = emoji["bundled"].__getitems__(indices), ds.__getitems__(indices)
    assert len(ds) == len(emoji["bundled"]) == 200
    assert got[BAD_SAMPLES] == []
    assert torch.equal(got["image"], want["image"]) and torch.equal(got["text"], want["text"])
    assert torch.equal(got["index"], want["index"])


@pytest.mark.parametrize("kind", SOURCES)
def test_train_crops_are_a_function_of_seed_epoch_index(emoji: dict, kind: str) -> None:
    ds = _dataset(emoji, kind, augment=True)
    a = ds.__getitems__([7, 8, 9])["image"]
    assert torch.equal(ds.__getitems__([9, 7])["image"], a[[2, 0]])  # not of the batch
    ds.set_epoch(1)
    assert not torch.equal(ds.__getitems__([7, 8, 9])["image"], a)  # a new crop each epoch
    ds.set_epoch(0)
    assert torch.equal(ds.__getitems__([7, 8, 9])["image"], a)


def _take(loader, n: int) -> list[dict]:
    return [next(loader) for _ in range(n)]


@pytest.mark.parametrize(  # data workers with one source by default, with the others under the slow marker
    ("kind", "workers"),
    slow_ones([(k, w) for w in (0, 2) for k in SOURCES], [("csv", 2), ("hf", 2)]),
)
def test_loader_resumes_exactly(emoji: dict, kind: str, workers: int) -> None:
    """k batches, save, a fresh loader restores and continues: the batches equal the uninterrupted
    run's (200 samples, 2 ranks x 16: 6 steps per epoch, so the 8 steps cross an epoch boundary)."""
    for world in (1, 2):
        for rank in range(world):

            def loader(rank: int = rank, world: int = world):  # bound now: called within this iteration only
                return build_dataloader(
                    _dataset(emoji, kind, augment=True),
                    local_batch_size=16,
                    dp_rank=rank,
                    dp_world_size=world,
                    seed=5,
                    num_workers=workers,
                )

            whole = _take(loader(), 8)
            first = loader()
            _take(first, 4 if world == 2 else 5)
            state = first.state_dict()
            resumed = loader()
            resumed.load_state_dict(state)
            tail = _take(resumed, 4 if world == 2 else 3)
            for got, want in zip(tail, whole[-len(tail) :]):
                assert torch.equal(got["index"], want["index"]) and torch.equal(got["image"], want["image"])
                assert torch.equal(got["text"], want["text"])


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_is_split_disjoint_and_complete(emoji: dict, workers: int) -> None:
    """Over all ranks, an epoch's batches hold each sample of the epoch's permutation exactly once;
    the remainder (200 mod global batch) are the permutation's last samples, left out of that epoch."""
    for world in (1, 2, 3):
        global_batch = 8 * world
        steps = 200 // global_batch
        per_rank = []
        for rank in range(world):
            loader = build_dataloader(
                _dataset(emoji, "webdataset", augment=False),
                local_batch_size=8,
                dp_rank=rank,
                dp_world_size=world,
                seed=1,
                num_workers=workers,
            )
            per_rank.append(torch.cat([b["index"] for b in _take(loader, steps)]))
            order = loader.sampler.global_order()
        seen = torch.cat(per_rank)
        assert len(seen) == len(set(seen.tolist())) == steps * global_batch
        assert sorted(seen.tolist()) == sorted(order.tolist()) and len(order) == steps * global_batch


def _damaged_csv(emoji: dict, tmp_path: Path) -> Path:
    root = emoji["root"]
    (tmp_path / "bad.jpg").write_bytes(b"not an image at all")
    rows = [(str(root / p), c) for p, c in emoji["rows"][:40]]
    rows[3] = (str(tmp_path / "bad.jpg"), "broken")
    rows[10] = (str(tmp_path / "missing.png"), "gone")
    rows[20] = (rows[20][0], "")
    file = tmp_path / "damaged.csv"
    with open(file, "w", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(["filepath", "title"])
        writer.writerows(rows)
    return file


def test_bad_samples_are_skipped_counted_and_deterministic(emoji: dict, tmp_path: Path) -> None:
    ds = _dataset(emoji, "csv", augment=True, path=str(_damaged_csv(emoji, tmp_path)))
    batch = ds.__getitems__([3, 10, 20, 21])
    assert [s.reason for s in batch[BAD_SAMPLES]] == ["undecodable_image", "unreadable_file", "missing_caption"]
    assert "row 5" in str(batch[BAD_SAMPLES][0]) and "missing.png" in str(batch[BAD_SAMPLES][1])
    # the slot takes the next good record in source order (the pixels of 4, 11, 21), with the slot's own crop
    assert torch.equal(batch["text"][[0, 1, 2]], ds.__getitems__([4, 11, 21])["text"])
    assert torch.equal(ds.__getitems__([3, 10, 20, 21])["image"], batch["image"])
    log = BadSampleLog(max_bad_fraction=0.1, epoch_samples=40)
    out = log.update(batch)
    assert BAD_SAMPLES not in out and log.values() == {
        "bad_samples": 3,
        "bad_samples/missing_caption": 1,
        "bad_samples/undecodable_image": 1,
        "bad_samples/unreadable_file": 1,
    }
    restored = BadSampleLog(0.1, 40)
    restored.load_state_dict(log.state_dict())
    assert restored.values() == log.values() and restored.seen == log.seen == 7


def test_bad_sample_limit_stops_with_the_file_and_key(emoji: dict, tmp_path: Path) -> None:
    ds = _dataset(emoji, "csv", augment=False, path=str(_damaged_csv(emoji, tmp_path)))
    loader = build_dataloader(
        ds, local_batch_size=40, dp_rank=0, dp_world_size=1, seed=0, shuffle=False, max_bad_fraction=0.0
    )
    with pytest.raises(DataError) as err:  # 3 bad > max(1, 0 x 40): stop
        next(loader)
    message = str(err.value)
    assert len(message.splitlines()) == 1 and "data.max_bad_fraction" in message and "row 22" in message
    loader = build_dataloader(
        ds, local_batch_size=40, dp_rank=0, dp_world_size=1, seed=0, shuffle=False, max_bad_fraction=0.1
    )
    assert next(loader)["image"].shape == (40, 3, 32, 32) and loader.bad_samples.total == 3  # 3 <= 0.1 x 40


def _one_line(err: pytest.ExceptionInfo, *needles: str) -> None:
    message = str(err.value)
    assert len(message.splitlines()) == 1, message
    for needle in needles:
        assert needle in message, message


def test_errors_are_one_line(emoji: dict, tmp_path: Path) -> None:
    opts = Data()
    with pytest.raises(DataError) as err:
        open_source("csv", str(tmp_path / "nope.csv"), opts)
    _one_line(err, "nope.csv")
    (tmp_path / "cols.csv").write_text("path\tcaption\na.png\tx\n")
    with pytest.raises(DataError) as err:
        open_source("csv", str(tmp_path / "cols.csv"), opts)
    _one_line(err, "cols.csv", "'filepath'", "data.csv_img_key")
    with pytest.raises(DataError) as err:
        open_source("webdataset", str(tmp_path / "{0..3}.tar"), opts)
    _one_line(err, "0.tar", "brace pattern")
    (tmp_path / "junk.tar").write_bytes(b"\0" * 10 + b"junk")
    with pytest.raises(DataError) as err:
        open_source("webdataset", str(tmp_path / "junk.tar"), opts)
    _one_line(err, "junk.tar")
    with pytest.raises(DataError) as err:
        open_source("csv", "", opts)
    _one_line(err, "data.path")
    if "hf" in emoji["paths"]:
        with pytest.raises(DataError) as err:
            open_source("hf", emoji["paths"]["hf"], Data(hf_text_column="caption"))
        _one_line(err, "'caption'", "data.hf_text_column")
    with pytest.raises(DataError) as err:
        build_file_dataset(
            "csv",
            "train",
            emoji["paths"]["csv"],
            opts,
            tokenizer=ByteTokenizer(32),
            image_size=32,
            seed=0,
            augment=True,
        ).pack_patches(16)
    _one_line(err, "model.name=clip")
    with pytest.raises(DataError) as err:
        load_templates(str(tmp_path / "none.txt"))
    _one_line(err, "zero_shot_templates")


def test_unreadable_shard_is_left_out_and_named(emoji: dict, tmp_path: Path) -> None:
    shards = sorted((emoji["root"] / "shards").glob("*.tar"))
    (tmp_path / "bad.tar").write_bytes(b"\0" * 10 + b"junk")
    source = open_source("webdataset", f"{shards[0]},{tmp_path / 'bad.tar'}", Data())
    assert len(source) == 64 and [(loss.reason, Path(loss.where).name) for loss in source.losses] == [
        ("unreadable_shard", "bad.tar")
    ]


def test_zero_shot_image_folder(emoji: dict, tmp_path: Path) -> None:
    root = emoji["root"]
    for c, name in enumerate(["cat_face", "dog", "zebra"]):
        (tmp_path / name).mkdir()
        for i in range(c + 2):
            (tmp_path / name / f"{i}.png").write_bytes((root / "img" / f"{c * 10 + i:04d}.png").read_bytes())
    ds = ImageFolderZeroShot(
        str(tmp_path), names_file="", templates=["a photo of a {}."], tokenizer=ByteTokenizer(32), image_size=32
    )
    assert ds.class_names == ["cat face", "dog", "zebra"] and len(ds) == 2 + 3 + 4
    batch = ds.__getitems__([0, 2, 8])
    assert batch["label"].tolist() == [0, 1, 2] and batch["image"].shape == (3, 3, 32, 32)
    assert ByteTokenizer(32).decode(batch["text"][:1]) == ["a photo of a cat face."]
    assert len(load_templates("openai")) == 80 and all("{}" in t for t in load_templates("simple"))
    (tmp_path / "names.txt").write_text("one\ntwo\n")
    with pytest.raises(DataError) as err:
        ImageFolderZeroShot(
            str(tmp_path), names_file=str(tmp_path / "names.txt"), templates=["{}"], tokenizer=None, image_size=32
        )
    _one_line(err, "names.txt", "2 names for 3 class folders")


def test_pairs_files(tmp_path: Path) -> None:
    from titan_contrastive.datasets.pair_rows import read_rows

    rows = [
        ["what is a cat", "cat", "dog"],
        ["a large striped cat", "tiger", "zebra"],
        ["frozen water", "ice", "steam"],
    ]
    with open(tmp_path / "p.jsonl", "w") as f:
        for q, p, n in rows:
            f.write(json.dumps({"anchor": q, "positive": p, "negative": n}) + "\n")
        f.write(json.dumps({"anchor": "", "positive": "x", "negative": "y"}) + "\n")
    (tmp_path / "p.tsv").write_text("".join("\t".join(r) + "\n" for r in rows))
    got, _, _, skipped, _, _ = read_rows(str(tmp_path / "p.jsonl"), (), max_bad_fraction=0.5)
    assert got == rows and skipped == {"missing_text": 1}
    with open(tmp_path / "ragged.jsonl", "w") as f:  # a row with another number of hard negatives
        for row in [*rows, ["a", "b", "c", "d"]]:
            f.write(json.dumps(row) + "\n")
    ragged = read_rows(str(tmp_path / "ragged.jsonl"), (), max_bad_fraction=0.5)
    assert (ragged.texts, ragged.skipped) == (rows, {"ragged_negatives": 1})
    assert read_rows(str(tmp_path / "p.tsv"), (), max_bad_fraction=0.0).texts == rows
    assert read_rows(str(tmp_path / "p.jsonl"), ("anchor", "positive"), max_bad_fraction=0.5).texts == [
        r[:2] for r in rows
    ]
    assert (
        read_rows(str(tmp_path / "p.jsonl"), (), max_bad_fraction=0.0).texts == rows
    )  # one bad row never stops a load
    with open(tmp_path / "p.jsonl", "a") as f:
        f.write(json.dumps(["only a query"]) + "\n")
    with pytest.raises(DataError) as err:  # two do, at max_bad_fraction 0 (limit max(1, 0 x 5))
        read_rows(str(tmp_path / "p.jsonl"), (), max_bad_fraction=0.0)
    _one_line(err, "p.jsonl", "row 5", "data.max_bad_fraction", "short_row")
    with pytest.raises(DataError) as err:
        read_rows(str(tmp_path / "p.txt"), (), max_bad_fraction=0.0)
    _one_line(err, "p.txt", ".jsonl")
    require("data")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"q": [r[0] for r in rows], "d": [r[1] for r in rows]}), tmp_path / "p.parquet")
    assert read_rows(str(tmp_path / "p.parquet"), (), max_bad_fraction=0.0).texts == [r[:2] for r in rows]
    with pytest.raises(DataError) as err:
        read_rows(str(tmp_path / "p.parquet"), ("query", "doc"), max_bad_fraction=0.0)
    _one_line(err, "p.parquet", "'query'", "data.pairs_columns")


def test_random_resized_crop_stays_inside_the_image() -> None:
    """90-100 % of the area at a 3/4-4/3 aspect, inside the image; torchvision's fallback (the
    whole image cut to the aspect range) when no draw fits; the eval crop is the central square."""
    from titan_contrastive.datasets.image_transforms import center_box, random_resized_box, sample_rng

    for width, height in ((64, 48), (48, 64), (100, 20)):
        for index in range(100):
            box = random_resized_box(width, height, sample_rng(0, 0, index))
            assert 0 <= box[0] < box[2] <= width and 0 <= box[1] < box[3] <= height
            w, h = box[2] - box[0], box[3] - box[1]
            assert 0.72 <= w / h <= 1.37 and (w * h >= 0.89 * width * height or width / height > 4 / 3)
    assert random_resized_box(100, 20, sample_rng(0, 0, 0)) == (36, 0, 63, 20)  # nothing fits: the fallback, 27 x 20
    assert center_box(32, 32) == (0, 0, 32, 32) and center_box(40, 20) == (10, 0, 30, 20)
    assert random_resized_box(64, 48, sample_rng(1, 2, 3)) == random_resized_box(64, 48, sample_rng(1, 2, 3))


# --- through the trainer -------------------------------------------------------------------------


def _train(args: list[str]) -> None:
    from titan_contrastive.train import main

    assert main(args) == 0


@pytest.mark.parametrize(
    "kind,nproc,workers",
    [  # the default suite's time: one source kind there, the others under the slow marker
        pytest.param("csv", 1, 2, marks=pytest.mark.slow),
        ("webdataset", 2, 0),
        pytest.param("hf", 2, 2, marks=pytest.mark.slow),
    ],
)
def test_trainer_resumes_bit_identically(emoji: dict, tmp_path: Path, kind: str, nproc: int, workers: int) -> None:
    """The trainer on `nproc` gloo processes: 6 steps at once vs 3 steps, then a run that resumes
    from step 3 (it logs only steps 4-6): the same losses and the same final checkpoint, bit for
    bit (random crops, clip_bpe captions). test_resume.py resumes through run_train.sh itself."""
    import shutil

    from tests.dist_utils import run_distributed
    from tests.test_resume import ARGS, DEBUG_CONFIG, STEPS, assert_identical, checkpoint, losses

    if kind == "hf":
        require("data")
    args = (
        f"--data.dataset={kind}",
        f"--data.path={emoji['paths'][kind]}",
        "--data.image_size=32",
        f"--data.num_workers={workers}",
        "--checkpoint.interval=3",
    )
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    config = [DEBUG_CONFIG, *ARGS, *args]
    run_distributed(_train, nproc, [*config, f"--job.dump_folder={whole}"])
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(whole / "checkpoint" / "step-3", resumed / "checkpoint" / "step-3")
    run_distributed(_train, nproc, [*config, f"--job.dump_folder={resumed}"])
    want, got = losses(whole), losses(resumed)
    assert sorted(want) == list(range(1, STEPS + 1)) and sorted(got) == [4, 5, 6]
    assert all(got[s] == want[s] for s in got), (got, want)
    assert_identical(checkpoint(resumed, STEPS), checkpoint(whole, STEPS))


def test_trainer_reports_bad_samples_and_evaluates_your_data(
    emoji: dict, tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    """A damaged CSV trains (3 bad samples skipped, counted in metrics.jsonl), with retrieval recall
    both ways on data.val_path and zero-shot top-1 on an ImageFolder; at max_bad_fraction 0 it stops
    with exit code 2 and one line naming the file."""
    from titan_contrastive.train import main

    caplog.set_level("INFO", logger="titan_contrastive")
    root = emoji["root"]
    for c, name in enumerate(["alpha", "beta"]):
        (tmp_path / "zs" / name).mkdir(parents=True)
        for i in range(3):
            (tmp_path / "zs" / name / f"{i}.png").write_bytes((root / "img" / f"{c * 3 + i:04d}.png").read_bytes())
    args = [
        "--data.dataset=csv",
        f"--data.path={_damaged_csv(emoji, tmp_path)}",
        f"--data.val_path={emoji['paths']['csv']}",
        "--data.image_size=32",
        "--training.local_batch_size=20",
        "--training.steps=2",
        "--metrics.log_freq=1",
        "--metrics.enable_tensorboard=false",
        f"--eval.zero_shot_path={tmp_path / 'zs'}",
        "--eval.zero_shot_templates=simple",
    ]
    assert main([*args, "--data.max_bad_fraction=0.1", f"--job.dump_folder={tmp_path / 'run'}"]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert train[-1]["bad_samples"] == 3 and train[-1]["bad_samples/unreadable_file"] == 1
    evals = [r for r in records if r["kind"] == "eval"][-1]
    assert evals["num_samples"] == 200 and evals["zero_shot/num_samples"] == 6
    assert {"image_to_text_r@10", "text_to_image_r@1", "zero_shot/zero_shot_top1"} <= evals.keys()
    assert (
        "skipped bad sample" in caplog.text
        and "eval step 2 on 200 csv test samples and 6 zero_shot test samples" in caplog.text
    )
    capsys.readouterr()
    assert main([*args, "--data.max_bad_fraction=0", f"--job.dump_folder={tmp_path / 'strict'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "data.max_bad_fraction" in err[0]
        and any(f in err[0] for f in ("damaged.csv", "missing.png", "bad.jpg"))
    ), err


def test_pairs_equal_the_bundled_wordnet_and_resume(tmp_path: Path) -> None:
    """WordNet's test pairs written as JSONL serve the bundled wordnet loader's exact tensors, and
    the loader over them resumes exactly (2 ranks, 2 workers)."""
    require("hf")
    import gzip

    from titan_contrastive.datasets.pairs import PairsDataset
    from titan_contrastive.datasets.wordnet import BUNDLE_DIR
    from titan_contrastive.models.bi_encoder import BiEncoderArgs, build_tokenizer

    tokenizer = build_tokenizer(BiEncoderArgs())
    bundled = build_dataset("wordnet", "test", context_length=24, tokenizer=tokenizer)
    lines = gzip.decompress((BUNDLE_DIR / "pairs_test.tsv.gz").read_bytes()).decode().splitlines()
    with open(tmp_path / "p.jsonl", "w") as f:
        for line in lines:
            query, doc = line.split("\t")
            f.write(json.dumps({"query": query, "positive": doc}) + "\n")
    ds = PairsDataset(split="test", path=str(tmp_path / "p.jsonl"), tokenizer=tokenizer, query_length=24)
    indices = [0, 17, 1999, 5]
    got, want = ds.__getitems__(indices), bundled.__getitems__(indices)
    assert len(ds) == len(bundled) == 2000 and got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    for rank in range(2):

        def loader(rank: int = rank):  # bound now: called within this iteration only
            return build_dataloader(ds, local_batch_size=300, dp_rank=rank, dp_world_size=2, seed=2, num_workers=2)

        whole, first = _take(loader(), 6), loader()
        _take(first, 2)
        resumed = loader()
        resumed.load_state_dict(first.state_dict())
        assert all(
            torch.equal(a["query"], b["query"]) and torch.equal(a["doc"], b["doc"])
            for a, b in zip(_take(resumed, 4), whole[2:])
        )
