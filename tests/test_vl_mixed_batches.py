"""Rows of several retrieval modes in one batch (`data.retrieval_modes` without `data.same_source_batches`, as VLM2Vec
samples MMEB-train): each row of a mixed batch is what its source alone gives it, a side's images those of the rows
that have one (`{side}_image_counts`), and GradCache in fixed chunks and token budgets, global negatives and two
ranks equal the dense objective over the whole batch in float64."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.hf_folders import vl_folder
from tests.needs import require
from tests.test_qwen_vl import _step, vl_run
from tests.test_qwen_vl_pairs import _vl_pairs
from tests.test_vl_modes import assert_dense_step, two_sources
from titan_contrastive.models.qwen_vl.processor import PAD

require("hf")

ROWS = [0, 9, 1, 10, 11, 2]  # m2t, t2i, m2t, t2i, t2i, m2t: the two sources' rows (9 and 8) interleaved


def _sources(tmp: Path, negatives: bool) -> tuple[Path, Path]:
    first = _vl_pairs(tmp / "a", negatives="text" if negatives else "")
    return first, _vl_pairs(tmp / "b", count=8, negatives="image" if negatives else "")


def _mixed(tmp: Path, *extra: str, negatives: bool = False):
    """A trainer (model mode t2i) on m2t rows joined with t2i rows, batches mixing them; with `negatives` two hard
    negatives a row, texts beside the m2t rows' text documents and images beside the t2i rows' image documents."""
    first, second = _sources(tmp, negatives)
    trainer = vl_run(
        tmp,
        "qwen2_vl",
        "--data.dataset=vl_pairs",
        f"--data.path={first}::{second}",
        "--data.retrieval_mode=t2i",
        "--data.retrieval_modes=m2t,t2i",
        "--training.local_batch_size=6",
        *extra,
        sizes=(),
    )
    return trainer, first, second


def _row(batch: dict, side: str, r: int) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """Row r of `side` ("neg": its hard negatives): its ids without padding, its images' grids and patches (each
    row's count `{side}_image_counts`, else as many each as the side has over its rows)."""
    ids = batch[side][r].view(-1, batch[side].shape[-1])
    grid, pixels = batch[f"{side}_image_grid_thw"], batch[f"{side}_pixel_values"]
    counts = batch.get(f"{side}_image_counts", torch.full((len(batch[side]),), len(grid) // len(batch[side])))
    first = int(counts[:r].sum())
    patches = grid.prod(-1)
    rows = slice(int(patches[:first].sum()), int(patches[: first + int(counts[r])].sum()))
    return [x[x != PAD].tolist() for x in ids], grid[first : first + int(counts[r])], pixels[rows]


@pytest.mark.parametrize(
    ("chunks", "negatives"),
    [("--gradcache.chunk_sizes=4", False), ("--gradcache.chunk_tokens=70", False), ("--gradcache.chunk_sizes=4", True)],
)
def test_a_mixed_batch_is_its_rows_and_equals_the_dense_objective(tmp_path: Path, chunks: str, negatives: bool) -> None:
    from titan_contrastive.datasets.vl_pairs import VLPairsDataset

    trainer, first, second = _mixed(tmp_path, "--gradcache.enabled=true", chunks, negatives=negatives)
    trainer.model.eval()
    data = trainer.train_set
    batch = data.__getitems__(ROWS)
    assert batch["query_image_counts"].tolist() == [1, 0, 1, 0, 0, 1]  # m2t queries have images, t2i's do not
    assert batch["doc_image_counts"].tolist() == [0, 1, 0, 1, 1, 0]
    alone = {}
    for path, mode in ((first, "m2t"), (second, "t2i")):
        alone[mode] = VLPairsDataset(split="train", path=str(path), mode=mode)
        alone[mode].serve_processed(data._process)
    for r, index in enumerate(ROWS):  # each row as its source alone serves it
        mode, row = ("m2t", index) if index < 9 else ("t2i", index - 9)
        want = alone[mode].__getitems__([row])
        for side in ("query", "doc", "neg") if negatives else ("query", "doc"):
            got, expected = _row(batch, side, r), _row(want, side, 0)
            assert got[0] == expected[0] and torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2])
    if negatives:
        assert batch["neg_image_counts"].tolist() == [0, 2, 0, 2, 2, 0] and len(batch["neg_image_grid_thw"]) == 6
    assert_dense_step(trainer, batch)
    trainer.metrics.close()


def test_a_run_of_mixed_batches_trains(tmp_path: Path) -> None:
    """Without same_source_batches the sampler mixes the sources' rows in a batch; steps run with no bad sample."""
    trainer, _, _ = _mixed(tmp_path, "--training.steps=3", "--gradcache.enabled=true", "--gradcache.chunk_sizes=4")
    order = trainer.loader.sampler.global_order().tolist()
    assert any(len({i >= 9 for i in order[j : j + 6]}) == 2 for j in range(0, len(order) - 5, 6))
    assert trainer.model.args.mixed  # a forward without images runs the vision tower at zero weight
    trainer.train()
    assert trainer.step == 3 and not trainer.loader.bad_samples.values()
    trainer.metrics.close()


def _two_ranks(tmp: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    data = two_sources(Path(tmp), "--data.retrieval_modes=m2t,t2i")  # batches mixing the sources' rows
    _step(Path(tmp), "qwen2_vl", "gradcache", *data, sizes=())  # rank 1's rows: 3 m2t, then 3 t2i
    _step(Path(tmp) / "gl", "qwen2_vl", "global", *data, sizes=())


@pytest.mark.slow  # two processes, two trainers each
def test_two_ranks(tmp_path: Path) -> None:
    """Two gloo processes, a global batch of 9 m2t and 3 t2i rows: GradCache (one rank's rows of both modes, chunks
    crossing them) and global negatives against the dense objective over both ranks' rows."""
    _sources(tmp_path, False)
    vl_folder(tmp_path, "qwen2_vl")
    vl_folder(tmp_path / "gl", "qwen2_vl")
    run_distributed(_two_ranks, 2, str(tmp_path))


def test_a_teacher_s_file_of_mixed_rows_teaches_as_the_teacher(tmp_path: Path) -> None:
    """`embed_images` on m2t rows joined with t2i rows (text and image hard negatives; a chunk of items holds both
    kinds) writes each source's queries and documents in its own mode: a mixed batch carries the running teacher's
    embeddings of what it serves, and a GradCache step (3 of 7) taught from the file equals one taught by it."""
    from tests.test_qwen_vl_teacher import teacher_folder
    from tests.test_vl_teacher_ahead import assert_carried_and_taught, embed, read_file, run_flags

    first, second = _sources(tmp_path, negatives=True)
    vl_folder(tmp_path)
    teacher = teacher_folder(tmp_path)
    flags = [
        f.replace("m2i", "t2i") for f in run_flags(tmp_path, f"{first}::{second}", "--data.retrieval_modes=m2t,t2i")
    ]
    file = embed(tmp_path / "teacher.parquet", flags, teacher, "--batch-size=4")
    sides = [side for side, _ in read_file(file)]
    assert sides.count("query") == 17  # the nine m2t queries of an image and a text, the eight t2i captions
    assert_carried_and_taught(tmp_path, flags, file, teacher, 2, rows=[*ROWS, 12])
