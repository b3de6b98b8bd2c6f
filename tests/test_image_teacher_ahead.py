"""An image-text teacher's embeddings written ahead (`python -m titan_contrastive.embed_images`, then `[loss]
teacher_embeddings` on image-text data): the file holds the teacher's embedding (built here by `load_clip`) of each
image at its evaluation view and of each caption the data can serve; the batches carry, for each sample, the file's
vector of its image as stored (whatever flip or crop it is served) and of the caption it is served with; every step
kind's loss and parameter gradients equal the dense objective taught by those vectors, looked up here from the file by
the SHA-1 of each image's bytes (float64, dropout on, chunks that divide nothing, 1, 2 and 4 gloo processes); on a CSV
served at the evaluation view, a step taught from the file equals one taught by the teacher model to float32's
precision, negatives and a substituted bad image included, and so does one on the CSV's webdataset shards; the file
keeps the teacher's temperature (`distill_temperature = 0` reads it); the file as a guide decides the masks; what
cannot work is one line."""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import logging
import math
import os
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from tests.dist_utils import run_distributed
from tests.test_clip_teacher import KINDS, TEACHER
from tests.test_export import step_folder
from tests.test_hard_negatives import assert_step_equals_its_forwards
from tests.test_trainer import REL, assert_close, full, grads, make_trainer
from titan_contrastive import embed_images
from titan_contrastive.batching import FROZEN_DOCS, FROZEN_QUERIES, NEGATIVES
from titan_contrastive.config import ConfigError
from titan_contrastive.datasets import build_dataset
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.fashion_mnist import BUNDLE_DIR, load_split
from titan_contrastive.losses import build_objective
from titan_contrastive.losses.guide import Guide
from titan_contrastive.models.clip import clip_flavors, load_clip

TAUGHT = ["--loss.distill=kl", "--loss.distill_temperature=0.1"]


def embed(tmp: Path, teacher: Path, *flags: str) -> Path:
    out = tmp / "teacher.parquet"  # the default config has no distillation term: the command reads it anyway
    code = embed_images.main(["--out", str(out), "--batch-size=700", f"--loss.teacher_model={teacher}", *flags])
    assert code == 0
    return out


def read_file(path: Path) -> dict[tuple[str, str], np.ndarray]:
    """(side, key or caption) -> vector, read with pyarrow alone."""
    rows = pq.read_table(path).to_pylist()
    return {(r["side"], r["text"]): np.asarray(r["embedding"], dtype=np.float64) for r in rows}


def embed_bundled(tmp: Path) -> tuple[Path, Path]:
    """(the teacher's folder, its embeddings of the bundled Fashion-MNIST training split)."""
    teacher = step_folder(tmp / "teacher", TEACHER, seed=3)[0]
    return teacher, embed(tmp, teacher, "--data.context_length=32")


@pytest.fixture(scope="module")
def bundled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return embed_bundled(tmp_path_factory.mktemp("ahead"))


def sha1(image: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(image).tobytes()).hexdigest()


def test_the_file_holds_the_teacher_s_embedding_of_each_image_and_caption(bundled: tuple[Path, Path]) -> None:
    teacher, path = bundled
    table = read_file(path)
    images, _ = load_split(BUNDLE_DIR, "train")
    keys = [sha1(x) for x in images]
    data = build_dataset("fashion_mnist", "train", augment=False)  # unflipped
    captions = data.caption_texts()
    assert {k for k in table} == {("image", k) for k in keys} | {("caption", c) for c in captions}
    model = load_clip(teacher).double()
    at = [0, 1, 777, len(keys) - 1]
    with torch.no_grad():
        want_images = model(data.__getitems__(at)["image"].double(), data.encode_text(captions[: len(at)]))[0]
        want_captions = model(data.__getitems__(range(50))["image"].double(), data.encode_text(captions))[1]
    got_images = torch.tensor(np.stack([table["image", keys[i]] for i in at]))
    got_captions = torch.tensor(np.stack([table["caption", c] for c in captions]))
    torch.testing.assert_close(got_images, want_images, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_captions, want_captions, rtol=1e-5, atol=1e-6)


def file_guide(trainer, path: Path, batches: list[dict]) -> Guide:
    """The file's unit vectors of the batches' images (by the SHA-1 of each stored image) and served captions (by
    their tokens), looked up here."""
    table = read_file(path)
    keys = [sha1(x) for x in load_split(BUNDLE_DIR, "train")[0]]
    captions = trainer.train_set.caption_texts()
    tokens = trainer.train_set.encode_text(captions)
    images, texts = [], []
    for batch in batches:
        images += [table["image", keys[i]] for i in batch["index"].tolist()]
        served = [int((tokens == row).all(1).nonzero()) for row in batch["text"]]
        texts += [table["caption", captions[c]] for c in served]
    return Guide(*(F.normalize(torch.tensor(np.stack(v)), dim=-1) for v in (images, texts)))


@pytest.fixture
def dropout_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(clip_flavors, "debug", dataclasses.replace(clip_flavors["debug"], dropout=0.1))


def test_the_file_keeps_the_teacher_s_temperature_which_the_start_log_prints(
    tmp_path: Path, bundled: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    teacher, path = bundled
    scale = load_clip(teacher).logit_scale.item()
    assert float(pq.read_schema(path).metadata[b"teacher_logit_scale"]) == scale
    caplog.set_level(logging.INFO, logger="titan_contrastive")
    make_trainer(str(tmp_path / "run"), f"--loss.teacher_embeddings={path}", *TAUGHT).metrics.close()
    assert f"the teacher's own temperature is {math.exp(-scale):.4g}" in caplog.text
    own = "--loss.distill_temperature=0"  # the file's
    trainer = make_trainer(str(tmp_path / "own"), f"--loss.teacher_embeddings={path}", *TAUGHT, own)
    assert trainer.objective.distillation.temperature == math.exp(-scale)
    trainer.metrics.close()
    plain = tmp_path / "plain.jsonl"  # a .jsonl file keeps no metadata
    plain.write_text("".join(json.dumps(row) + "\n" for row in pq.read_table(path).to_pylist()))
    with pytest.raises(ConfigError) as err:
        make_trainer(str(tmp_path / "plain"), f"--loss.teacher_embeddings={plain}", *TAUGHT, own)
    one_line(
        err, f"loss.distill_temperature=0 takes the teacher's own temperature, and loss.teacher_embeddings={plain}"
    )
    bad = tmp_path / "bad.parquet"
    table = pq.read_table(path)
    pq.write_table(table.replace_schema_metadata({"teacher_logit_scale": "inf"}), bad)
    with pytest.raises(DataError) as err:
        make_trainer(str(tmp_path / "bad"), f"--loss.teacher_embeddings={bad}", *TAUGHT)
    one_line(err, f"loss.teacher_embeddings={bad}", "teacher_logit_scale metadata is b'inf'")


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_teacher_written_ahead_in_every_step_kind_equals_the_dense_objective(
    tmp_path: Path, bundled: tuple[Path, Path], dropout_on: None, kind: str
) -> None:
    local, ga, flags = KINDS[kind]
    path = bundled[1]
    trainer = make_trainer(
        str(tmp_path / "run"),
        f"--training.local_batch_size={local}",
        f"--training.global_batch_size={local * ga}",
        f"--loss.teacher_embeddings={path}",
        *TAUGHT,
        *flags,
    )
    assert "the frozen teacher's cosines (embedded ahead, from the data)" in trainer.gradient_step.describe()
    microbatches = [trainer.train_set.__getitems__(list(range(j * local, (j + 1) * local))) for j in range(ga)]
    unflipped = build_dataset("fashion_mnist", "train", augment=False).__getitems__(range(local))["image"]
    assert (microbatches[0]["image"] != unflipped).any(), "no sample is served flipped: the test would not show it"
    pieces = trainer.step_context.split(microbatches[0], 3) if kind.startswith("gradcache") else microbatches
    taught = build_objective(trainer.cfg.loss).with_teacher(file_guide(trainer, path, microbatches))
    assert_step_equals_its_forwards(trainer, microbatches, pieces, seed=4, objective=taught)
    trainer.metrics.close()


def test_a_guide_written_ahead_decides_the_masks(tmp_path: Path, bundled: tuple[Path, Path], dropout_on: None) -> None:
    """GISTEmbed on image-text from the file (`guide_embeddings`): GradCache 3 over 7 against the dense objective with
    the margin mask of the file's cosines, which is not the model's own."""
    path = bundled[1]
    trainer = make_trainer(
        str(tmp_path / "run"),
        "--training.local_batch_size=7",
        "--gradcache.enabled=true",
        "--gradcache.chunk_sizes=3",
        f"--loss.guide_embeddings={path}",
        "--loss.mask_margin=-0.1",
    )
    batch = trainer.train_set.__getitems__(list(range(7)))
    guide = file_guide(trainer, path, [batch])
    objective = build_objective(trainer.cfg.loss)
    with torch.no_grad():
        q, d = trainer.step_context.encode(batch)[:2]
    by_guide = objective.false_negatives.guided(guide).dense(q.double(), d.double(), None)
    by_model = objective.false_negatives.dense(q.double(), d.double(), None)
    assert by_guide is not None and by_guide.any() and not by_guide.all() and (by_guide != by_model).any()
    pieces = trainer.step_context.split(batch, 3)
    assert_step_equals_its_forwards(trainer, [batch], pieces, seed=4, objective=objective.with_guide(guide))
    trainer.metrics.close()


def _on_ranks(tmp: str, path: str, local: int, ga: int, layout: list[str]) -> None:
    """Each rank's step from one seed, against the dense objective over every rank's microbatches encoded in order
    from that seed, taught by the file's vectors of all of them."""
    clip_flavors["debug"] = dataclasses.replace(clip_flavors["debug"], dropout=0.1)  # this rank's process only
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    trainer = make_trainer(
        tmp,
        f"--training.local_batch_size={local}",
        f"--training.global_batch_size={local * ga * world}",
        "--loss.negatives=global",
        "--loss.stream_chunk_size=5",
        "--loss.distill_symmetric=true",
        f"--loss.teacher_embeddings={path}",
        *TAUGHT,
        *layout,
    )
    steps = [trainer.train_set.__getitems__(list(range(j * local * world, (j + 1) * local * world))) for j in range(ga)]
    mine = [{k: v[rank * local : (rank + 1) * local] for k, v in s.items()} for s in steps]
    reference = trainer.spec.build_model(trainer.model_args).double().train()
    reference.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    torch.manual_seed(11)
    out = trainer.train_step(mine)
    parts, order = [], []
    for r in range(world):
        torch.manual_seed(11)
        for s in steps:
            rows = {k: v[r * local : (r + 1) * local] for k, v in s.items()}
            images, texts = trainer.step_context.inputs(rows)
            parts.append(reference(images.double(), texts))
            order.append(rows)
    taught = build_objective(trainer.cfg.loss).with_teacher(file_guide(trainer, Path(path), order))
    loss = taught.dense(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), parts[0][2])
    loss.backward()
    assert_close(grads(trainer.model), grads(reference))
    assert abs(out["loss"] - loss.item()) <= REL * loss.item()
    trainer.metrics.close()


DDP = ["--parallelism.data_parallel_replicate_degree=-1", "--parallelism.data_parallel_shard_degree=1"]


@pytest.mark.parametrize(
    "world, local, ga, layout",
    [(2, 3, 2, []), pytest.param(4, 2, 3, DDP, marks=pytest.mark.slow)],
    ids=["fsdp2", "ddp4"],
)
def test_global_negatives_on_ranks_gather_the_carried_embeddings(
    tmp_path: Path, bundled: tuple[Path, Path], world: int, local: int, ga: int, layout: list[str]
) -> None:
    run_distributed(_on_ranks, world, str(tmp_path / "run"), str(bundled[1]), local, ga, layout)


# --- your own image-text data: a CSV with negative captions and one image that does not decode ---------------------

N = 9
CAPTIONS = [f"a photo of thing {i}" for i in range(N)]
NEGS = [(f"a drawing of thing {i}", f"a photo of thing {(i + 1) % N} upside down") for i in range(N)]
BROKEN = 3
RGB_TEACHER = dataclasses.replace(TEACHER, in_channels=3)


@pytest.fixture
def csv_data(tmp_path: Path) -> list[str]:
    return write_csv_data(tmp_path)


def write_csv_data(tmp_path: Path) -> list[str]:
    """The flags of a run on N 28x28 PNGs (image BROKEN is not one) with two negative captions each."""
    rng = np.random.default_rng(0)
    (tmp_path / "img").mkdir()
    for i in range(N):
        file = tmp_path / "img" / f"{i}.png"
        if i == BROKEN:
            file.write_bytes(b"not a png")
        else:
            Image.fromarray(rng.integers(0, 256, (28, 28, 3), dtype=np.uint8)).save(file)
    with open(tmp_path / "train.csv", "w", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(["filepath", "title", "neg_a", "neg_b"])
        writer.writerows([f"img/{i}.png", CAPTIONS[i], *NEGS[i]] for i in range(N))
    return [
        "--data.dataset=csv",
        f"--data.path={tmp_path / 'train.csv'}",
        "--data.csv_negative_keys=neg_a,neg_b",
        "--data.tokenizer=byte",
        "--data.image_size=28",
        "--data.augment=false",
        "--eval.enable=false",
        "--training.local_batch_size=7",
    ]


def assert_file_teaches_as_the_model(tmp: Path, run: list[str], path: Path, teacher: Path) -> dict:
    """A GradCache step (chunks of 3 of 7) taught from the file and one taught by the running teacher, from the same
    weights and seed: the loss and every gradient agree to float32's precision. The file-taught step's batch."""
    steps = ["--gradcache.enabled=true", "--gradcache.chunk_sizes=3", *TAUGHT]
    outs, batches, init = [], [], None
    for name, source in (("file", f"--loss.teacher_embeddings={path}"), ("model", f"--loss.teacher_model={teacher}")):
        trainer = make_trainer(str(tmp / name), *run, *steps, source)
        init = init or {k: v.clone() for k, v in trainer.model.state_dict().items()}
        trainer.model.load_state_dict(init)  # the teacher model's build drew from the seed before the model's
        batches.append(trainer.train_set.__getitems__(list(range(7))))
        torch.manual_seed(5)
        outs.append((trainer.train_step([batches[-1]])["loss"], grads(trainer.model)))
        trainer.metrics.close()
    (file_loss, file_grads), (model_loss, model_grads) = outs
    assert abs(file_loss - model_loss) <= 1e-5 * abs(model_loss)
    assert_close(file_grads, model_grads, rel=1e-5)
    return batches[0]


def test_on_your_own_data_the_file_teaches_as_the_teacher_model_does(tmp_path: Path, csv_data: list[str]) -> None:
    """Two negative captions per image, served at the evaluation view (augment off), one image that does not decode:
    the file holds each good sample's image and captions, and teaches as the running teacher does."""
    teacher = step_folder(tmp_path / "teacher", RGB_TEACHER, seed=3)[0]
    path = embed(tmp_path, teacher, "--data.context_length=32", *csv_data)
    table = read_file(path)
    png = [hashlib.sha1((tmp_path / "img" / f"{i}.png").read_bytes()).hexdigest() for i in range(N)]
    good = [i for i in range(N) if i != BROKEN]  # the bad sample is skipped, as training skips it
    captions = {("caption", t) for i in good for t in (CAPTIONS[i], *NEGS[i])}
    assert {k for k in table} == {("image", png[i]) for i in good} | captions
    batch = assert_file_teaches_as_the_model(tmp_path, csv_data, path, teacher)
    assert batch[FROZEN_DOCS].shape == (7, 3, TEACHER.embed_dim) and batch[NEGATIVES].shape[:2] == (7, 2)
    want = [png[BROKEN + 1 if i == BROKEN else i] for i in range(7)]  # the bad image's substitute's vector
    assert torch.equal(batch[FROZEN_QUERIES], torch.tensor(np.stack([table["image", k] for k in want])).float())


def test_a_file_written_from_one_copy_of_the_data_serves_another(tmp_path: Path, csv_data: list[str]) -> None:
    """Embedded from the CSV, read with its webdataset shards (`make_shards`, the bad image left out, 4 per shard):
    each image's vector is found by its bytes, and the step equals the running teacher's on the shards."""
    from titan_contrastive.datasets import make_shards

    teacher = step_folder(tmp_path / "teacher", RGB_TEACHER, seed=3)[0]
    path = embed(tmp_path, teacher, "--data.context_length=32", *csv_data)
    shards = tmp_path / "shards"
    args = [str(tmp_path / "train.csv"), "--out", str(shards), "--samples-per-shard=4", "--skip-bad"]
    assert make_shards.main(args) == 0
    wds = [f for f in csv_data if not f.startswith(("--data.dataset", "--data.path", "--data.csv"))]
    wds += ["--data.dataset=webdataset", f"--data.path={shards / 'shards.json'}"]
    batch = assert_file_teaches_as_the_model(tmp_path, wds, path, teacher)
    assert batch[FROZEN_DOCS].shape == (7, TEACHER.embed_dim)  # no negatives in the shards


# --- what cannot work ------------------------------------------------------------------------------------------------


def one_line(err: pytest.ExceptionInfo, *needles: str) -> None:
    message = str(err.value)
    assert "\n" not in message and all(n in message for n in needles), message


def test_a_file_that_misses_the_data_is_one_line_before_any_compute(
    tmp_path: Path, bundled: tuple[Path, Path], csv_data: list[str]
) -> None:
    rows = pq.read_table(bundled[1]).to_pylist()
    cases = {
        "no-caption": ([r for r in rows if r["text"] != "a photo of a coat."], ["no caption embedding", "coat"]),
        "no-image": ([r for r in rows if r["side"] != "image" or r is not rows[0]], ["no image embedding"]),
        "text-pairs": ([{**r, "side": "query" if r["side"] == "image" else "document"} for r in rows], ["no image"]),
    }
    for name, (kept, needles) in cases.items():
        file = tmp_path / f"{name}.parquet"
        pq.write_table(pq.read_table(bundled[1]).from_pylist(kept), file)
        with pytest.raises(DataError) as err:
            make_trainer(str(tmp_path / name), f"--loss.teacher_embeddings={file}", *TAUGHT)
        one_line(err, f"loss.teacher_embeddings={file}", *needles)
    with pytest.raises(DataError) as err:  # the bundled set's embeddings, for the CSV: its first image is missing
        make_trainer(str(tmp_path / "own"), *csv_data, f"--loss.teacher_embeddings={bundled[1]}", *TAUGHT)
    one_line(err, "no image embedding", "img/0.png", "embed_images")


def test_a_sample_missed_past_the_probe_stops_its_batch(tmp_path: Path, csv_data: list[str]) -> None:
    teacher = step_folder(tmp_path / "teacher", RGB_TEACHER, seed=3)[0]
    path = embed(tmp_path, teacher, "--data.context_length=32", *csv_data)
    rows = [r for r in pq.read_table(path).to_pylist() if r["text"] != CAPTIONS[8]]
    pq.write_table(pq.read_table(path).from_pylist(rows), tmp_path / "short.parquet")
    from titan_contrastive.datasets.frozen import EmbeddingTable

    trainer = make_trainer(str(tmp_path / "run"), *csv_data, *TAUGHT, f"--loss.teacher_model={teacher}")
    dataset = trainer.train_set
    dataset.carry_frozen(EmbeddingTable.read(str(tmp_path / "short.parquet"), "loss.teacher_embeddings"), probe=4)
    assert dataset.__getitems__([0, 1])[FROZEN_DOCS].shape == (2, 3, TEACHER.embed_dim)
    with pytest.raises(DataError) as err:
        dataset.__getitems__([7, 8])
    one_line(err, "no caption embedding", CAPTIONS[8], "img/8.png")
    trainer.metrics.close()


def test_embed_images_refuses_what_cannot_work_in_one_line(
    tmp_path: Path, bundled: tuple[Path, Path], capsys: pytest.CaptureFixture
) -> None:
    cases = {
        "no-teacher": (["--out", str(tmp_path / "a.parquet")], "loss.teacher_model is empty"),
        "text-pairs": (
            ["--out", str(tmp_path / "a.parquet"), "--data.dataset=wordnet", f"--loss.teacher_model={bundled[0]}"],
            "titan_contrastive.embed PAIRS",
        ),
        "exists": (["--out", str(bundled[1]), f"--loss.teacher_model={bundled[0]}"], "exists"),
        "format": (["--out", str(tmp_path / "a.csv"), f"--loss.teacher_model={bundled[0]}"], ".parquet/.jsonl"),
    }
    for name, (argv, needle) in cases.items():
        assert embed_images.main(argv) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, (name, err)
    assert not (tmp_path / "a.parquet").exists()
