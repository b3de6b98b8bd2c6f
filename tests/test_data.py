"""Data layer: tokenizer, bundles, error messages, per-sample determinism, resumption, rank invariance."""

from __future__ import annotations

import ctypes
import gzip
import io
import multiprocessing
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from titan_contrastive.datasets import (
    DATASETS,
    ByteTokenizer,
    DataError,
    EpochLoader,
    ImageTextDataset,
    build_dataloader,
    build_dataset,
    emoji,
    fashion_mnist,
)
from titan_contrastive.datasets.loader import BlockedDistributedSampler

BUNDLE = str(fashion_mnist.BUNDLE_DIR)


def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 8, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes()))


def write_fashion_folder(folder: Path, n: int = 30) -> Path:
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        image_file, label_file = fashion_mnist.FILES[split]
        write_idx(folder / image_file, rng.integers(0, 256, (n, 28, 28)))
        write_idx(folder / label_file, np.arange(n) % 10)
    return folder


def tiny_dataset(n: int = 40, split: str = "train", seed: int = 7) -> ImageTextDataset:
    """A small in-memory dataset whose epochs end after a few batches."""
    images = torch.randint(0, 256, (n, 1, 4, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(n) % 3
    return ImageTextDataset(
        name="tiny",
        split=split,
        images=images,
        labels=labels,
        text_ids=labels,
        subjects=["a", "b", "c"],
        templates=["{}", "x {}", "y {}", "z {}"],
        mean=(0.5,),
        std=(0.25,),
        class_names=["a", "b", "c"],
        seed=seed,
        hflip=split == "train",
        context_length=8,
        source="memory",
        full=True,
    )


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_layout_and_round_trip() -> None:
    tok = ByteTokenizer(context_length=12)
    texts = ["abc", "", "héllo", "a" * 40]
    ids = tok.encode(texts)
    assert ids.shape == (4, 12) and ids.dtype == torch.int64
    assert (ids[:, 0] == tok.BOS).all() and int(ids.max()) < tok.vocab_size == 259
    eos = (ids == tok.EOS).int().argmax(-1)
    assert eos.tolist() == [4, 1, 7, 11]  # 1 + utf-8 length, capped at context_length - 1
    assert ((ids == tok.EOS).sum(-1) == 1).all()
    for row, pos in zip(ids, eos.tolist()):
        assert (row[pos + 1 :] == tok.PAD).all() and (row[1:pos] >= tok.OFFSET).all()
    assert tok.decode(ids) == ["abc", "", "héllo", "a" * 10]
    with pytest.raises(TypeError):
        tok.encode("abc")  # type: ignore[arg-type]


def test_fashion_captions_fit_default_context() -> None:
    ds = build_dataset("fashion_mnist", "test", path=BUNDLE)
    assert len(ds.templates) >= 4 and ds.class_names == fashion_mnist.CLASS_NAMES
    texts = [t.format(c) for t in ds.templates for c in ds.class_names]
    assert ds.tokenizer.decode(ds.encode_text(texts)) == texts


# ---------------------------------------------------------------- bundles and sources


def test_fashion_bundle() -> None:
    test = build_dataset("fashion_mnist", "test", path=BUNDLE)
    train = build_dataset("fashion_mnist", "train", path=BUNDLE)
    assert len(test) == 10_000 and test.full and test.image_shape == (1, 28, 28)
    assert torch.bincount(test.labels).tolist() == [1_000] * 10
    assert len(train) == 20_000 and not train.full
    assert torch.bincount(train.labels).tolist() == [2_000] * 10
    batch = test.__getitems__(list(range(256)))
    assert batch["image"].dtype == torch.float32 and abs(float(batch["image"].mean())) < 0.2


def test_emoji_bundle_split() -> None:
    train, test = build_dataset("emoji", "train"), build_dataset("emoji", "test", seed=123)
    assert len(test) == emoji.NUM_TEST and len(train) + len(test) == 1906
    assert test.image_shape == (3, 32, 32) and test.class_names is None
    assert not set(train.subjects) & set(test.subjects) and len(set(train.subjects)) == len(train)
    assert not set(train.labels.tolist()) & set(test.labels.tolist())
    assert torch.equal(test.labels, build_dataset("emoji", "test", seed=5).labels)  # independent of seed
    assert test.captions([0]) == [test.subjects[0]]


def test_fashion_source_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fashion_mnist, "SYSTEM_DIR", tmp_path / "absent")
    assert build_dataset("fashion_mnist", "test").source == BUNDLE
    system = write_fashion_folder(tmp_path)
    monkeypatch.setattr(fashion_mnist, "SYSTEM_DIR", system)
    ds = build_dataset("fashion_mnist", "train")
    assert ds.source == str(system) and len(ds) == 30 and not ds.full
    assert build_dataset("fashion_mnist", "test", path=BUNDLE).source == BUNDLE  # path wins


# ---------------------------------------------------------------- errors


def test_unknown_name_split_and_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="fashion_mnist, emoji"):
        build_dataset("cifar", "train")
    with pytest.raises(DataError, match="train, test"):
        build_dataset("emoji", "val")
    with pytest.raises(DataError, match=f"data.path={tmp_path / 'nope'}: no such folder"):
        build_dataset("fashion_mnist", "train", path=str(tmp_path / "nope"))
    with pytest.raises(DataError, match="missing file .*train-images-idx3-ubyte.gz; .*dataset-fashion-mnist"):
        build_dataset("fashion_mnist", "train", path=str(tmp_path))
    with pytest.raises(DataError, match="missing file .*x.npz"):
        build_dataset("emoji", "train", path=str(tmp_path / "x.npz"))


@pytest.mark.parametrize("damage", ["truncated_gzip", "not_gzip", "magic", "short", "count", "label_range"])
def test_corrupt_fashion_file_names_the_file(tmp_path: Path, damage: str) -> None:
    folder = write_fashion_folder(tmp_path)
    assert len(build_dataset("fashion_mnist", "test", path=str(folder))) == 30  # read once, then damaged in place:
    image_file, label_file = (folder / name for name in fashion_mnist.FILES["test"])  # the damage is what is read
    bad = label_file if damage in ("count", "label_range") else image_file
    if damage == "truncated_gzip":
        bad.write_bytes(bad.read_bytes()[:200])
    elif damage == "not_gzip":
        bad.write_bytes(b"hello")
    elif damage == "magic":
        write_idx(bad, np.zeros((30, 28), dtype=np.uint8))  # a 2-d IDX array
    elif damage == "short":
        bad.write_bytes(gzip.compress(gzip.decompress(bad.read_bytes())[:-5]))
    elif damage == "count":
        write_idx(bad, np.zeros(29))
    else:
        write_idx(bad, np.full(30, 10))
    with pytest.raises(DataError, match=str(bad)) as info:
        build_dataset("fashion_mnist", "test", path=str(folder))
    assert "\n" not in str(info.value)


def test_corrupt_emoji_npz(tmp_path: Path) -> None:
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"PK\x03\x04 garbage")
    with pytest.raises(DataError, match=f"{bad}: not a readable .npz"):
        build_dataset("emoji", "train", path=str(bad))
    np.savez(bad, images=np.zeros((300, 8, 8, 3), np.uint8))
    with pytest.raises(DataError, match="missing array.*names"):
        build_dataset("emoji", "train", path=str(bad))
    np.savez(bad, images=np.zeros((300, 8, 8, 3), np.uint8), names=np.array([str(i) for i in range(300)]))
    assert len(build_dataset("emoji", "test", path=str(bad))) == emoji.NUM_TEST


def test_batch_larger_than_dataset() -> None:
    with pytest.raises(DataError, match="16 x dp_world_size=4 = 64 samples per step exceeds the 40 samples"):
        build_dataloader(tiny_dataset(), local_batch_size=16, dp_rank=0, dp_world_size=4, seed=0)


# ---------------------------------------------------------------- per-sample determinism


def test_sample_is_a_function_of_seed_epoch_index() -> None:
    ds = build_dataset("fashion_mnist", "train", path=BUNDLE, seed=3)
    a = ds.__getitems__([5, 17, 3])
    b = ds.__getitems__([3, 100, 17, 5, 9])
    for key in ("image", "text", "label", "index"):
        assert torch.equal(a[key], b[key][[3, 2, 0]])
        assert torch.equal(ds[17][key], a[key][1])
    plain = build_dataset("fashion_mnist", "train", path=BUNDLE, augment=False).__getitems__(list(range(256)))
    e0 = ds.__getitems__(list(range(256)))
    flipped = (e0["image"] != plain["image"]).flatten(1).any(1)
    assert torch.equal(e0["image"][flipped], plain["image"][flipped].flip(-1)) and 64 < flipped.sum() < 192
    assert len(set(ds.tokenizer.decode(e0["text"]))) > 20  # several templates x classes
    ds.set_epoch(1)
    e1 = ds.__getitems__(list(range(256)))
    assert not torch.equal(e0["text"], e1["text"]) and not torch.equal(e0["image"], e1["image"])
    ds.set_epoch(0)
    assert torch.equal(ds.__getitems__(list(range(256)))["text"], e0["text"])


def test_test_split_is_deterministic() -> None:
    ds = build_dataset("fashion_mnist", "test", path=BUNDLE, seed=9)
    batch = ds.__getitems__(list(range(64)))
    ds.set_epoch(4)
    assert torch.equal(ds.__getitems__(list(range(64)))["image"], batch["image"])
    assert torch.equal(batch["text"], ds.encode_text(ds.captions(list(range(64)))))


# ---------------------------------------------------------------- sampler and loader


def take(loader: EpochLoader, k: int) -> list[dict[str, torch.Tensor]]:
    return [next(loader) for _ in range(k)]


def test_sampler_blocks_are_disjoint_and_cover_the_epoch() -> None:
    shards = [list(BlockedDistributedSampler(50, local_batch_size=4, rank=r, world_size=3, seed=1)) for r in range(3)]
    assert [len(s) for s in shards] == [16, 16, 16]
    assert len(set().union(*map(set, shards))) == 48
    padded = [
        list(BlockedDistributedSampler(50, local_batch_size=4, rank=r, world_size=3, seed=1, drop_last=False))
        for r in range(3)
    ]
    assert [len(s) for s in padded] == [20, 20, 20] and set().union(*map(set, padded)) == set(range(50))


def test_rank_split_invariance_across_epochs() -> None:
    kwargs = dict(seed=11, num_workers=0)
    single = build_dataloader(tiny_dataset(), local_batch_size=16, dp_rank=0, dp_world_size=1, **kwargs)
    ranks = [
        build_dataloader(tiny_dataset(), local_batch_size=8, dp_rank=r, dp_world_size=2, **kwargs) for r in range(2)
    ]
    assert single.steps_per_epoch == 2
    for _ in range(7):  # 3.5 epochs
        whole = next(single)
        parts = [next(loader) for loader in ranks]
        for key in ("index", "image", "text"):
            assert torch.equal(whole[key], torch.cat([p[key] for p in parts]))
    assert single.epoch == single.dataset.epoch == 3


@pytest.mark.parametrize("k", [0, 2, 3, 5, 7])
@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_continues_with_the_same_batches(k: int, world_size: int) -> None:
    """20 samples, local batch 4: epochs of 5 steps (1 rank) or 2 steps (2 ranks); k + 6 crosses them."""

    def make() -> EpochLoader:
        return build_dataloader(
            tiny_dataset(20), local_batch_size=4, dp_rank=world_size - 1, dp_world_size=world_size, seed=2
        )

    reference = take(make(), k + 6)
    interrupted = make()
    take(interrupted, k)
    buffer = io.BytesIO()
    torch.save(interrupted.state_dict(), buffer)
    restored = make()
    restored.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    resumed = make()  # saving again before any step must keep the position too
    resumed.load_state_dict(restored.state_dict())
    for want, got in zip(reference[k:], take(resumed, 6)):
        assert torch.equal(want["index"], got["index"]) and torch.equal(want["image"], got["image"])
        assert torch.equal(want["text"], got["text"])


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_workers_match_main_process_and_resume(start: str) -> None:
    """Workers started as Linux does up to Python 3.13 (fork) and as Python 3.14 does (forkserver:
    the dataset and the loader's functions pickled into a process that shares none of this one's
    memory, as with macOS's spawn) yield the main process's batches, and resume them."""

    def make(workers: int) -> EpochLoader:
        return build_dataloader(
            tiny_dataset(), local_batch_size=8, dp_rank=0, dp_world_size=1, seed=4, num_workers=workers
        )

    reference = take(make(0), 12)
    before = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method(start, force=True)
    try:
        loader = make(2)
        first = take(loader, 7)
        state = loader.state_dict()
        resumed = make(2)
        resumed.load_state_dict(state)
        rest = take(resumed, 5)
    finally:
        multiprocessing.set_start_method(before, force=True)
    for want, got in zip(reference, first + rest, strict=True):
        assert torch.equal(want["index"], got["index"]) and torch.equal(want["image"], got["image"])
        assert torch.equal(want["text"], got["text"])


def test_ending_the_workers_keeps_the_batches() -> None:
    """`end_workers` (the trainer's, when its loop ends) leaves no worker process, and the next batches start new
    ones where they left off: the same batches as a loader never stopped, across an epoch's end."""
    import multiprocessing as mp

    def make(workers: int) -> EpochLoader:
        return build_dataloader(
            tiny_dataset(), local_batch_size=8, dp_rank=0, dp_world_size=1, seed=4, num_workers=workers
        )

    reference, before = take(make(0), 12), set(mp.active_children())  # another test's may still be ending
    loader = make(2)
    first = take(loader, 5)
    assert len(set(mp.active_children()) - before) == 2
    loader.end_workers()
    assert not set(mp.active_children()) - before
    rest = take(loader, 7)
    loader.end_workers()
    for want, got in zip(reference, first + rest, strict=True):
        assert torch.equal(want["index"], got["index"]) and torch.equal(want["image"], got["image"])
    make(0).end_workers()  # without workers: nothing to end


class _FreezeSeen(ImageTextDataset):
    """tiny_dataset's samples, each batch with how many objects the process making it holds frozen (`gc.freeze`)."""

    def __getitems__(self, indices):
        import gc

        return {**super().__getitems__(indices), "frozen": torch.tensor([gc.get_freeze_count()])}


def test_workers_are_forked_with_the_parents_objects_frozen() -> None:
    """Every epoch's workers start with this process's objects frozen (their garbage collections leave the pages
    they share with it alone, `loader.started`); this process unfreezes them once they have started."""
    import gc

    dataset = tiny_dataset()
    dataset.__class__ = _FreezeSeen
    loader = build_dataloader(dataset, local_batch_size=8, dp_rank=0, dp_world_size=1, seed=4, num_workers=2)
    batches = take(loader, 2 * loader.steps_per_epoch + 1)  # three epochs' workers
    loader.end_workers()
    assert all(int(b["frozen"][0]) > 1000 for b in batches), [int(b["frozen"][0]) for b in batches]
    assert gc.get_freeze_count() == 0


class _MallInfo(ctypes.Structure):
    """glibc's `struct mallinfo2`."""

    _fields_ = [(name, ctypes.c_size_t) for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks".split()]
    _fields_ += [(name, ctypes.c_size_t) for name in ("uordblks", "fordblks", "keepcost")]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = _MallInfo
    return libc


def _mapped(size: int) -> int:
    """The bytes of a block of `size` that C's malloc gives its own mapping (glibc's count of them, held)."""
    libc = _libc()
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(size)
    mapped = libc.mallinfo2().hblkhd - before
    libc.free(block)
    return mapped


def _kept(count: int, size: int) -> int:
    """The resident bytes this process holds more after `count` blocks of `size` bytes (C's malloc: no Python
    object between them), each written, are freed."""

    def resident() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    libc, blocks = _libc(), [0] * count
    before = resident()
    for i in range(count):
        blocks[i] = libc.malloc(size)
        ctypes.memset(blocks[i], 1, size)
    for block in blocks:
        libc.free(block)
    return resident() - before


def _blocks_seen() -> list[int]:
    """What this process's C library mapped of an 8 MiB block, and the resident memory it kept of 24 MiB allocated
    and freed in blocks of 96 KiB (below the threshold: from the heap)."""
    return [_mapped(8 << 20), _kept(256, 96 << 10)]


class _HeapSeen(ImageTextDataset):
    """tiny_dataset's samples, each batch with its worker's `_blocks_seen`."""

    def __getitems__(self, indices):
        return {**super().__getitems__(indices), "heap": torch.tensor(_blocks_seen())}


class _HeapChunks(torch.utils.data.Dataset):
    """embed_images' chunks, each its worker's `_blocks_seen`."""

    def __len__(self) -> int:
        return 3

    def __getitem__(self, chunk: int) -> list[int]:
        return _blocks_seen()


def _workers_keep() -> None:
    from titan_contrastive.embed_images import rounds_of

    libc = _libc()
    libc.free(libc.malloc(16 << 20))  # as in a trainer: glibc's thresholds raised to 16 MiB, its heap's trim to 32
    dataset = tiny_dataset()
    dataset.__class__ = _HeapSeen
    loader = build_dataloader(dataset, local_batch_size=8, dp_rank=0, dp_world_size=1, seed=4, num_workers=1)
    seen = {"trainer": [b["heap"].tolist() for b in take(loader, 3)]}
    loader.end_workers()
    seen["embed_images"] = list(rounds_of(_HeapChunks(), 3, workers=1))
    assert all(mapped >= 8 << 20 and kept < 4 << 20 for got in seen.values() for mapped, kept in got), seen


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="glibc 2.33 or later")
def test_workers_return_the_blocks_they_free() -> None:
    """A data worker's freed blocks go back to the system (`loader.return_freed_blocks`; the trainer's workers and
    embed_images'): those of 128 KiB and more have their own mappings, and the heap's free top is trimmed past
    128 KiB, whatever thresholds glibc had raised them to in the process the worker was forked from. That process is
    a fresh interpreter, whose heap holds no free block an 8 MiB one could come from (this one's may)."""
    probe = "from tests.test_data import _workers_keep; _workers_keep()"
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert run.returncode == 0, run.stderr[-2000:]


def test_datasets_constant() -> None:
    assert DATASETS == ("fashion_mnist", "emoji", "wordnet")


def test_image_size_resizes_every_image() -> None:
    native = build_dataset("fashion_mnist", "test", path=BUNDLE)
    big = build_dataset("fashion_mnist", "test", path=BUNDLE, image_size=64)
    assert big.image_shape == (1, 64, 64) and native.image_shape == (1, 28, 28)
    a, b = native.__getitems__([0, 5]), big.__getitems__([0, 5])
    assert b["image"].shape == (2, 1, 64, 64) and torch.equal(a["text"], b["text"])
    want = torch.nn.functional.interpolate(a["image"], size=(64, 64), mode="bilinear", align_corners=False)
    assert torch.equal(b["image"], want)
    assert big[5]["image"].shape == (1, 64, 64)
    big.resize(0)
    assert big.image_shape == (1, 28, 28) and torch.equal(big.__getitems__([0, 5])["image"], a["image"])
    with pytest.raises(DataError, match="data.image_size=-1"):
        big.resize(-1)
