"""The shipped recipes for a user's own Hugging Face model run as written, on tiny stand-ins: only the model
folder, the data and the run's length and sizes are overridden (`train_configs/qwen3_embedding_lora.toml` with the tiny
Qwen3-like decoder and pairs with hard negatives, then exported to sentence-transformers;
`train_configs/bge_finetune.toml` with the tiny BERT-like encoder and FlagEmbedding's rows;
`train_configs/hf_siglip.toml` with the tiny SigLIP folder and image-caption files; `train_configs/sts_cosent.toml`
with the tiny BERT-like encoder and scored sentence pairs; `train_configs/qwen_vl_embedder_lora.toml` with the
tiny Qwen2-VL folder and query-document rows, then exported; `train_configs/splade.toml` with the tiny BERT-like
masked LM, then exported to a SparseEncoder folder; `train_configs/splade_inference_free.toml` with the same,
then exported to a SparseEncoder Router; `train_configs/colbert.toml` with a tiny PyLate folder, then exported to a
PyLate folder; `train_configs/colbert_distill.toml` with the tiny encoder and scored rows;
`train_configs/colqwen.toml` with the tiny Qwen2-VL folder and query-page rows, then exported to a colpali-engine
folder; `train_configs/clip_distill.toml` with a tiny Hugging Face CLIP teacher and image-caption files;
`train_configs/static_distill.toml` with the tiny StaticEmbedding folder, its teacher's embeddings written first
by the embed command)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tests.hf_folders import architecture_folder, decoder_folder, encoder_folder, image_text_folder
from tests.needs import require
from tests.test_hf_clip import pictures
from tests.test_hf_text import PAIRS

require("hf")

REPO = Path(__file__).resolve().parents[1]
SHORT = ["--training.steps=2", "--lr_scheduler.warmup_steps=1", "--metrics.enable_tensorboard=false"]


def _train(tmp: Path, recipe: str, *overrides: str):
    from titan_contrastive.config import parse_args
    from titan_contrastive.train import Trainer

    config = ["--job.config_file", str(REPO / "train_configs" / recipe), f"--job.dump_folder={tmp / 'run'}"]
    trainer = Trainer(parse_args([*config, *SHORT, *overrides]))
    out = trainer.train()
    trainer.metrics.close()
    return trainer, out


def test_the_decoder_embedder_recipe(tmp_path: Path) -> None:
    from titan_contrastive.export import main as export_main

    rows = [{"query": q, "positive": p, "negative": PAIRS[(i + 3) % len(PAIRS)][1]} for i, (q, p) in enumerate(PAIRS)]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    batch = ["--training.local_batch_size=3", "--training.global_batch_size=6", "--checkpoint.interval=2"]
    batch += ["--data.context_length=48", "--data.doc_context_length=32"]  # the tiny decoder holds 64 positions
    trainer, _ = _train(
        tmp_path,
        "qwen3_embedding_lora.toml",
        f"--model.path={decoder_folder(tmp_path)}",
        f"--data.path={pairs}",
        *batch,
    )
    args = trainer.model_args
    assert args.pooling == "last_token" and args.query_prompt.startswith("Instruct: ") and args.lora_rank == 16
    assert trainer.ga_steps == 2 and trainer.step == 2
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(e["loss"]) for e in logged if "loss" in e)
    step = tmp_path / "run" / "checkpoint" / "step-2"
    assert export_main([str(step), "--to", "sentence-transformers", "--out", str(tmp_path / "st")]) == 0


def test_the_bge_recipe(tmp_path: Path) -> None:
    """FlagEmbedding's rows (lists of positives and negatives, a prompt on some rows) on the tiny encoder: 7 of each
    row's negatives a step, the instruction before the queries, one-way InfoNCE at temperature 0.02."""
    from titan_contrastive.batching import NEGATIVES

    texts = [p for _, p in PAIRS]
    rows = [
        {"query": q, "pos": [p], "neg": [t for t in texts if t != p][i % 3 :]} | ({"prompt": "Find: "} if i % 2 else {})
        for i, (q, p) in enumerate(PAIRS)
    ]
    pairs = tmp_path / "bge.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    batch = ["--training.local_batch_size=3", "--training.global_batch_size=6", "--checkpoint.enable=false"]
    batch += ["--data.doc_context_length=32"]  # the tiny encoder holds 64 positions
    trainer, _ = _train(
        tmp_path, "bge_finetune.toml", f"--model.path={encoder_folder(tmp_path)}", f"--data.path={pairs}", *batch
    )
    args, data = trainer.model_args, trainer.train_set
    assert args.query_prompt.startswith("Represent this sentence") and data.num_negatives == 7
    assert data.__getitems__([0, 1])[NEGATIVES].shape[:2] == (2, 7)
    assert trainer.objective.describe() == "clip loss (InfoNCE, one-way)" and trainer.step == 2
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(e["loss"]) for e in logged if "loss" in e)


def test_the_siglip_recipe(tmp_path: Path) -> None:
    table = pictures(tmp_path / "data")
    batch = ["--training.local_batch_size=4", "--training.global_batch_size=8", "--data.val_path="]
    trainer, _ = _train(
        tmp_path,
        "hf_siglip.toml",
        f"--model.path={image_text_folder(tmp_path, 'siglip')}",
        "--data.dataset=csv",
        f"--data.path={table}",
        *batch,
    )
    assert trainer.step == 2 and trainer.ga_steps == 2 and trainer.cfg.loss.negatives == "global"


def test_the_clip_distillation_recipe(tmp_path: Path) -> None:
    """The student at the debug flavor's sizes on 32 px pictures; the teacher a tiny Hugging Face CLIP folder with
    the CLIP BPE vocabulary, 3 channels, 16 px images (resized to the run's 32) and 77 positions."""
    import dataclasses

    from tests.test_export import BPE, step_folder
    from titan_contrastive.models.clip.state_dict_adapter import write_hf

    args = dataclasses.replace(BPE, in_channels=3, image_size=16, patch_size=8, context_length=77)
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    write_hf(str(step_folder(tmp_path / "teacher_run", args, seed=2)[0]), teacher)
    table = pictures(tmp_path / "data")
    batch = ["--training.local_batch_size=4", "--training.global_batch_size=8", "--data.val_path="]
    run = ["--model.flavor=debug", "--data.dataset=csv", f"--data.path={table}", "--data.image_size=32", *batch]
    trainer, _ = _train(tmp_path, "clip_distill.toml", *run, f"--loss.teacher_model={teacher}", "--data.num_workers=0")
    assert trainer.step == 2 and trainer.ga_steps == 2 and trainer.cfg.loss.negatives == "global"
    assert "and of each positive over the queries" in trainer.gradient_step.describe()
    held = trainer.step_context.guide
    assert held.visual.positional_embedding.shape == (1 + 4 * 4, 32) and held.text.context_length == 77
    tau = math.exp(-held.logit_scale.item())  # the recipe's distill_temperature = 0: the teacher's own
    assert abs(trainer.objective.distillation.temperature - tau) < 1e-6 * tau and abs(tau - 1) > 0.1
    # the recipe's second route: the teacher's embeddings written once, no teacher running
    from titan_contrastive import embed_images

    out, config = tmp_path / "teacher.parquet", str(REPO / "train_configs" / "clip_distill.toml")
    assert (
        embed_images.main(["--out", str(out), f"--job.config_file={config}", *run, f"--loss.teacher_model={teacher}"])
        == 0
    )
    ahead = ["--loss.teacher_model=", f"--loss.teacher_embeddings={out}", "--data.num_workers=0"]
    trainer, _ = _train(tmp_path / "ahead", "clip_distill.toml", *run, *ahead)
    assert trainer.step == 2 and trainer.step_context.guide is None
    assert abs(trainer.objective.distillation.temperature - tau) < 1e-6 * tau  # kept in the file
    assert "the frozen teacher's cosines (embedded ahead, from the data)" in trainer.gradient_step.describe()


def test_the_sts_cosent_recipe(tmp_path: Path) -> None:
    """CoSENT on scored pairs with GradCache; the STS evaluation at the last step names the best checkpoint."""
    rows = [{"sentence1": q, "sentence2": p, "score": float(i % 6)} for i, (q, p) in enumerate(PAIRS)]
    for name in ("train", "test"):
        (tmp_path / f"sts_{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    trainer, _ = _train(
        tmp_path,
        "sts_cosent.toml",
        f"--model.path={encoder_folder(tmp_path)}",
        f"--data.path={tmp_path / 'sts_train.jsonl'}",
        f"--eval.sts_path={tmp_path / 'sts_test.jsonl'}",
        "--training.local_batch_size=8",
        "--training.global_batch_size=8",
        "--gradcache.chunk_sizes=3",
        "--data.context_length=24",
        "--data.doc_context_length=24",
        "--eval.freq=2",
        "--checkpoint.interval=2",
    )
    assert trainer.step == 2 and trainer.cfg.loss.distill == "cosent" and not trainer.model.logit_scale.requires_grad
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("sts/spearman_cosine" in e for e in logged)
    best = json.loads((tmp_path / "run" / "checkpoint" / "best.json").read_text())
    assert best["metric"] == "sts/spearman_cosine" and best["step"] == 2


def test_the_qwen_vl_embedder_recipe(tmp_path: Path) -> None:
    """LoRA, GradCache token budgets and a fixed temperature on text-to-image rows; the step exports."""
    from tests.hf_folders import vl_folder
    from tests.test_qwen_vl_pairs import _vl_pairs
    from titan_contrastive.export import main as export_main

    rows = _vl_pairs(tmp_path / "data")
    trainer, _ = _train(
        tmp_path,
        "qwen_vl_embedder_lora.toml",
        f"--model.path={vl_folder(tmp_path)}",
        f"--data.path={rows}",
        "--training.local_batch_size=4",
        "--training.global_batch_size=8",
        "--gradcache.chunk_tokens=64",
        "--data.context_length=12",
        "--eval.enable=false",
        "--checkpoint.interval=2",
    )
    args = trainer.model_args
    assert (
        trainer.step == 2
        and trainer.ga_steps == 2
        and args.lora_rank == 16
        and not trainer.model.logit_scale.requires_grad
    )
    assert trainer.cfg.gradcache.chunk_tokens == 64 and trainer.cfg.data.retrieval_mode == "t2i"
    step = tmp_path / "run" / "checkpoint" / "step-2"
    assert export_main([str(step), "--to", "hf", "--out", str(tmp_path / "hf")]) == 0


def test_the_colqwen_recipe(tmp_path: Path) -> None:
    """ColPali's objective (one-way, scores over each query's length, t = 50 fixed) over MaxSim of 128-wide tokens,
    LoRA and GradCache chunks on text-to-image rows; the step exports to colpali-engine's folder."""
    from tests.hf_folders import vl_folder
    from tests.test_qwen_vl_pairs import _vl_pairs
    from titan_contrastive.export import main as export_main

    rows = _vl_pairs(tmp_path / "data")
    trainer, _ = _train(
        tmp_path,
        "colqwen.toml",
        f"--model.path={vl_folder(tmp_path)}",
        f"--data.path={rows}",
        "--training.local_batch_size=4",
        "--training.global_batch_size=8",
        "--gradcache.chunk_sizes=3",
        "--data.context_length=12",
        "--eval.enable=false",
        "--checkpoint.interval=2",
    )
    args, objective = trainer.model_args, trainer.objective
    assert trainer.step == 2 and trainer.ga_steps == 2 and args.lora_rank == 32 and args.token_dim == 128
    assert objective.normalize and not objective.symmetric and not trainer.model.logit_scale.requires_grad
    assert args.query_template.endswith("<|endoftext|>" * 10)
    step = tmp_path / "run" / "checkpoint" / "step-2"
    assert export_main([str(step), "--to", "colpali", "--out", str(tmp_path / "colqwen")]) == 0


def _splade_recipe(tmp_path: Path, recipe: str):
    """`recipe` trained as written for two steps on the tiny masked LM and the pairs, then exported to
    sentence-transformers (the exporter checks the folder); the trainer."""
    from titan_contrastive.export import main as export_main

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"query": q, "positive": p}) + "\n" for q, p in PAIRS))
    batch = ["--training.local_batch_size=3", "--training.global_batch_size=6", "--checkpoint.interval=2"]
    batch += ["--data.context_length=32", "--data.doc_context_length=16", "--eval.enable=false"]
    model = f"--model.path={architecture_folder(tmp_path, 'bert-mlm')}"
    trainer, _ = _train(tmp_path, recipe, model, f"--data.path={pairs}", *batch)
    step = tmp_path / "run" / "checkpoint" / "step-2"
    assert export_main([str(step), "--to", "sentence-transformers", "--out", str(tmp_path / "st")]) == 0
    return trainer


def test_the_splade_recipe(tmp_path: Path) -> None:
    trainer = _splade_recipe(tmp_path, "splade.toml")
    assert trainer.model_args.pooling == "splade" and trainer.model.logit_scale.exp().item() == 1.0
    assert "FLOPS (5e-05 x the queries', 3e-05 x the documents', rising quadratically over 666 steps)" in (
        trainer.gradient_step.describe()
    )


def test_the_colbert_recipe(tmp_path: Path) -> None:
    """`train_configs/colbert.toml` as written for two steps on the tiny PyLate folder and the pairs, then exported
    to a PyLate folder (the exporter checks both sides)."""
    from tests.colbert_folders import colbert_encoder, pylate_folder
    from titan_contrastive.export import main as export_main

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"query": q, "positive": p}) + "\n" for q, p in PAIRS))
    batch = ["--training.local_batch_size=3", "--training.global_batch_size=6", "--checkpoint.interval=2"]
    batch += ["--data.context_length=12", "--data.doc_context_length=10", "--eval.enable=false"]
    model = f"--model.path={pylate_folder(colbert_encoder(tmp_path))}"
    trainer, _ = _train(tmp_path, "colbert.toml", model, f"--data.path={pairs}", *batch)
    assert (trainer.model_args.pooling, trainer.model_args.colbert_dim) == ("colbert", 8)
    assert "late interaction, MaxSim of 8-wide tokens, one-way" in trainer.gradient_step.describe()
    assert trainer.model.logit_scale.exp().item() == 1.0
    step = tmp_path / "run" / "checkpoint" / "step-2"
    assert export_main([str(step), "--to", "pylate", "--out", str(tmp_path / "pylate")]) == 0


def test_the_colbert_distillation_recipe(tmp_path: Path) -> None:
    """`train_configs/colbert_distill.toml` as written for two steps on the tiny encoder (a new projection) and rows
    of a query, its documents in a `negatives` list and a teacher's `scores`."""
    from tests.colbert_folders import colbert_encoder

    rows = [
        {"query": q, "positive": p, "negatives": [PAIRS[(i + j) % len(PAIRS)][1] for j in (2, 5)], "scores": [5, 1, 2]}
        for i, (q, p) in enumerate(PAIRS)
    ]
    scored = tmp_path / "scored.jsonl"
    scored.write_text("".join(json.dumps(r) + "\n" for r in rows))
    batch = ["--training.local_batch_size=3", "--training.global_batch_size=3", "--data.context_length=12"]
    batch.append("--data.doc_context_length=10")
    model = f"--model.path={colbert_encoder(tmp_path)}"
    trainer, _ = _train(tmp_path, "colbert_distill.toml", model, f"--data.path={scored}", *batch, "--eval.enable=false")
    assert (trainer.model_args.pooling, trainer.model_args.colbert_dim) == ("colbert", 128)
    assert trainer.gradient_step.describe().startswith(
        "1 x distillation (KL to the teacher's softmax at tau 1, the logits min-max scaled per query) over each "
        "query's own documents, scored by late interaction (MaxSim of 128-wide tokens), without the contrastive"
    )
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(e["loss"]) for e in logged if "loss" in e) and trainer.step == 2


def test_the_inference_free_splade_recipe(tmp_path: Path) -> None:
    trainer = _splade_recipe(tmp_path, "splade_inference_free.toml")
    assert trainer.model_args.inference_free and trainer.lr_scheduler.base_lrs[-1] == 1e-3
    assert "FLOPS (0 x the queries', 0.0003 x the documents', rising quadratically over 666 steps)" in (
        trainer.gradient_step.describe()
    )
    assert (tmp_path / "st" / "router_config.json").is_file()


def test_the_static_distillation_recipe(tmp_path: Path) -> None:
    """`train_configs/static_distill.toml` as its comment runs it: the teacher's embeddings written by the embed
    command (the tiny encoder for MiniLM, pairs for WordNet), then two steps of the static model with the KL toward
    them, on the tiny StaticEmbedding folder (8 wide: Matryoshka at 4 and 8); the loss is finite and the run saved."""
    from tests.test_static import _rows, static_folder
    from titan_contrastive.embed import main as embed_main

    rows, teacher = _rows(tmp_path), tmp_path / "teacher.parquet"
    assert embed_main([str(rows), "--model", str(encoder_folder(tmp_path)), "--out", str(teacher)]) == 0
    trainer, _ = _train(
        tmp_path,
        "static_distill.toml",
        f"--model.path={static_folder(tmp_path)}",
        "--model.static_dim=0",
        "--data.dataset=pairs",
        f"--data.path={rows}",
        f"--loss.teacher_embeddings={teacher}",
        "--loss.matryoshka_dims", "4", "8",
        "--eval.dims", "4",
        "--training.local_batch_size=6",
        "--data.context_length=12",
        "--data.doc_context_length=6",
        "--eval.enable=false",
        "--checkpoint.interval=2",
    )  # fmt: skip
    assert trainer.step == 2 and trainer.cfg.loss.distill == "kl" and trainer.cfg.loss.teacher_embeddings
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(e["loss"]) for e in logged if "loss" in e)
    assert (tmp_path / "run" / "checkpoint" / "step-2" / "manifest.json").is_file()
