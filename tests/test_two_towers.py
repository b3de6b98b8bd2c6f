"""A run of two towers (`model.flavor = "dual"`) exported without `--tower`: one sentence-transformers folder whose
Router embeds queries by the query tower and documents by the doc tower (bi_encoder: a tiny BERT folder with Dense
layers, prompts, and a SPLADE masked LM; static: two tables). Each export's `encode_query` / `encode_document` equals
the run's own model's query / doc side within 1e-5, computed here from the step folder, not through the export; the
towers are moved apart first, so a Router sending both sides one way fails. `--tower` still writes one tower."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tests.needs import needs

pytestmark = needs("hf")

TEXTS = ["the capital of France", "a tower in Paris", "zebra stripes at noon"]


def dual_step(root: Path, folder: Path, **fields: object) -> Path:
    """step-1 of a run of two towers started from `folder` (`fields`: BiEncoderArgs'), the doc tower moved off the
    query tower's weights, written as training writes it."""
    from titan_contrastive.checkpoint import CheckpointManager, ModelState
    from titan_contrastive.config.job_config import Checkpoint
    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs

    torch.manual_seed(0)
    args = BiEncoderArgs(path=str(folder), shared=False, query_length=16, **fields).resolve(doc_length=12)
    model = BiEncoder(args)
    with torch.no_grad():
        for param in model.doc_tower.parameters():
            param.add_(0.05 * torch.randn_like(param))
    CheckpointManager(
        Checkpoint(enable=True, folder="checkpoint", interval=1, keep_latest_k=0),
        dump_folder=str(root / "run"),
        states={"model": ModelState(model)},
        per_rank_states={},
        rank=0,
        dp_rank=0,
        dp_degree=1,
        model_info={"family": "bi_encoder", "args": dataclasses.asdict(args)},
    ).save(1)
    return root / "run" / "checkpoint" / "step-1"


def modules(out: Path) -> list[str]:
    return [m["type"].rsplit(".", 1)[-1] for m in json.loads((out / "modules.json").read_text())]


@pytest.mark.parametrize("kind", ["dense", "splade"])
def test_a_bi_encoder_of_two_towers_exports_as_a_router(tmp_path: Path, kind: str) -> None:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sparse_encoder import SparseEncoder

    from tests.hf_folders import architecture_folder
    from titan_contrastive.export import main as export_main
    from titan_contrastive.models.bi_encoder import build_tokenizer
    from titan_contrastive.models.weights import read_ours

    if kind == "dense":  # a sentence-transformers folder with Dense layers: each tower keeps its own head
        step = dual_step(
            tmp_path, architecture_folder(tmp_path, "bert-dense"), query_prompt="query: ", doc_prompt="doc: "
        )
    else:
        step = dual_step(tmp_path, architecture_folder(tmp_path, "bert-mlm"), pooling="splade")
    out = tmp_path / "router"
    assert export_main([str(step), "--to", "sentence-transformers", "--out", str(out)]) == 0
    assert modules(out)[0] == "Router"
    library = SparseEncoder if kind == "splade" else SentenceTransformer
    theirs = library(str(out), device="cpu")
    _, args, model = read_ours(step)
    tokenizer = build_tokenizer(args)
    with torch.no_grad():
        query = model.eval().embed_side("query", tokenizer.encode_queries(TEXTS, args.query_length))
        doc = model.embed_side("doc", tokenizer.encode_docs(TEXTS))
    sparse = {"convert_to_sparse_tensor": False} if kind == "splade" else {}
    got_query = theirs.encode_query(TEXTS, convert_to_tensor=True, **sparse)
    got_doc = theirs.encode_document(TEXTS, convert_to_tensor=True, **sparse)
    assert (got_query - query).abs().max() <= 1e-5 * query.abs().max()
    assert (got_doc - doc).abs().max() <= 1e-5 * doc.abs().max()
    assert (query - doc).abs().max() > 1e-2 * doc.abs().max()  # the towers embed apart

    one = tmp_path / "doc-tower"
    assert export_main([str(step), "--to", "sentence-transformers", "--tower", "doc", "--out", str(one)]) == 0
    assert modules(one)[0] == "Transformer"


def test_a_static_run_of_two_tables_exports_as_a_router(tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    from tests.test_static import static_run
    from titan_contrastive.export import main as export_main
    from titan_contrastive.models.static import build_tokenizer
    from titan_contrastive.models.weights import read_ours

    run = static_run(
        tmp_path, "--model.flavor=dual", "--model.query_prompt=query ", "--training.local_batch_size=6",
        "--training.steps=1", "--checkpoint.enable=true", "--optimizer.lr=0.1",
    )  # fmt: skip
    run.train()
    run.metrics.close()
    step = tmp_path / "run" / "checkpoint" / "step-1"
    out = tmp_path / "router"
    assert export_main([str(step), "--to", "sentence-transformers", "--out", str(out)]) == 0
    assert modules(out) == ["Router", "Normalize"]
    theirs = SentenceTransformer(str(out), device="cpu")
    _, args, model = read_ours(step)
    tokenizer = build_tokenizer(args)
    with torch.no_grad():
        query = model.eval().embed_side("query", tokenizer.encode_queries(TEXTS, args.query_length)).float()
        doc = model.embed_side("doc", tokenizer.encode_docs(TEXTS)).float()
    assert (theirs.encode_query(TEXTS, convert_to_tensor=True) - query).abs().max() <= 1e-5
    assert (theirs.encode_document(TEXTS, convert_to_tensor=True) - doc).abs().max() <= 1e-5
    assert (query - doc).abs().max() > 1e-3  # the tables trained apart
