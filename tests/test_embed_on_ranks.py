"""Embedding ahead on several processes: `torchrun ... -m titan_contrastive.embed_images` has rank r embed chunks r,
r + W, ... of the samples (decoded by its own workers) and the captions they serve, and rank 0 spools every rank's rows
as they come (`row_spool`) and writes the rows one process writes, in its order, leaving nothing else behind: checked
against the teacher's own forward (`load_clip`) at every chunk's first and last sample and on every caption, on 2 and 4
gloo processes with chunks that divide nothing, a bad image's substitute included; `python -m titan_contrastive.embed
--device a,b` runs sentence-transformers' multi-process pool and writes what the run's own model gives."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from tests.dist_utils import TWO_AND_FOUR, run_distributed
from tests.test_export import step_folder
from tests.test_image_teacher_ahead import (
    RGB_TEACHER,
    N,
    embed,
    embed_bundled,
    read_file,
    sha1,
    write_csv_data,
)
from titan_contrastive import embed_images
from titan_contrastive.datasets import build_dataset
from titan_contrastive.datasets.fashion_mnist import BUNDLE_DIR, load_split
from titan_contrastive.models.clip import load_clip


@pytest.fixture(scope="module")
def bundled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a teacher's folder, the file one process writes of the bundled Fashion-MNIST training split)."""
    return embed_bundled(tmp_path_factory.mktemp("one"))


@pytest.fixture
def csv_data(tmp_path: Path) -> list[str]:
    return write_csv_data(tmp_path)


def _embed(out: str, teacher: str, flags: list[str]) -> None:
    code = embed_images.main(["--out", out, f"--loss.teacher_model={teacher}", *flags])
    assert code == 0
    assert Path(out).is_file()  # rank 0 wrote it before any rank returned
    assert not list(Path(out).parent.glob(".*"))  # nor its spool or a temporary file left


def assert_same_rows(got: Path, want: Path) -> None:
    """The two files hold the same rows in the same order, the vectors equal to float32's precision, and the same
    metadata."""
    a, b = pq.read_table(got), pq.read_table(want)
    assert a.column("side").to_pylist() == b.column("side").to_pylist()
    assert a.column("text").to_pylist() == b.column("text").to_pylist()
    np.testing.assert_allclose(
        np.stack(a.column("embedding").to_numpy(zero_copy_only=False)),
        np.stack(b.column("embedding").to_numpy(zero_copy_only=False)),
        rtol=1e-5,
        atol=1e-6,
    )
    assert a.schema.metadata == b.schema.metadata


@pytest.mark.parametrize("world", TWO_AND_FOUR)
def test_ranks_write_the_teacher_s_rows_of_one_process(tmp_path: Path, bundled: tuple[Path, Path], world: int) -> None:
    teacher, one = bundled
    out = tmp_path / "ranks.parquet"
    flags = ["--batch-size=700", "--data.context_length=32"]
    run_distributed(_embed, world, str(out), str(teacher), flags)
    assert_same_rows(out, one)
    table = read_file(out)
    data = build_dataset("fashion_mnist", "train", augment=False)  # unflipped
    images = load_split(BUNDLE_DIR, "train")[0]
    edges = [i for start in range(0, len(data), 700) for i in (start, min(start + 700, len(data)) - 1)]
    captions = data.caption_texts()
    model = load_clip(teacher).double()
    with torch.no_grad():
        want_images = model(data.__getitems__(edges)["image"].double(), data.encode_text(captions[:1]))[0]
        want_captions = model(data.__getitems__([0])["image"].double(), data.encode_text(captions))[1]
    got_images = torch.tensor(np.stack([table["image", sha1(images[i])] for i in edges]))
    got_captions = torch.tensor(np.stack([table["caption", c] for c in captions]))
    torch.testing.assert_close(got_images, want_images, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_captions, want_captions, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("views", [0, 2])
def test_on_your_own_data_ranks_and_their_workers_write_the_file_of_one_process(
    tmp_path: Path, csv_data: list[str], views: int
) -> None:
    """Two ranks of two decoding workers each, chunks of 2 of each rank's 5 or 4 samples, one image that does not
    decode (its slot takes the next good sample, as in one process), with and without train views: the file of one
    process."""
    teacher = step_folder(tmp_path / "teacher", RGB_TEACHER, seed=3)[0]
    data = [*csv_data, f"--data.augment={bool(views)}", f"--views={views}"]
    one = embed(tmp_path, teacher, "--data.context_length=32", *data)
    out = tmp_path / "ranks.parquet"
    flags = ["--batch-size=2", "--data.context_length=32", "--data.num_workers=2", *data]
    run_distributed(_embed, 2, str(out), str(teacher), flags)
    assert_same_rows(out, one)
    assert len(read_file(out)) == (1 + views) * (N - 1) + 3 * (N - 1)  # each good image's views; its 3 captions


def test_a_device_under_torchrun_is_one_line(
    tmp_path: Path, bundled: tuple[Path, Path], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "a.parquet"
    assert embed_images.main(["--out", str(out), "--device=cuda:1", f"--loss.teacher_model={bundled[0]}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --device=cuda:1: under torchrun") and err.count("\n") == 1
    assert not out.exists()


@pytest.mark.slow  # torchrun starts two interpreters
def test_torchrun_launches_it(tmp_path: Path, bundled: tuple[Path, Path]) -> None:
    teacher, one = bundled
    out = tmp_path / "ranks.parquet"
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    argv = ["-m", "titan_contrastive.embed_images", f"--out={out}", f"--loss.teacher_model={teacher}"]
    done = subprocess.run(
        [*run, *argv, "--batch-size=700", "--data.context_length=32"],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("wrote ") == 1  # rank 0's line
    assert_same_rows(out, one)


@pytest.mark.slow  # sentence-transformers spawns two interpreters
def test_embed_on_two_devices_writes_what_the_run_s_model_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--device cpu,cpu`: two processes of sentence-transformers' pool embed a run of two towers; each side's rows are
    its tower's embeddings of the texts, as the run's own BiEncoder computes them, in the order of one process."""
    from sentence_transformers import SentenceTransformer

    from tests.test_mine import bi_encoder_step, run_embedder, tiny_rows, write_csv
    from titan_contrastive.embed import main

    pools, start = [], SentenceTransformer.start_multi_process_pool

    def counted(model: SentenceTransformer, devices: list[str], *args, **kwargs) -> dict:  # the real pool, counted
        pools.append(list(devices))
        return start(model, devices, *args, **kwargs)

    monkeypatch.setattr(SentenceTransformer, "start_multi_process_pool", counted)
    step = bi_encoder_step(tmp_path, shared=False)
    rows = tiny_rows()
    src = write_csv(tmp_path / "pairs.csv", rows, [f"t{i}" for i in range(len(rows))])
    out, one = tmp_path / "two.parquet", tmp_path / "one.parquet"
    assert main([str(src), "--model", str(step), "--out", str(out), "--device=cpu,cpu", "--batch-size=7"]) == 0
    assert pools == [["cpu", "cpu"]]  # one pool embeds both sides
    assert main([str(src), "--model", str(step), "--out", str(one), "--device=cpu", "--batch-size=7"]) == 0
    assert len(pools) == 1
    assert_same_rows(out, one)
    embed = run_embedder(step)[0]
    table = pq.read_table(out).to_pylist()
    for side in ("query", "document"):
        texts = [row["text"] for row in table if row["side"] == side]
        got = torch.tensor([row["embedding"] for row in table if row["side"] == side])
        assert texts and (got - embed(texts, "query" if side == "query" else "doc")).abs().max() <= 1e-5, side
