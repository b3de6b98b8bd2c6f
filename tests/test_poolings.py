"""sentence-transformers' other Pooling modes in a folder: max, mean_sqrt_len_tokens and weightedmean (SGPT's
position-weighted mean), each followed by a Dense module (tanh: it tells the sum over sqrt(n) from the mean,
which a Normalize alone would not), on an encoder and on a decoder whose tokenizer pads on the left, the prompt in
and left out of the pooling: our embeddings equal `SentenceTransformer(folder).encode` (float32, <= 1e-5);
GradCache equals the dense objective in float64; the export writes the mode back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.hf_folders import decoder_folder, encoder_folder
from tests.needs import needs
from tests.test_hf_text import PAIRS, _step

OURS = {"max": "max", "mean_sqrt_len_tokens": "mean_sqrt_len", "weightedmean": "weighted_mean"}
PROMPTS = {"query": "query ", "document": "represent the passage "}


def pooled_folder(model: Path, mode: str, include_prompt: bool = True) -> Path:
    """`model` as a sentence-transformers folder: Transformer (24 tokens), Pooling `mode`, Dense 16 -> 12 (tanh),
    Normalize, the prompts."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    out = model.parent / f"{model.name}-{mode}-{include_prompt}"
    torch.manual_seed(0)
    modules = [
        Transformer(str(model), max_seq_length=24),
        Pooling(16, pooling_mode=mode, include_prompt=include_prompt),
        Dense(16, 12),
        Normalize(),
    ]
    SentenceTransformer(modules=modules, device="cpu", prompts=PROMPTS).save(str(out))
    return out


@needs("hf")
@pytest.mark.parametrize("include_prompt", [True, False])
@pytest.mark.parametrize("mode", list(OURS))
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_the_folders_pooling_gives_its_embeddings(tmp_path: Path, kind: str, mode: str, include_prompt: bool) -> None:
    from sentence_transformers import SentenceTransformer

    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs, build_tokenizer

    model = (encoder_folder if kind == "encoder" else decoder_folder)(tmp_path, 0.0)
    folder = pooled_folder(model, mode, include_prompt)
    args = BiEncoderArgs(path=str(folder), query_length=24).resolve(doc_length=24)
    assert (args.pooling, args.include_prompt) == (OURS[mode], include_prompt)
    tokenizer, ours = build_tokenizer(args), BiEncoder(args).eval()
    texts = [q for q, _ in PAIRS[:5]]
    with torch.no_grad():
        zq, zd, _ = ours(tokenizer.encode_queries(texts, 24), tokenizer.encode_docs(texts))
    theirs = SentenceTransformer(str(folder), device="cpu")
    for got, name in ((zq, "query"), (zd, "document")):
        assert (got - theirs.encode(texts, prompt_name=name, convert_to_tensor=True)).abs().max() <= 1e-5
    other = "mean"  # the pooling matters: the mean embeds otherwise (through the Dense tanh, mean_sqrt_len too)
    with torch.no_grad():
        zo, _, _ = BiEncoder(BiEncoderArgs(path=str(folder), pooling=other, query_length=24).resolve()).eval()(
            tokenizer.encode_queries(texts, 24), tokenizer.encode_docs(texts)
        )
    assert (zo - zq).abs().max() > 1e-3


@needs("hf")
@pytest.mark.parametrize("pooling", list(OURS.values()))
def test_gradcache_and_global_negatives_stay_exact(tmp_path: Path, pooling: str) -> None:
    for kind in ("gradcache", "global"):
        _step(tmp_path, "decoder", kind, f"--model.pooling={pooling}")


@needs("hf")
def test_the_export_writes_the_mode_back(tmp_path: Path) -> None:
    """A weighted-mean run's sentence-transformers export pools so (the exporter compares the embeddings)."""
    from tests.test_hf_text import folder_run
    from titan_contrastive.export import main as export_main

    run = folder_run(
        tmp_path, "decoder", "--model.pooling=weighted_mean", "--training.local_batch_size=6", "--training.steps=1",
        "--checkpoint.enable=true",
    )  # fmt: skip
    run.train()
    run.metrics.close()
    step = tmp_path / "run-decoder" / "checkpoint" / "step-1"
    assert export_main([str(step), "--to", "sentence-transformers", "--out", str(tmp_path / "st")]) == 0
    assert json.loads((tmp_path / "st" / "1_Pooling" / "config.json").read_text())["pooling_mode"] == "weightedmean"
