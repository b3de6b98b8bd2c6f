"""A run of two towers (`model.flavor = "dual"`) exported without `--tower`: one sentence-transformers folder whose
Router embeds queries by the query tower and documents by the doc tower (bi_encoder: a tiny BERT folder with Dense
layers, prompts, and a SPLADE masked LM; static: two tables). Each export's `encode_query` / `encode_document` equals
the run's own model's query / doc side within 1e-5, computed here from the step folder, not through the export; the
towers are moved apart first, so a Router sending both sides one way fails. `--tower` still writes one tower."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.needs import needs
from tests.test_mine import bi_encoder_step

pytestmark = needs("hf")

TEXTS = ["the capital of France", "a tower in Paris", "zebra stripes at noon"]


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
        folder = architecture_folder(tmp_path, "bert-dense")
        step = bi_encoder_step(tmp_path, False, folder, 12, query_length=16, query_prompt="query: ", doc_prompt="doc: ")
    else:
        step = bi_encoder_step(
            tmp_path, False, architecture_folder(tmp_path, "bert-mlm"), 12, query_length=16, pooling="splade"
        )
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
