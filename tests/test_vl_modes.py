"""A retrieval mode per vl_pairs source (`data.retrieval_modes`, MMEB's training mix: VQA in m2t beside retrieval in
t2i): with `data.same_source_batches` each step is one source's, so of one mode; each source's batch is what that
source alone gives in its mode (the sides of another kind than the model's with that kind's default template), and
GradCache on it equals the dense objective in float64; modes that cannot train together are one line at start."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.hf_folders import vl_folder
from tests.needs import require
from tests.test_hard_negatives import assert_grads_close
from tests.test_hf_text import grads
from tests.test_pairs_data import _one_line
from tests.test_qwen_vl import REL, _dense, _step, vl_run
from tests.test_qwen_vl_pairs import _vl_pairs
from titan_contrastive.config import ConfigError
from titan_contrastive.config.manager import parse_args
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.source_modes import source_modes

require("hf")

KEYS = ("query", "doc", "query_pixel_values", "query_image_grid_thw", "doc_pixel_values", "doc_image_grid_thw")


def _mixed(tmp: Path, *extra: str, mode: str = "t2i", negatives: bool = False):
    """A trainer (model mode `mode`) on two sources, m2t rows then t2i rows, each step one source's; with `negatives`
    two hard negatives a row, texts for the m2t rows' text documents and images for the t2i rows'."""
    first = _vl_pairs(tmp / "a", negatives="text" if negatives else "")
    second = _vl_pairs(tmp / "b", count=8, negatives="image" if negatives else "")
    trainer = vl_run(
        tmp,
        "qwen2_vl",
        "--data.dataset=vl_pairs",
        f"--data.path={first}::{second}",
        f"--data.retrieval_mode={mode}",
        "--data.retrieval_modes=m2t,t2i",
        "--data.same_source_batches=true",
        "--training.local_batch_size=4",
        *extra,
        sizes=(),
    )
    return trainer, first, second


@pytest.mark.parametrize(
    ("chunks", "negatives"),
    [("--gradcache.chunk_sizes=3", False), ("--gradcache.chunk_tokens=70", False), ("--gradcache.chunk_sizes=3", True)],
)
def test_each_source_in_its_own_mode_equals_the_dense_objective(tmp_path: Path, chunks: str, negatives: bool) -> None:
    from titan_contrastive.datasets.vl_pairs import VLPairsDataset

    trainer, first, second = _mixed(tmp_path, "--gradcache.enabled=true", chunks, negatives=negatives)
    trainer.model.eval()
    data = trainer.train_set
    assert any(p.requires_grad for p in trainer.model.tower.visual.parameters())
    assert not trainer.model.args.mixed  # each batch one source's: no forward runs the vision tower without images
    image_token = trainer.model.tower.config.image_token_id
    for path, mode, rows in ((first, "m2t", range(4)), (second, "t2i", range(9, 13))):
        batch = data.__getitems__(list(rows))
        alone = VLPairsDataset(split="train", path=str(path), mode=mode)
        alone.serve_processed(data._process)
        want = alone.__getitems__([r - rows[0] for r in rows])
        for key in (*KEYS, "neg", "neg_pixel_values", "neg_image_grid_thw") if negatives else KEYS:
            assert torch.equal(batch[key], want[key]), (mode, key)
        if negatives:  # texts beside text documents (no images), images beside image documents
            assert batch["neg"].shape[:2] == (4, 2) and len(batch["neg_image_grid_thw"]) == (0 if mode == "m2t" else 8)
        query_images, doc_images = (len(batch[f"{side}_image_grid_thw"]) for side in ("query", "doc"))
        assert (query_images, doc_images) == ((4, 0) if mode == "m2t" else (0, 4))
        words = (batch["query"] != -1).sum(1) - (batch["query"] == image_token).sum(1)
        assert (words > 2).all()  # m2t: its text beside the image's tokens; t2i: the caption
        if mode == "m2t":  # the multi query's and the text document's default templates, not the model's t2i ones
            assert data._template("query", 0) == "{image} {text}" and data._template("doc", 0) == "{text}"
        assert_dense_step(trainer, batch)
    trainer.metrics.close()


def assert_dense_step(trainer, batch: dict) -> None:
    """The trainer's step on `batch` (its tensors), after one warm-up step on it, equals the dense objective over it
    in float64: the loss and every gradient."""
    batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    trainer.train_step([batch])
    want_loss, want_grads = _dense(trainer, [batch])
    out = trainer.train_step([batch])
    assert_grads_close(grads(trainer.model), want_grads)
    assert abs(out["loss"] - want_loss) <= REL * want_loss


def two_sources(tmp: Path, *extra: str) -> tuple[str, ...]:
    """The data flags of the m2t rows of `tmp`/a joined with the t2i rows of `tmp`/b, the model's mode t2i."""
    first, second = tmp / "a" / "pairs.jsonl", tmp / "b" / "pairs.jsonl"
    return ("--data.dataset=vl_pairs", f"--data.path={first}::{second}", "--data.retrieval_mode=t2i", *extra)


def _two_ranks(tmp: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    data = two_sources(Path(tmp), "--data.retrieval_modes=m2t,t2i", "--data.same_source_batches=true")
    _step(Path(tmp), "qwen2_vl", "global", *data, sizes=())
    _step(Path(tmp) / "gc", "qwen2_vl", "gradcache-tokens", *data, "--gradcache.chunk_tokens=200", sizes=())


@pytest.mark.slow  # two processes, two trainers each
def test_two_ranks(tmp_path: Path) -> None:
    """Two gloo processes, a global batch of the m2t source (the model's mode is t2i): global negatives and GradCache
    with a token budget against the dense objective over both ranks' rows."""
    _vl_pairs(tmp_path / "a", count=12)
    _vl_pairs(tmp_path / "b", count=12)
    vl_folder(tmp_path, "qwen2_vl")
    vl_folder(tmp_path / "gc", "qwen2_vl")
    run_distributed(_two_ranks, 2, str(tmp_path))


def test_a_run_of_two_modes_trains_and_evaluates(tmp_path: Path) -> None:
    """Steps alternate between the sources (each step one source's), nothing is a bad sample, and the held-out split
    is evaluated in data.retrieval_mode (t2t: its vision tower is trained all the same, for the sources' images)."""
    held_out = _vl_pairs(tmp_path / "val", count=6)
    trainer, _, _ = _mixed(
        tmp_path, "--training.steps=4", f"--data.val_path={held_out}", "--eval.enable=true", mode="t2t"
    )
    assert all(p.requires_grad for p in trainer.model.tower.visual.parameters())
    assert not trainer.model.args.mixed
    order = trainer.loader.sampler.global_order().tolist()
    assert {tuple({i >= 9 for i in order[j : j + 4]}) for j in range(0, len(order), 4)} == {(False,), (True,)}
    trainer.train()
    assert trainer.step == 4 and not trainer.loader.bad_samples.values()
    results = trainer.evaluate()
    assert results["num_samples"] == 6 and 0 <= results["query_to_doc_r@1"] <= 1
    trainer.metrics.close()


def test_modes_that_cannot_train_together_are_one_line(tmp_path: Path) -> None:
    def data(**fields):
        given = dict(dataset="vl_pairs", path="a.jsonl::b.jsonl", retrieval_mode="t2i", same_source_batches=True)
        return SimpleNamespace(**(given | fields))

    assert source_modes(data(retrieval_modes=[])) == ["t2i", "t2i"]
    assert source_modes(data(retrieval_modes=["m2t", "i2t"])) == ["m2t", "i2t"]
    assert source_modes(data(retrieval_modes=["m2t", "t2i"], same_source_batches=False)) == ["m2t", "t2i"]  # mixed
    cases = [
        (dict(dataset="pairs", retrieval_modes=["m2t", "t2i"]), "per-source modes are for vl_pairs rows"),
        (dict(retrieval_modes=["m2t"]), "1 mode(s) for the 2 source(s) in data.path"),
        (dict(retrieval_modes=["t2t", "t2i"]), "a t2t step would leave the vision tower without gradients"),
    ]
    for fields, needle in cases:
        with pytest.raises(DataError) as err:
            source_modes(data(**fields))
        _one_line(err, "data.retrieval_modes=", needle)
    with pytest.raises((ConfigError, SystemExit)):
        parse_args(["--data.retrieval_modes=m2t,x2y"])
    from titan_contrastive.datasets.vl_pairs import VLPairsDataset

    first, second = _vl_pairs(tmp_path / "a"), _vl_pairs(tmp_path / "b", count=8)
    vqa = tmp_path / "a" / "vqa.jsonl"  # each source needs only its mode's columns: m2t rows without a document image
    vqa.write_text("".join(line.replace('"doc_image"', '"other"') + "\n" for line in first.read_text().splitlines()))
    VLPairsDataset(split="train", path=f"{vqa}::{second}", mode="t2i", modes=["m2t", "t2i"])
    with pytest.raises(DataError) as err:
        VLPairsDataset(split="train", path=f"{second}::{vqa}", mode="t2i", modes=["m2t", "t2i"])
    _one_line(err, "vqa.jsonl: no column doc_image; its retrieval mode, t2i, needs query_text, doc_image")


def test_colbert_lays_each_side_out_at_the_longest_of_its_kinds(tmp_path: Path) -> None:
    """Under ColBERT pooling every item of a side is laid out at one length: with m2t beside t2i, the query side's is
    the multi default's (an image and a text), longer than the model's text template alone gives."""
    from titan_contrastive.models.qwen_vl.model import JOIN_SLACK, QwenVLArgs
    from titan_contrastive.models.qwen_vl.processor import VLProcessor

    path = str(vl_folder(tmp_path, "qwen2_vl"))
    one = QwenVLArgs(path=path, mode="t2i", query_template="{text}", doc_template="{image}", text_length=6)
    both = dataclasses.replace(one, modes=("m2t", "t2i"))
    proc = VLProcessor(path, 0, 0, 6)
    assert one.side_tokens == {
        s: proc.most_tokens(t) + JOIN_SLACK for s, t in (("query", "{text}"), ("doc", "{image}"))
    }
    assert both.side_tokens == {"query": proc.most_tokens("{image} {text}") + JOIN_SLACK, "doc": one.side_tokens["doc"]}
    assert both.side_tokens["query"] > one.side_tokens["query"] + proc.most_visual_tokens - 1
