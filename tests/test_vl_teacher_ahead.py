"""A Qwen-VL teacher's embeddings of vl_pairs rows written ahead (`python -m titan_contrastive.embed_images` on vl_pairs
data, then `[loss] teacher_embeddings`): m2i rows (an image and a text query, an image document, two image hard
negatives per row) of two `::`-joined files, the second with a query template of its own, one row with a missing
document image and one with an empty query text. The file holds each query and each document once (every hard
negative of every row, the second file's documents, the first's under other paths, found by their bytes), keyed by
its template filled with the image's SHA-1 and the text, as computed here from the files; the batches carry the
teacher's own embeddings of what they serve, in every epoch's draw of the negatives; a step taught from the file
equals one taught by the running teacher to float32's precision, and so does one in t2t, i2t (text negatives) and
t2i; a plain step, GradCache with chunks that divide nothing and streamed global negatives (dropout on, float64)
equal the dense objective taught by the file's vectors looked up here, on 1, 2 and 4 gloo processes; the file as a
guide decides the margin masks; 2 ranks with 2 decoding workers each write the rows one process writes; image-text
data through the processor (a CSV in i2t and t2i, a bad image) is written and taught the same way; what cannot work
is one line."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import run_distributed
from tests.hf_folders import vl_folder
from tests.needs import require
from tests.test_embed_on_ranks import assert_same_rows
from tests.test_hard_negatives import assert_step_equals_its_forwards
from tests.test_image_teacher_ahead import one_line, read_file
from tests.test_qwen_vl import _embeddings, _pictures_csv
from tests.test_qwen_vl_pairs import _vl_pairs
from tests.test_qwen_vl_teacher import TAUGHT, teacher_folder
from tests.test_trainer import REL, assert_close, full, grads, make_trainer
from titan_contrastive import embed_images
from titan_contrastive.batching import FROZEN_DOCS, FROZEN_QUERIES
from titan_contrastive.datasets.base import DataError
from titan_contrastive.losses import build_objective, split_documents
from titan_contrastive.losses.base import columns
from titan_contrastive.losses.guide import Guide

require("hf")

PROMPT = "{image} Find the picture for: {text}"
"""The second file's query template (the first's: the model's)."""
BAD = {2: 3, 4: 5}
"""The first file's bad rows (a missing document image, an empty query text) -> the row each one's slot serves."""


class Ahead(NamedTuple):
    root: Path
    flags: list[str]
    """The run's model and data (both files)."""
    one: list[str]
    """The run's model and the first file alone."""
    teacher: Path
    file: Path


def run_flags(root: Path, path: str, *data: str) -> list[str]:
    return [
        "--model.name=qwen_vl",
        "--model.flavor=default",
        f"--model.path={root / 'tiny-qwen2_vl'}",
        "--data.dataset=vl_pairs",
        f"--data.path={path}",
        "--data.retrieval_mode=m2i",
        "--data.context_length=8",
        "--eval.enable=false",
        *data,
    ]


def embed(out: Path, ahead_flags: list[str], teacher: Path, *more: str) -> Path:
    code = embed_images.main(
        ["--out", str(out), "--batch-size=3", "--training.dtype=float64", f"--loss.teacher_model={teacher}"]
        + [*ahead_flags, *more]
    )
    assert code == 0
    return out


def served(trainer, indices) -> dict:  # noqa: ANN001
    """The tensors of the batch `trainer`'s training set serves for `indices`."""
    return {k: v for k, v in trainer.train_set.__getitems__(list(indices)).items() if isinstance(v, torch.Tensor)}


def taught_runs(tmp: Path, flags: list[str], file: Path, teacher: Path, *steps: str) -> list:
    """Two trainers from the same weights, taught from `file` and by the running `teacher`."""
    runs, init = [], None
    for name, source in (("file", f"--loss.teacher_embeddings={file}"), ("model", f"--loss.teacher_model={teacher}")):
        trainer = make_trainer(str(tmp / name), *flags, *steps, source)
        init = init or {k: v.clone() for k, v in trainer.model.state_dict().items()}
        trainer.model.load_state_dict(init)  # the teacher model's build drew from the seed before the model's
        runs.append(trainer)
    return runs


def assert_same_step(runs: list, local: int, rows: Sequence[int] = ()) -> None:
    """Each run's step on its first `local` samples (or on `rows`) from one seed: the loss and every trainable
    parameter's gradient agree to float32's precision."""
    outs = []
    for trainer in runs:
        torch.manual_seed(5)
        loss = trainer.train_step([trainer.train_set.__getitems__(list(rows or range(local)))])["loss"]
        outs.append((loss, {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}))
        trainer.metrics.close()
    (file_loss, file_grads), (model_loss, model_grads) = outs
    assert abs(file_loss - model_loss) <= 1e-5 * abs(model_loss)
    assert_close(file_grads, model_grads, rel=1e-5)


def assert_carried_and_taught(
    tmp: Path, flags: list[str], file: Path, teacher: Path, negatives: int, rows: Sequence[int] = range(7)
) -> None:
    """Runs of `flags` taught from `file` and by the running `teacher` (GradCache 3 of 7): the batch of 7 `rows`
    carries the teacher's embeddings of what it serves (its `negatives` per sample too), and the steps agree
    (`assert_same_step`)."""
    steps = ["--training.local_batch_size=7", "--gradcache.enabled=true", "--gradcache.chunk_sizes=3", *TAUGHT]
    runs = taught_runs(tmp, flags, file, teacher, *steps)
    batch = runs[0].train_set.__getitems__(list(rows))
    tensors = served(runs[1], rows)
    with torch.no_grad():
        q, d = _embeddings(runs[1].step_context.guide, tensors)
    docs = torch.cat([d[:7, None], d[7:].view(7, negatives, -1)], 1) if negatives else d
    assert batch[FROZEN_DOCS].shape == docs.shape
    torch.testing.assert_close(batch[FROZEN_QUERIES].double(), q, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(batch[FROZEN_DOCS].double(), docs, rtol=1e-6, atol=1e-7)
    assert_same_step(runs, 7, rows)


@pytest.fixture(scope="module")
def ahead(tmp_path_factory: pytest.TempPathFactory) -> Ahead:
    root = tmp_path_factory.mktemp("vl-ahead")
    vl_folder(root)
    a = _vl_pairs(root / "a", bad=True, negatives="image")
    b = _vl_pairs(root / "b", negatives="image", count=5)  # the first five rows' images again, under other paths
    flags = run_flags(root, f"{a}::{b}", "--data.query_prompts", "", PROMPT)
    teacher = teacher_folder(root)
    return Ahead(root, flags, run_flags(root, str(a)), teacher, embed(root / "teacher.parquet", flags, teacher))


def sha1(file: Path) -> str:
    return hashlib.sha1(file.read_bytes()).hexdigest()


def filled(template: str, text: str, image: Path) -> str:
    """An item's key, from the definition: the template with the image's SHA-1 and the text."""
    return template.replace("{image}", f"<image {sha1(image)}>").replace("{text}", text)


def row_keys(root: Path, row: int, query: str = "{image} {text}") -> tuple[str, str, list[str]]:
    """(query key, document key, the hard negatives' keys) of `row` of the file in `root` (`_vl_pairs`' names)."""
    img = root / "img"
    doc = [filled("{image}", "", img / f"{name}.png") for name in (f"d{row}", f"n{row}0", f"n{row}1")]
    return filled(query, f"a photo of a cat {row}", img / f"q{row}.png"), doc[0], doc[1:]


def test_the_file_holds_each_query_and_document_once_keyed_by_its_filled_template(ahead: Ahead) -> None:
    table = read_file(ahead.file)
    a, b = ahead.root / "a", ahead.root / "b"
    queries = {row_keys(a, i)[0] for i in range(9) if i != 4} | {row_keys(b, i, PROMPT)[0] for i in range(5)}
    documents = {k for i in range(9) for k in [*row_keys(a, i)[1:2] * (i != 2), *row_keys(a, i)[2]]}
    documents |= {row_keys(b, 2)[1]}  # the first file's row 2 names a missing image; the second's has it
    assert set(table) == {("query", k) for k in queries} | {("document", k) for k in documents}
    assert len(queries) == 13 and len(documents) == 27 and pq.read_schema(ahead.file).metadata is None


def test_the_batches_carry_the_teacher_s_embeddings_and_teach_as_it_does(tmp_path: Path, ahead: Ahead) -> None:
    """One of each row's two negatives per epoch (drawn by the seed): in epochs 0 and 1 a batch of the file-taught run
    carries the running teacher's embeddings of the same batch, to float32's precision, and a GradCache step (3 of 7)
    taught from the file equals one taught by the teacher: the loss and every gradient."""
    steps = ["--training.local_batch_size=7", "--gradcache.enabled=true", "--gradcache.chunk_sizes=3", *TAUGHT]
    runs = taught_runs(tmp_path, [*ahead.flags, "--data.negatives_per_row=1"], ahead.file, ahead.teacher, *steps)
    file_run, model_run = runs
    held = model_run.step_context.guide
    for epoch in (1, 0):
        for trainer in runs:
            trainer.train_set.set_epoch(epoch)
        at = list(range(14))  # both files' rows: the bad ones' substitutes, the second's own template
        batch = file_run.train_set.__getitems__(at)
        tensors = served(model_run, at)
        with torch.no_grad():
            q, d = _embeddings(held, tensors)
        assert batch[FROZEN_DOCS].shape == (14, 2, 128)
        torch.testing.assert_close(batch[FROZEN_QUERIES].double(), q, rtol=1e-6, atol=1e-7)
        docs = torch.stack([d[:14], d[14:]], 1)  # the positives, then each sample's negative
        torch.testing.assert_close(batch[FROZEN_DOCS].double(), docs, rtol=1e-6, atol=1e-7)
    assert_same_step(runs, 7)


def file_guide(ahead: Ahead, batches: list[dict]) -> Guide:
    """The file's unit vectors of the batches' samples of the first file (its bad rows' substitutes'), looked up here
    by keys computed from the rows."""
    table = read_file(ahead.file)
    queries, positives, negatives = [], [], []
    for batch in batches:
        for i in batch["index"].tolist():
            query, doc, negs = row_keys(ahead.root / "a", BAD.get(i, i))
            queries.append(table["query", query])
            positives.append(table["document", doc])
            negatives += [table["document", n] for n in negs]
    q, p, n = (F.normalize(torch.tensor(np.stack(v)), dim=-1) for v in (queries, positives, negatives))
    return Guide(q, columns(p, n))


KINDS = {
    "gradcache": (7, 1, ["--gradcache.enabled=true", "--gradcache.chunk_sizes=3"]),
    "plain-kl-beside": (7, 1, ["--loss.distill_weight=0.5"]),
    "global": (3, 2, ["--loss.negatives=global", "--loss.stream_chunk_size=5"]),
}


@pytest.mark.parametrize("kind", KINDS)
def test_each_step_kind_taught_from_the_file_equals_the_dense_objective(
    tmp_path: Path, ahead: Ahead, kind: str
) -> None:
    local, ga, flags = KINDS[kind]
    trainer = make_trainer(
        str(tmp_path / "run"),
        *ahead.one,
        f"--training.local_batch_size={local}",
        f"--training.global_batch_size={local * ga}",
        f"--loss.teacher_embeddings={ahead.file}",
        *TAUGHT,
        *flags,
    )
    assert "the frozen teacher's cosines (embedded ahead, from the data)" in trainer.gradient_step.describe()

    microbatches = [served(trainer, range(j * local, (j + 1) * local)) for j in range(ga)]
    pieces = trainer.step_context.split(microbatches[0], 3) if kind == "gradcache" else microbatches
    taught = build_objective(trainer.cfg.loss).with_teacher(file_guide(ahead, microbatches))
    assert_step_equals_its_forwards(trainer, microbatches, pieces, seed=4, objective=taught)
    trainer.metrics.close()


def test_a_guide_written_ahead_decides_the_masks(tmp_path: Path, ahead: Ahead) -> None:
    """GISTEmbed on vl_pairs from the file (`guide_embeddings`): GradCache 3 over 7 against the dense objective with
    the margin mask of the file's cosines, looked up here, which is not the model's own mask."""
    trainer = make_trainer(
        str(tmp_path / "run"),
        *ahead.one,
        "--training.local_batch_size=7",
        "--gradcache.enabled=true",
        "--gradcache.chunk_sizes=3",
        f"--loss.guide_embeddings={ahead.file}",
        "--loss.mask_margin=-0.1",
    )
    batch = served(trainer, range(7))
    guide = file_guide(ahead, [batch])
    objective = build_objective(trainer.cfg.loss)
    with torch.no_grad():
        q, d = trainer.step_context.encode(batch)[:2]
    d = columns(*split_documents(d))
    by_guide = objective.false_negatives.guided(guide).dense(q.double(), d.double(), None)
    by_model = objective.false_negatives.dense(q.double(), d.double(), None)
    assert by_guide is not None and by_guide.any() and not by_guide.all() and (by_guide != by_model).any()
    pieces = trainer.step_context.split(batch, 3)
    assert_step_equals_its_forwards(trainer, [batch], pieces, seed=4, objective=objective.with_guide(guide))
    trainer.metrics.close()


def _on_ranks(tmp: str, ahead: Ahead, local: int, ga: int, layout: list[str]) -> None:
    """Each rank's global-negatives step from one seed, against the dense objective over every rank's microbatches
    encoded in order from that seed, taught by the file's vectors of all of them."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    trainer = make_trainer(
        tmp,
        *ahead.one,
        f"--training.local_batch_size={local}",
        f"--training.global_batch_size={local * ga * world}",
        "--loss.negatives=global",
        "--loss.stream_chunk_size=5",
        f"--loss.teacher_embeddings={ahead.file}",
        *TAUGHT,
        *layout,
    )

    steps = [served(trainer, range(j * local * world, (j + 1) * local * world)) for j in range(ga)]
    mine = [trainer.step_context.split(s, local)[rank] for s in steps]
    reference = trainer.spec.build_model(trainer.model_args).double().train()
    reference.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    torch.manual_seed(11)
    out = trainer.train_step(mine)
    queries, docs, order = [], [], []
    for r in range(world):
        torch.manual_seed(11)
        for s in steps:
            rows = trainer.step_context.split(s, local)[r]
            q, d, scale = reference(*trainer.step_context.inputs(rows))
            queries.append(q)
            docs.append(d.view(local, 3, -1))
            order.append(rows)
    d = torch.cat(docs)
    taught = build_objective(trainer.cfg.loss).with_teacher(file_guide(ahead, order))
    loss = taught.dense(torch.cat(queries), columns(d[:, 0], d[:, 1:].flatten(0, 1)), scale)
    loss.backward()
    assert_close(grads(trainer.model), grads(reference))
    assert abs(out["loss"] - loss.item()) <= REL * loss.item()
    trainer.metrics.close()


DDP = ["--parallelism.data_parallel_replicate_degree=-1", "--parallelism.data_parallel_shard_degree=1"]
RANKS = [pytest.param(2, 2, 2, [], id="fsdp2"), pytest.param(4, 1, 2, DDP, id="ddp4", marks=pytest.mark.slow)]


@pytest.mark.parametrize("world, local, ga, layout", RANKS)
def test_global_negatives_on_ranks_gather_the_carried_embeddings(
    tmp_path: Path, ahead: Ahead, world: int, local: int, ga: int, layout: list[str]
) -> None:
    run_distributed(_on_ranks, world, str(tmp_path / "run"), ahead, local, ga, layout)


def _embed_flags(out: str, flags: list[str], teacher: Path) -> None:
    embed(Path(out), flags, teacher, "--data.num_workers=2", "--batch-size=2")
    assert Path(out).is_file()  # rank 0 wrote it before any rank returned


def test_ranks_and_their_workers_write_the_rows_of_one_process(tmp_path: Path, ahead: Ahead) -> None:
    out = tmp_path / "ranks.parquet"
    run_distributed(_embed_flags, 2, str(out), ahead.flags, ahead.teacher)
    assert_same_rows(out, ahead.file)


def test_what_cannot_work_is_one_line(tmp_path: Path, ahead: Ahead, capsys: pytest.CaptureFixture) -> None:
    taught = [f"--loss.teacher_embeddings={ahead.file}", *TAUGHT]
    other = "{image} Retrieve the picture for: {text}"  # a template the file was not written with
    with pytest.raises(DataError) as err:
        make_trainer(str(tmp_path / "template"), *ahead.one, "--model.query_prompt", other, *taught)
    one_line(err, f"loss.teacher_embeddings={ahead.file}", "no query embedding", "Retrieve the picture", "row 0")
    images = tmp_path / "images.parquet"  # an image-text file
    rows = [
        {**r, "side": "image" if r["side"] == "query" else "caption"} for r in pq.read_table(ahead.file).to_pylist()
    ]
    pq.write_table(pq.read_table(ahead.file).from_pylist(rows), images)
    with pytest.raises(DataError) as err:
        make_trainer(str(tmp_path / "images"), *ahead.one, f"--loss.teacher_embeddings={images}", *TAUGHT)
    one_line(err, "no query and document rows (its sides: caption, image)", "embed_images")
    with pytest.raises(DataError) as err:  # the bundled sets through the processor: a size drawn per epoch
        make_trainer(str(tmp_path / "emoji"), *ahead.one[:3], "--data.dataset=emoji", "--data.image_sizes=28", *taught)
    one_line(err, f"loss.teacher_embeddings={ahead.file}: the bundled sets served through a model's processor", "csv")
    argv = ["--out", str(tmp_path / "e.parquet"), f"--loss.teacher_model={ahead.teacher}", *ahead.one[:3]]
    capsys.readouterr()
    assert embed_images.main([*argv, "--data.dataset=emoji", "--data.image_sizes=28"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the bundled sets served through a model's processor") and err.count("\n") == 1
    argv = ["--out", str(tmp_path / "v.parquet"), "--views=2", f"--loss.teacher_model={ahead.teacher}", *ahead.one]
    assert embed_images.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --views=2: images served through a model's processor are read as they are")
    assert err.count("\n") == 1
    assert not (tmp_path / "v.parquet").exists()


@pytest.mark.parametrize("mode, negatives", [("t2t", "text"), ("i2t", "text"), ("t2i", "image"), ("t2m", "multi")])
def test_in_each_mode_the_file_teaches_as_the_running_teacher(
    tmp_path: Path, ahead: Ahead, mode: str, negatives: str
) -> None:
    """Text queries and documents (t2t), text documents and negatives of image queries (i2t), image documents of text
    queries (t2i), documents and negatives of an image and a text (t2m), bad rows included: the batches carry the
    running teacher's embeddings of what they serve, and a GradCache step (3 of 7) taught from the file `embed_images`
    writes equals one taught by the teacher."""
    data = _vl_pairs(tmp_path / "data", bad=True, negatives=negatives)
    flags = [arg.replace("m2i", mode) for arg in run_flags(ahead.root, str(data))]
    file = embed(tmp_path / "teacher.parquet", flags, ahead.teacher)
    assert_carried_and_taught(tmp_path, flags, file, ahead.teacher, 2)


# --- image-text data through the processor: a CSV of images, captions and negative captions -------------------------


def csv_flags(ahead: Ahead, root: Path, mode: str) -> list[str]:
    """The run's model on `_pictures_csv`'s nine images under `root` (image 3 does not decode), with their negative
    captions in i2t."""
    table = _pictures_csv(root / "pictures")
    (root / "pictures" / "img" / "3.png").write_bytes(b"not a png")
    negatives = ["--data.csv_negative_keys=neg_a,neg_b"] if mode == "i2t" else []
    return [f.replace("vl_pairs", "csv").replace("m2i", mode) for f in run_flags(ahead.root, str(table), *negatives)]


@pytest.mark.parametrize("mode", ["i2t", "t2i"])
def test_image_text_data_through_the_processor_is_taught_from_the_file(tmp_path: Path, ahead: Ahead, mode: str) -> None:
    """A CSV served through the qwen_vl processor (images at their own sizes, the captions on the other side, i2t's
    negative captions as documents, a bad image skipped): the file holds each good sample's query and document keyed as
    computed here, the batches carry the running teacher's embeddings of what they serve, and a GradCache step taught
    from the file equals one taught by the teacher; 2 ranks with 2 decoding workers each write one process's rows."""
    flags = csv_flags(ahead, tmp_path, mode)
    file = embed(tmp_path / "teacher.parquet", flags, ahead.teacher)
    img = tmp_path / "pictures" / "img"
    good = [i for i in range(9) if i != 3]
    images = {filled("{image}", "", img / f"{i}.png") for i in good}
    captions = {f"a photo of a cat {i}" for i in good}
    if mode == "i2t":
        captions |= {t for i in good for t in (f"a dog {i}", f"frozen water {i}")}
    queries, documents = (images, captions) if mode == "i2t" else (captions, images)
    assert set(read_file(file)) == {("query", k) for k in queries} | {("document", k) for k in documents}
    assert_carried_and_taught(tmp_path, flags, file, ahead.teacher, 2 if mode == "i2t" else 0)
    if mode == "i2t":
        out = tmp_path / "ranks.parquet"
        run_distributed(_embed_flags, 2, str(out), flags, ahead.teacher)
        assert_same_rows(out, file)
