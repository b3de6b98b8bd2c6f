"""ColQwen: the qwen_vl family with `[model] pooling = "colbert"` (ColPali's recipe) on tiny random Qwen-VL folders.
A side's tokens are what the transformers model gives one sample on its own, projected and normalized; every step
kind equals InfoNCE over MaxSim written one pair at a time, in float64, with images of different sizes in a batch,
on 1 and 2 gloo processes, LoRA on and off; GradCache replays dropout; what ColBERT cannot take is one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import run_distributed
from tests.needs import require
from tests.test_hard_negatives import assert_step_equals_its_forwards
from tests.test_qwen_vl import LORA, _step, vl_run
from tests.test_trainer import make_trainer as base_trainer
from titan_contrastive.config import ConfigError

require("hf")

DIM = 8
COLBERT = ("--model.pooling=colbert", f"--model.colbert_dim={DIM}")
ONE_WAY_HARD = ("--loss.symmetric=false", "--loss.hardness_strength=2")


def test_a_sides_tokens_are_the_models_on_each_sample_alone(tmp_path: Path) -> None:
    """Row i of a side: sample i alone through the transformers model (no padding, no other sample), each
    token's last hidden state projected and normalized, then zeros to the side's length."""
    trainer = vl_run(tmp_path, "qwen2_vl", *COLBERT, "--training.local_batch_size=4", dropout=0.0)
    model = trainer.model.double().eval()
    batch = trainer.train_set.__getitems__([0, 1, 2, 3])
    lengths = model.lengths
    assert lengths["query"] < lengths["doc"]
    with torch.no_grad():
        q, d, scale = model(*(batch[k].double() if batch[k].is_floating_point() else batch[k] for k in _KEYS))
    assert scale.item() == 1.0  # t = 1 for MaxSim unless [loss] says otherwise
    assert q.shape == (4, lengths["query"] * DIM) and d.shape == (4, lengths["doc"] * DIM)
    starts = [0, *batch["doc_image_grid_thw"].prod(-1).cumsum(0).tolist()]
    for i in range(4):
        for side, rows in (("query", q), ("doc", d)):
            ids = batch[side][i]
            ids = ids[ids != -1][None]
            images = {}
            if side == "doc":
                grid = batch["doc_image_grid_thw"][i : i + 1]
                images = {"pixel_values": batch["doc_pixel_values"][starts[i] : starts[i + 1]].double()}
                images["image_grid_thw"] = grid
            with torch.no_grad():
                hidden = model.tower(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    mm_token_type_ids=(ids == model.tower.config.image_token_id).long(),
                    **images,
                ).last_hidden_state[0]
            want = F.normalize(hidden @ model.head.weight.T + model.head.bias, dim=-1)
            got = rows[i].view(-1, DIM)
            torch.testing.assert_close(got[: len(want)], want, rtol=0, atol=1e-12)
            assert not got[len(want) :].any()
    trainer.metrics.close()


_KEYS = ("query", "doc", "query_pixel_values", "query_image_grid_thw", "doc_pixel_values", "doc_image_grid_thw")


@pytest.mark.parametrize("kind", ["gradcache", "gradcache-tokens", "accumulate", "global"])
def test_every_step_kind_equals_maxsim_infonce(tmp_path: Path, kind: str) -> None:
    trainer = _step(tmp_path, "qwen2_vl", kind, *COLBERT)
    assert "late interaction" in trainer.gradient_step.describe()


@pytest.mark.parametrize(
    "arch, kind, extra",
    [
        ("qwen2_vl", "global", (*LORA, "--data.retrieval_mode=i2t", "--loss.symmetric=false")),
        ("qwen2_vl", "gradcache", ("--loss.maxsim_normalize=true", "--loss.init_logit_scale=3.912")),
        ("qwen2_vl", "gradcache", ("--loss.name=pairwise", "--loss.maxsim_normalize=true")),  # ColQwen2's recipe
        ("qwen2_vl", "global", ("--loss.name=siglip", "--loss.maxsim_normalize=true", "--loss.mask_relative=0.9")),
        ("qwen2_vl", "global", ("--loss.maxsim_normalize=true", "--loss.mask_relative=0.9", *ONE_WAY_HARD)),
        ("qwen3_vl", "gradcache", ()),
        ("qwen2_5_vl", "global", LORA),
        ("qwen2_vl", "gradcache", ("--loss.matryoshka_dims=8,4", "--loss.matryoshka_weights=1,0.5")),
    ],
)
def test_lora_images_as_queries_and_other_archs(tmp_path: Path, arch: str, kind: str, extra: tuple[str, ...]) -> None:
    _step(tmp_path, arch, kind, *COLBERT, *extra)


def _two_ranks(tmp: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    _step(Path(tmp), "qwen2_vl", "global", *COLBERT)


def test_global_negatives_on_two_ranks(tmp_path: Path) -> None:
    run_distributed(_two_ranks, 2, str(tmp_path))


def test_gradcache_replays_dropout(tmp_path: Path) -> None:
    """With dropout on, GradCache's step equals the objective over the same chunks' forwards."""
    trainer = vl_run(
        tmp_path, "qwen2_vl", *COLBERT, "--training.local_batch_size=6", "--gradcache.enabled=true",
        "--gradcache.chunk_sizes=4",
    )  # fmt: skip
    assert trainer.model.training
    batch = trainer.train_set.__getitems__(list(range(6)))
    pieces = trainer.step_context.split(batch, 4)
    assert_step_equals_its_forwards(trainer, [batch], pieces, seed=5, objective=trainer.objective)
    trainer.metrics.close()


@pytest.mark.parametrize(
    "options, message",
    [
        (("--data.max_pixels=20000000",), "data.max_pixels=20000000: model.pooling='colbert' pads every image"),
        (("--loss.matryoshka_dims", "256"), "loss.matryoshka_dims=[256]: the tokens have 128 dimensions"),
        (("--model.pooling=mean", "--model.colbert_dim=8"), "model.colbert_dim=8: it applies to model.pooling"),
        (("--model.query_expansion=true",), "model.query_expansion=true: the qwen_vl family has no ColBERT queries"),
    ],
)
def test_what_colbert_cannot_take_is_one_line(tmp_path: Path, options: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        vl_run(tmp_path, "qwen2_vl", "--model.pooling=colbert", *options)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("lora", [pytest.param(False, marks=pytest.mark.slow), True])  # the default suite: LoRA merged
def test_a_run_evaluates_exports_to_colpali_and_trains_on_from_it(tmp_path: Path, lora: bool, capsys) -> None:
    """Held-out recall and loss by MaxSim; `--to colpali` writes the (merged) model with `custom_text_proj`, which
    the exporter reloads and compares; a new run on that folder starts from its projection and trains it, LoRA or not.
    `--to hf` is refused in one line (exit 2), nothing written."""
    from titan_contrastive.export import main as export_main
    from titan_contrastive.models.qwen_vl.colpali import read_projection

    run = vl_run(
        tmp_path, "qwen2_vl", "--model.pooling=colbert", "--training.local_batch_size=6", "--training.steps=1",
        "--checkpoint.enable=true", "--eval.enable=true", "--optimizer.lr=1e-2", "--lr_scheduler.warmup_steps=0",
        "--data.max_pixels=7056", *(LORA if lora else ()), dropout=0.0,
    )  # fmt: skip
    assert run.model_args.colbert_dim == 128  # ColQwen2's
    before = run.model.head.weight.detach().clone()
    run.train()
    run.metrics.close()
    assert not torch.equal(before, run.model.head.weight)  # the new projection trains, LoRA or not
    rows = [json.loads(line) for line in (tmp_path / "run-qwen2_vl" / "metrics.jsonl").read_text().splitlines()]
    (evaluated,) = [row for row in rows if row.get("kind") == "eval"]
    assert "late interaction" in run.objective.describe()  # evaluation scores by its `similarity`
    assert evaluated["loss"] > 0 and 0 <= evaluated["text_to_image_r@1"] <= 1
    step = tmp_path / "run-qwen2_vl" / "checkpoint" / "step-1"
    out = tmp_path / "colqwen"
    assert export_main([str(step), "--to", "colpali", "--out", str(out)]) == 0
    assert torch.equal(read_projection(str(out))["weight"], run.model.head.weight.float())
    assert export_main([str(step), "--to", "hf", "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "this run is a ColBERT run (model.pooling='colbert'); use --to colpali" in err
    assert not (tmp_path / "hf").exists()
    again = base_trainer(
        str(tmp_path / "again"), "--model.name=qwen_vl", f"--model.path={out}", "--model.pooling=colbert",
        "--data.dataset=emoji", "--data.context_length=8", "--eval.enable=false", *(LORA if lora else ()),
    )  # fmt: skip
    assert torch.equal(again.model.head.weight.float(), read_projection(str(out))["weight"])
    assert again.model.head.weight.requires_grad
    again.metrics.close()
    with pytest.raises(ConfigError, match="model.colbert_dim=64: .* projects tokens to 128"):
        base_trainer(str(tmp_path / "bad"), "--model.name=qwen_vl", f"--model.path={out}", "--model.pooling=colbert",
                     "--model.colbert_dim=64", "--data.dataset=emoji")  # fmt: skip


def test_a_files_template_longer_than_the_models_is_one_line(tmp_path: Path) -> None:
    """Every query is laid out at the model template's length: a `vl_pairs` file's longer template is refused at
    start, naming the setting; a sample past its side's length (here: a shortened side) is one DataError."""
    from tests.test_qwen_vl_pairs import _vl_pairs
    from titan_contrastive.datasets.base import DataError

    rows = _vl_pairs(tmp_path / "data")
    common = (*COLBERT, "--data.dataset=vl_pairs", f"--data.path={rows}::{rows}", "--training.local_batch_size=4")
    with pytest.raises(ConfigError) as err:
        vl_run(tmp_path, "qwen2_vl", *common, "--data.query_prompts", "find a photo of a cat : {text}", "", sizes=())
    message = str(err.value)
    assert message.startswith("data.query_prompts[0]='find a photo of a cat : {text}': it gives up to") and (
        "set model.query_prompt to the longest of the templates" in message and "\n" not in message
    )
    trainer = vl_run(tmp_path, "qwen2_vl", *common, sizes=())
    processor = trainer.train_set._process
    processor.lengths = {**processor.lengths, "query": 3}
    with pytest.raises(DataError, match=r"^a query of \d+ tokens: model.pooling='colbert' lays every query out at 3"):
        processor.sides(None, ["a photo of a cat"], [np.zeros((28, 28, 3), np.uint8)], None)
    trainer.metrics.close()
