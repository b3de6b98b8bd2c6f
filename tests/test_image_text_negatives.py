"""Negative captions of image-text data (csv, webdataset, hf): hard negatives of each image.

- every source serves `neg` [B, k, L], the negative captions tokenized like the captions, for
  the train split only and only with data.hard_negatives;
- a record whose negatives are missing or of another count is a bad sample (missing_negatives,
  ragged_negatives): substituted and counted;
- a key that names no column, or is set for another kind of data, is one line at start;
- a float64 clip model with dropout, one step on captions with two negatives each (GradCache in
  chunks of 3 of 7 samples; plain accumulation; global negatives over 2 microbatches): the loss
  and every parameter gradient equal InfoNCE written here from the definition (image -> text over
  the N (1 + k) text columns, text -> image over the positives) within 1e-10, the reference
  forwarding the step's chunks in order from the same seed so that dropout draws the same.
"""

from __future__ import annotations

import csv
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from tests.needs import installed, needs
from tests.test_hard_negatives import assert_grads_close
from tests.test_trainer import grads
from tests.test_trainer import make_trainer as base_trainer
from titan_contrastive.batching import NEGATIVES, with_negatives
from titan_contrastive.config.data import Data
from titan_contrastive.datasets import DataError
from titan_contrastive.datasets.bad_samples import BAD_SAMPLES
from titan_contrastive.datasets.build import build_file_dataset, check_negative_keys, open_source
from titan_contrastive.datasets.tokenizer import ByteTokenizer

REL = 1e-10
N = 9
CAPTIONS = [f"a photo of thing {i}" for i in range(N)]
NEGS = [(f"a drawing of thing {i}", f"a photo of thing {(i + 1) % N} upside down") for i in range(N)]
TOKENIZER = ByteTokenizer(16)


def write_tar(path: Path, root: Path, negatives: dict[int, list[str]]) -> Path:
    """A shard of samples i (image, caption, .json with `negatives`, .neg.txt one per line)."""
    with tarfile.open(path, "w") as tar:
        for i, negs in negatives.items():
            for ext, data in (
                ("png", (root / "img" / f"{i}.png").read_bytes()),
                ("txt", CAPTIONS[i].encode()),
                ("json", json.dumps({"negatives": negs}).encode()),
                ("neg.txt", "\n".join(negs).encode() + b"\n"),
            ):
                info = tarfile.TarInfo(f"{i:04d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """N 16x16 RGB PNGs with captions and two negatives each, as a CSV, tar shards and a HF dataset."""
    root = tmp_path_factory.mktemp("negs")
    rng = np.random.default_rng(0)
    (root / "img").mkdir()
    for i in range(N):
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(root / "img" / f"{i}.png")
    with open(root / "train.csv", "w", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(["filepath", "title", "neg_a", "neg_b"])
        writer.writerows([f"img/{i}.png", CAPTIONS[i], *NEGS[i]] for i in range(N))
    (root / "shards").mkdir()
    for shard, members in enumerate((range(0, 5), range(5, N))):
        write_tar(root / "shards" / f"{shard}.tar", root, {i: list(NEGS[i]) for i in members})
    if installed("data"):
        _save_hf(root)
    return {"root": root, "csv": root / "train.csv", "webdataset": root / "shards" / "{0..1}.tar", "hf": root / "hf"}


def _save_hf(root: Path) -> None:
    import datasets

    ds = datasets.Dataset.from_dict(
        {
            "image": [str(root / "img" / f"{i}.png") for i in range(N)],
            "text": CAPTIONS,
            "negs": [list(n) for n in NEGS],
            "neg_a": [n[0] for n in NEGS],
            "neg_b": [n[1] for n in NEGS],
            "number": list(range(N)),
        }
    )
    ds.cast_column("image", datasets.Image()).save_to_disk(str(root / "hf"))


SETTINGS = {
    "csv": [{"csv_negative_keys": ["neg_a", "neg_b"]}],
    "webdataset": [{"wds_negative_key": "json:negatives"}, {"wds_negative_key": "neg.txt"}],
    "hf": [{"hf_negative_columns": ["negs"]}, {"hf_negative_columns": ["neg_a", "neg_b"]}],
}
CASES = [
    pytest.param(kind, setting, id=f"{kind}-{list(setting.values())[0]}", marks=needs("data") if kind == "hf" else ())
    for kind, settings in SETTINGS.items()
    for setting in settings
]


def dataset(files: dict, kind: str, setting: dict, split: str = "train", path: str = "", **data: object):
    return build_file_dataset(
        kind,
        split,
        path or str(files[kind]),
        Data(dataset=kind, **setting, **data),
        tokenizer=TOKENIZER,
        image_size=16,
        seed=0,
        augment=False,
    )


def want_negatives(indices: list[int]) -> torch.Tensor:
    return TOKENIZER.encode([t for i in indices for t in NEGS[i]]).view(len(indices), 2, -1)


@pytest.mark.parametrize("kind,setting", CASES)
def test_sources_serve_negative_captions(files: dict, kind: str, setting: dict) -> None:
    ds = dataset(files, kind, setting)
    indices = [4, 0, 8, 5]
    batch = ds.__getitems__(indices)
    assert ds.num_negatives == 2 and batch[NEGATIVES].dtype == torch.int64
    assert torch.equal(batch[NEGATIVES], want_negatives(indices)), TOKENIZER.decode(batch[NEGATIVES].flatten(0, 1))
    assert torch.equal(batch["text"], TOKENIZER.encode([CAPTIONS[i] for i in indices])) and not batch[BAD_SAMPLES]
    # held-out data and data.hard_negatives = false: no negatives read
    assert NEGATIVES not in dataset(files, kind, setting, split="test").__getitems__(indices)
    off = dataset(files, kind, setting, hard_negatives=False)
    assert off.num_negatives == 0 and NEGATIVES not in off.__getitems__(indices)


def test_bad_negatives_are_substituted_and_counted(files: dict, tmp_path: Path) -> None:
    root = files["root"]
    rows = [[f"{root}/img/{i}.png", CAPTIONS[i], *NEGS[i]] for i in range(N)]
    rows[1][3] = ""  # a missing negative
    with open(tmp_path / "bad.csv", "w", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerows([["filepath", "title", "neg_a", "neg_b"], *rows])
    ds = dataset(files, "csv", SETTINGS["csv"][0], path=str(tmp_path / "bad.csv"))
    batch = ds.__getitems__([0, 1, 2])
    assert [b.reason for b in batch[BAD_SAMPLES]] == ["missing_negatives"]
    assert torch.equal(batch[NEGATIVES], want_negatives([0, 2, 2]))  # slot 1 takes sample 2, negatives and all
    # a sample with three negatives among samples with two (the count is the first sample's)
    negatives = {i: list(NEGS[i]) + (["one more"] if i == 1 else []) for i in range(3)}
    shard = write_tar(tmp_path / "ragged.tar", root, negatives)
    for setting in SETTINGS["webdataset"]:
        batch = dataset(files, "webdataset", setting, path=str(shard)).__getitems__([1, 0])
        assert [b.reason for b in batch[BAD_SAMPLES]] == ["ragged_negatives"], setting
        assert "3 negative captions" in str(batch[BAD_SAMPLES][0])
        assert torch.equal(batch[NEGATIVES], want_negatives([2, 0]))


def _one_line(err: pytest.ExceptionInfo, *needles: str) -> None:
    message = str(err.value)
    assert len(message.splitlines()) == 1, message
    for needle in needles:
        assert needle in message, message


REJECTED = [
    ("csv", {"csv_negative_keys": ["neg_a", "nope"]}, ("'nope'", "data.csv_negative_keys")),
    ("hf", {"hf_negative_columns": ["nope"]}, ("'nope'", "data.hf_negative_columns")),
    ("hf", {"hf_negative_columns": ["number"]}, ("'number'", "not captions", "data.hf_negative_columns")),
    ("hf", {"hf_negative_columns": ["negs", "neg_a"]}, ("'negs'", "data.hf_negative_columns")),
    ("webdataset", {"wds_negative_key": "json:nope"}, ("data.wds_negative_key='json:nope'",)),
    ("webdataset", {"wds_negative_key": "nope.txt"}, ("data.wds_negative_key='nope.txt'",)),
]


@pytest.mark.parametrize(
    "kind,setting,needles",
    [pytest.param(*row, marks=needs("data") if row[0] == "hf" else ()) for row in REJECTED],
    ids=[f"{kind}-{list(setting.values())[0]}" for kind, setting, _ in REJECTED],
)
def test_negative_settings_are_checked_at_start(files: dict, kind: str, setting: dict, needles: tuple) -> None:
    with pytest.raises(DataError) as err:
        dataset(files, kind, setting)
    _one_line(err, *needles)


def test_settings_are_checked_at_start(files: dict, tmp_path: Path) -> None:
    with pytest.raises(DataError) as err:
        check_negative_keys(Data(dataset="webdataset", csv_negative_keys=["neg_a"]))
    _one_line(err, "data.csv_negative_keys", "data.wds_negative_key")
    with pytest.raises(DataError) as err:
        check_negative_keys(Data(dataset="pairs", hf_negative_columns=["negs"]))
    _one_line(err, "data.hf_negative_columns", "extra columns")
    data = Data(dataset="webdataset", wds_negative_key="json:negatives")
    three = write_tar(tmp_path / "three.tar", files["root"], {i: [*NEGS[i], "a third"] for i in range(2)})
    assert open_source("webdataset", f"{files['webdataset']}::{files['webdataset']}", data, negatives=True)
    with pytest.raises(DataError) as err:  # joined sources must agree on k
        open_source("webdataset", f"{files['webdataset']}::{three}", data, negatives=True)
    _one_line(err, "three.tar: 3", "different numbers of negative captions")


# --- exactness: one GradCache step of a float64 clip model with dropout ----------------------------


def dense_reference(img: torch.Tensor, txt: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE from the definition: image i against the columns [t_1..t_N, n_11..n_1k, ...,
    n_Nk] (its caption the target), caption j against the N images (positives only)."""
    n = len(img)
    positives, negatives = txt[:, 0], txt[:, 1:].flatten(0, 1)
    labels = torch.arange(n)
    image_to_text = F.cross_entropy(scale * img @ torch.cat([positives, negatives]).T, labels)
    text_to_image = F.cross_entropy(scale * positives @ img.T, labels)
    return 0.5 * (image_to_text + text_to_image)


KINDS = {  # local batch, accumulation steps, the forwards' chunks in the step, flags
    "gradcache-chunks-of-3": (
        7,
        1,
        [(0, 3), (3, 6), (6, 7)],
        ["--gradcache.enabled=true", "--gradcache.chunk_sizes=3"],
    ),
    "accumulate": (7, 1, [(0, 7)], []),
    "global": (3, 2, [(0, 3), (3, 6)], ["--loss.negatives=global", "--loss.stream_chunk_size=5"]),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_negative_captions_in_a_step_equal_the_definition(files: dict, tmp_path: Path, kind: str) -> None:
    local, ga, chunks, extra = KINDS[kind]
    trainer = base_trainer(
        str(tmp_path / "run"),
        "--model.name=clip",
        "--model.flavor=debug",
        "--data.dataset=csv",
        f"--data.path={files['csv']}",
        "--data.csv_negative_keys=neg_a,neg_b",
        "--data.tokenizer=byte",
        "--data.context_length=16",
        "--data.image_size=16",
        f"--training.local_batch_size={local}",
        f"--training.global_batch_size={local * ga}",
        "--eval.enable=false",
        *extra,
    )
    model = trainer.model
    for block in model.blocks():  # the family's residual dropout, on
        block.dropout = nn.Dropout(0.1)
    assert model.training
    batch = trainer.train_set.__getitems__(list(range(local * ga)))
    batch.pop(BAD_SAMPLES)
    assert batch[NEGATIVES].shape == (local * ga, 2, 16)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(11)
    out = trainer.train_step([{k: v[j * local : (j + 1) * local] for k, v in batch.items()} for j in range(ga)])
    got = grads(model)

    model.load_state_dict(init)
    model.zero_grad()
    torch.manual_seed(11)  # the chunks forwarded in order from the same seed draw the step's dropout
    parts = []
    for start, stop in chunks:
        chunk = {k: v[start:stop] for k, v in batch.items()}
        img, txt, scale = model(chunk["image"].double(), with_negatives(chunk["text"], chunk[NEGATIVES], None))
        parts.append((img, txt.reshape(len(img), 3, -1), scale))
    img, txt = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    loss = dense_reference(img, txt, parts[0][2].squeeze())
    loss.backward()
    assert abs(out["loss"] - loss.item()) <= REL * loss.item()
    assert_grads_close(got, grads(model))
    trainer.metrics.close()
