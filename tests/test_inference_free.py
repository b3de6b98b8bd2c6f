"""Inference-free SPLADE (`[model] inference_free`, a sentence-transformers Router with a SparseStaticEmbedding on
the query route): the query and document embeddings equal the Router's `encode_query` / `encode_document`, and the
objective on them SpladeLoss's; GradCache and global negatives through the trainer equal the dense objective over
every parameter, the query weights included; the query weights train at `optimizer.static_query_lr`; the step
exports as a Router again, and the queries refuse a transformers folder; what it cannot take is a one-line error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.hf_folders import architecture_folder
from tests.needs import needs
from tests.sparse_folders import router_folder
from tests.test_hf_text import PAIRS, folder_run
from tests.test_splade import SPLADE, _step, assert_equals_splade_loss

PROMPTS = {"query": "query ", "document": "represent the passage "}


def _router(tmp: Path, prompts: dict[str, str] | None = None) -> Path:
    return router_folder(architecture_folder(tmp, "bert-mlm", 0.0), PROMPTS if prompts is None else prompts)


@needs("hf")
def test_embeddings_and_loss_equal_sentence_transformers(tmp_path: Path) -> None:
    """Queries: the folder's weight on each vocabulary entry among their tokens (the prompt's included, special
    tokens not); documents: SPLADE's max over log1p_relu. One-way InfoNCE at t = 1 plus the documents' FLOPS
    equals SpladeLoss without a query regularizer (inference-free), loss and gradients."""
    from sentence_transformers.sparse_encoder import SparseEncoder

    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs, build_tokenizer

    folder = _router(tmp_path)
    args = BiEncoderArgs(path=str(folder), query_length=24).resolve(doc_length=24)
    assert (args.pooling, args.inference_free, args.splade_activation) == ("splade", True, "log1p_relu")
    assert (args.query_prompt, args.doc_prompt) == tuple(PROMPTS.values())
    tokenizer, ours = build_tokenizer(args), BiEncoder(args).eval()
    texts = [q for q, _ in PAIRS[:6]]
    with torch.no_grad():
        zq, zd, _ = ours(tokenizer.encode_queries(texts, 24), tokenizer.encode_docs(texts))
    theirs = SparseEncoder(str(folder), device="cpu")
    want_q = theirs.encode_query(texts, convert_to_tensor=True, convert_to_sparse_tensor=False)
    want_d = theirs.encode_document(texts, convert_to_tensor=True, convert_to_sparse_tensor=False)
    assert torch.equal(zq, want_q) and (zq > 0).sum(1).min() >= 2  # the weights themselves, on a few entries
    assert (zd - want_d).abs().max() <= 1e-5 * want_d.abs().max()
    assert_equals_splade_loss(theirs, zq, zd, (0.0, 0.03))


@needs("hf")
def test_the_weights_of_a_token_table(tmp_path: Path) -> None:
    """A SparseStaticEmbedding whose config names a JSON of token: weight (OpenSearch's idf.json) instead of
    safetensors: each named token's entry holds its weight, every other entry 0."""
    import shutil

    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs

    folder = _router(tmp_path)
    static = folder / json.loads((folder / "router_config.json").read_text())["structure"]["query"][0]
    (static / "model.safetensors").unlink()
    (static / "config.json").write_text(json.dumps({"frozen": False, "path": "idf.json"}))
    vocab = json.loads((static / "tokenizer.json").read_text())["model"]["vocab"]
    table = {token: 1.0 + i / 10 for i, token in enumerate(sorted(vocab)[:7])}
    (static / "idf.json").write_text(json.dumps(table))
    weight = BiEncoder(BiEncoderArgs(path=str(folder)).resolve()).static_query.weight
    assert {i for i in range(len(weight)) if weight[i] != 0} == {vocab[t] for t in table}
    assert all(weight[vocab[t]].item() == pytest.approx(w) for t, w in table.items())
    shutil.move(static / "idf.json", folder / "idf.json")  # beside router_config.json, as a Hub folder may keep it
    assert torch.equal(BiEncoder(BiEncoderArgs(path=str(folder)).resolve()).static_query.weight, weight)


@needs("hf")
@pytest.mark.parametrize("kind", ["gradcache", "global"])
def test_every_step_kind_equals_the_dense_objective(tmp_path: Path, kind: str) -> None:
    """From the Router folder: every parameter's gradient (the query weights' too) equals the dense objective's."""
    trainer = _step(tmp_path, kind, f"--model.path={_router(tmp_path, {})}")
    weight = dict(trainer.model.named_parameters())["static_query.weight"]
    assert trainer.model_args.inference_free and weight.grad is not None and weight.grad.abs().max() > 0


@needs("hf")
def test_a_masked_lm_made_inference_free_starts_at_ones(tmp_path: Path) -> None:
    """`model.inference_free = true` on a plain masked LM: query weights of 1 (sentence-transformers' start), and
    the steps stay exact; `optimizer.static_query_lr` gives them a group of their own, the full lr first."""
    trainer = _step(tmp_path, "global", "--model.inference_free=true", "--optimizer.static_query_lr=0.01")
    model = trainer.model
    assert model.static_query is not None and model.query_tower is model.doc_tower
    groups, peaks = trainer.optimizer.param_groups, trainer.lr_scheduler.base_lrs  # the schedule's peaks
    assert len(groups) == 3 and peaks[0] == trainer.cfg.optimizer.lr
    (own,) = [i for i, g in enumerate(groups) if any(p is model.static_query.weight for p in g["params"])]
    assert peaks[own] == 0.01 and len(groups[own]["params"]) == 1
    assert groups[own]["lr"] / groups[0]["lr"] == pytest.approx(0.01 / trainer.cfg.optimizer.lr)


@needs("hf")
def test_the_counts(tmp_path: Path) -> None:
    """One weight per vocabulary entry more, and no FLOPs for a query."""
    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs

    folder = str(_router(tmp_path))
    args = BiEncoderArgs(path=folder).resolve()
    plain = BiEncoderArgs(path=folder, inference_free=False).resolve()
    assert args.num_params() == sum(p.numel() for p in BiEncoder(args).parameters())
    assert args.num_params() - plain.num_params() == args.config.vocab_size
    assert args.flops_per_sample() * (args.query_length + args.doc_length) == plain.flops_per_sample() * args.doc_length


@needs("hf")
def test_exports_load_back_as_a_router(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`--to sentence-transformers` writes a Router that embeds both sides as the run does (the exporter checks
    each route), and reads back as inference-free; `--to hf` takes the documents' masked LM, and refuses the
    queries in one line."""
    from titan_contrastive.export import main as export_main
    from titan_contrastive.models.bi_encoder import BiEncoderArgs

    run = folder_run(
        tmp_path, "bert-mlm", SPLADE, f"--model.path={_router(tmp_path)}", "--loss.flops_doc_weight=0.03",
        "--training.local_batch_size=6", "--training.steps=1", "--checkpoint.enable=true",
        "--optimizer.static_query_lr=0.01",
    )  # fmt: skip
    run.train()
    run.metrics.close()
    step = tmp_path / "run-bert-mlm" / "checkpoint" / "step-1"
    st = tmp_path / "st"
    assert export_main([str(step), "--to", "sentence-transformers", "--out", str(st)]) == 0
    routes = json.loads((st / "router_config.json").read_text())["structure"]
    assert [m.split("_", 2)[-1] for m in routes["query"]] == ["SparseStaticEmbedding"]
    args = BiEncoderArgs(path=str(st)).resolve()
    assert (args.inference_free, args.splade_activation, args.query_prompt) == (True, "log1p_relu", "query ")
    assert export_main([str(step), "--to", "hf", "--tower", "doc", "--out", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    assert export_main([str(step), "--to", "hf", "--out", str(tmp_path / "hf-query")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--to hf --tower query: this inference-free run embeds its queries by a weight per token" in line
    assert not (tmp_path / "hf-query").exists()


@needs("hf")
def test_what_it_cannot_take_is_a_one_line_error(tmp_path: Path) -> None:
    from titan_contrastive.config import ConfigError

    router = f"--model.path={_router(tmp_path)}"
    for extra, message in [
        (["--model.pooling=mean"], "model.inference_free=true with model.pooling='mean': its queries are weights"),
        (["--model.flavor=dual"], "model.flavor=dual: inference-free SPLADE embeds its queries by a weight per"),
        (["--model.freeze=query"], r"model.freeze=\['query'\]: inference-free SPLADE embeds its queries by a wei"),
    ]:
        with pytest.raises(ConfigError, match=message):
            folder_run(tmp_path / "bad", "bert-mlm", SPLADE, router, *extra)
    with pytest.raises(ConfigError, match="optimizer.static_query_lr=0.01: the model has no inference-free query"):
        folder_run(
            tmp_path / "plain", "bert-mlm", SPLADE, "--optimizer.static_query_lr=0.01", "--training.local_batch_size=6"
        )


@needs("hf")
def test_global_negatives_on_two_ranks_under_fsdp2(tmp_path: Path) -> None:
    """The masked LM sharded per layer, and the query weights, on 2 gloo processes: the step equals the dense
    objective over the whole batch."""
    from tests.dist_utils import run_distributed
    from tests.test_hf_text import _step_distributed

    architecture_folder(tmp_path, "bert-mlm")
    run_distributed(_step_distributed, 2, str(tmp_path), "bert-mlm", False, SPLADE, "--model.inference_free=true")


def test_the_query_weights_rate_must_agree_on_resume() -> None:
    """The optimizer's parameter groups are built from `static_query_lr`: a change since the checkpoint is
    refused, as `layer_decay`'s is."""
    from titan_contrastive.checkpoint.resume import IncompatibleResume, config_changes

    saved = {"config": {"optimizer": {"static_query_lr": 0.0, "lr": 1e-3}}}
    with pytest.raises(IncompatibleResume, match=r"optimizer.static_query_lr: 0.0 -> 0.001 since checkpoint step-2"):
        config_changes(2, saved, {"optimizer": {"static_query_lr": 1e-3, "lr": 1e-3}}, None)
    assert config_changes(2, saved, {"optimizer": {"static_query_lr": 0.0, "lr": 2e-3}}, None) == [
        "optimizer.lr: 0.001 -> 0.002"
    ]
