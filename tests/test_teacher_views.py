"""Several views per image written ahead (`embed_images --views K`), MobileCLIP's reinforced data: the file holds the
teacher's embedding of K train views of each image (a crop, or a flip for the bundled sets, drawn from the image's key
and the view), a run reading it serves each training sample one of its image's views, drawn per (seed, epoch, index),
and that view's embedding, so the teacher's vector of each served image is its embedding of exactly the pixels served
(checked against the teacher's own forward, `load_clip`, on the batch's images); a step taught from the file equals one
taught by the running teacher on the same batch; a file written from one copy of the data serves another in another
order; what cannot work is one line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_export import step_folder
from tests.test_image_teacher_ahead import (
    RGB_TEACHER,
    TAUGHT,
    TEACHER,
    N,
    embed,
    one_line,
    read_file,
    sha1,
    write_csv_data,
)
from tests.test_trainer import assert_close, grads, make_trainer
from titan_contrastive import embed_images
from titan_contrastive.batching import FROZEN_QUERIES
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.fashion_mnist import BUNDLE_DIR, load_split
from titan_contrastive.datasets.frozen import EmbeddingTable
from titan_contrastive.models.clip import load_clip

AUGMENTED = ["--data.augment=true"]


@pytest.fixture(scope="module")
def bundled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a teacher's folder, its embeddings of the bundled Fashion-MNIST training split with 2 views: both flips)."""
    tmp = tmp_path_factory.mktemp("views")
    teacher = step_folder(tmp / "teacher", TEACHER, seed=3)[0]
    return teacher, embed(tmp, teacher, "--data.context_length=32", "--views=2")


def teacher_images(teacher: Path, images: torch.Tensor) -> torch.Tensor:
    """The teacher's own embeddings of `images` (float64)."""
    with torch.no_grad():
        return load_clip(teacher).double().encode_image(images.double())


def test_the_bundled_views_are_both_flips_and_each_sample_is_served_one_with_its_vector(
    tmp_path: Path, bundled: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    teacher, path = bundled
    table = read_file(path)
    keys = [sha1(x) for x in load_split(BUNDLE_DIR, "train")[0]]
    assert {k for side, k in table if side == "image"} == {f"{k}{v}" for k in keys for v in ("", "#0", "#1")}
    np.testing.assert_allclose(table["image", keys[5] + "#0"], table["image", keys[5]], rtol=1e-6)  # view 0: unflipped
    assert np.abs(table["image", keys[5] + "#1"] - table["image", keys[5]]).max() > 1e-3  # view 1: flipped
    caplog.set_level(logging.INFO, logger="titan_contrastive")
    trainer = make_trainer(str(tmp_path / "run"), f"--loss.teacher_embeddings={path}", *TAUGHT)
    assert "each training sample is served one of its image's 2 stored views" in caplog.text
    data, flips = trainer.train_set, []
    for epoch in (0, 1):
        data.set_epoch(epoch)
        batch = data.__getitems__(list(range(40)))
        torch.testing.assert_close(
            batch[FROZEN_QUERIES].double(), teacher_images(teacher, batch["image"]), rtol=1e-5, atol=1e-6
        )
        flips.append([not torch.equal(batch["image"][i], data.view([i], 0)[0]["image"][0]) for i in range(40)])
    assert 5 < sum(flips[0]) < 35 and flips[0] != flips[1]  # drawn per sample and epoch
    trainer.metrics.close()


def csv_teacher(tmp: Path, *flags: str) -> tuple[list[str], Path, Path]:
    """(the CSV run's flags, augmented; its teacher; the teacher's file of `flags` views)."""
    run = [*write_csv_data(tmp), *AUGMENTED]
    teacher = step_folder(tmp / "teacher", RGB_TEACHER, seed=3)[0]
    return run, teacher, embed(tmp, teacher, "--data.context_length=32", *run, *flags)


def test_on_your_own_data_each_sample_is_served_a_stored_crop_whose_vector_the_file_holds(tmp_path: Path) -> None:
    """Random-resized crops of 28x28 PNGs, 3 views each, one image that does not decode: each served image is one of
    its image's 3 crops (mostly not the evaluation view), the file's vector of it the teacher's embedding of the served
    pixels; a GradCache step taught from the file equals one taught by the running teacher on the same batch."""
    run, teacher, path = csv_teacher(tmp_path, "--views=3")
    assert len(read_file(path)) == 4 * (N - 1) + 3 * (N - 1)  # each good image at 1 + 3 views; 3 captions each
    steps = ["--gradcache.enabled=true", "--gradcache.chunk_sizes=3", *TAUGHT]
    file = make_trainer(str(tmp_path / "file"), *run, *steps, f"--loss.teacher_embeddings={path}")
    file.train_set.set_epoch(1)  # a view's crop is the image's, whichever epoch serves it
    batch = file.train_set.__getitems__(list(range(7)))
    served = teacher_images(teacher, batch["image"])
    torch.testing.assert_close(batch[FROZEN_QUERIES].double(), served, rtol=1e-5, atol=1e-6)
    fixed = teacher_images(teacher, file.train_set.fixed_view(range(7))[0]["image"])
    assert ((served - fixed).abs().amax(1) > 1e-3).sum() >= 5  # train crops, not the evaluation view (one may be)
    model = make_trainer(str(tmp_path / "model"), *run, *steps, f"--loss.teacher_model={teacher}")
    model.model.load_state_dict(file.model.state_dict())
    outs = []
    for trainer, fed in ((file, batch), (model, {k: v for k, v in batch.items() if not k.startswith("frozen")})):
        torch.manual_seed(5)
        outs.append((trainer.train_step([fed])["loss"], grads(trainer.model)))
        trainer.metrics.close()
    assert abs(outs[0][0] - outs[1][0]) <= 1e-5 * abs(outs[1][0])
    assert_close(outs[0][1], outs[1][1], rel=1e-5)


def test_a_file_of_views_serves_another_copy_of_the_data_in_another_order(tmp_path: Path) -> None:
    """The CSV's rows reversed: each image is served one of the crops the file holds of it, found by its key."""
    run, teacher, path = csv_teacher(tmp_path, "--views=2")
    lines = (tmp_path / "train.csv").read_text().splitlines()
    (tmp_path / "reversed.csv").write_text("\n".join([lines[0], *reversed(lines[1:])]) + "\n")
    other = [f for f in run if not f.startswith("--data.path")] + [f"--data.path={tmp_path / 'reversed.csv'}"]
    trainer = make_trainer(str(tmp_path / "run"), *other, *TAUGHT, f"--loss.teacher_embeddings={path}")
    batch = trainer.train_set.__getitems__(list(range(7)))
    served = teacher_images(teacher, batch["image"])
    torch.testing.assert_close(batch[FROZEN_QUERIES].double(), served, rtol=1e-5, atol=1e-6)
    trainer.metrics.close()


def test_views_that_cannot_work_are_one_line(
    tmp_path: Path, bundled: tuple[Path, Path], capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    teacher = bundled[0]
    cases = {
        "negative": (["--views=-1"], "--views=-1"),
        "bundled-unflipped": (["--views=2", "--data.augment=false"], "its views are flips"),
        "csv-eval-view": (["--views=2", *write_csv_data(tmp_path)], "several views per image are train crops"),
    }
    out = tmp_path / "a.parquet"
    for name, (flags, needle) in cases.items():
        assert embed_images.main(["--out", str(out), f"--loss.teacher_model={teacher}", *flags]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, (name, err)
        assert not out.exists()
    bad = tmp_path / "bad.jsonl"
    rows = [{"side": "image", "text": "ab#x", "embedding": [1]}, {"side": "caption", "text": "c", "embedding": [1]}]
    bad.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(DataError) as err:
        EmbeddingTable.read(str(bad), "loss.teacher_embeddings")
    one_line(err, "row 0's image key is 'ab#x'", "--views K")
    caplog.set_level(logging.INFO, logger="titan_contrastive")
    plain = [f"--loss.teacher_embeddings={bundled[1]}", "--data.augment=false", *TAUGHT]
    trainer = make_trainer(str(tmp_path / "plain"), *plain)
    assert "holds 2 views of each image, and data.augment=false serves the evaluation view" in caplog.text
    trainer.metrics.close()
