"""A tiny masked LM (`hf_folders.architecture_folder(root, "bert-mlm")`) as sentence-transformers' sparse folders:
a SparseEncoder (SPLADE) and a Router of inference-free SPLADE."""

from __future__ import annotations

from pathlib import Path


def sparse_folder(model: Path, prompts: dict[str, str], strategy: str = "max", activation: str = "relu") -> Path:
    """`model` (a masked LM) as a sentence-transformers SparseEncoder folder: Transformer (fill-mask, 24 tokens),
    SpladePooling (`strategy`, `activation`), the prompts."""
    from sentence_transformers.sentence_transformer.modules import Transformer
    from sentence_transformers.sparse_encoder import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    out = model.parent / f"{model.name}-sparse-{strategy}-{activation}"
    encoder = Transformer(str(model), max_seq_length=24, transformer_task="fill-mask")
    pooling = SpladePooling(strategy, activation)
    SparseEncoder(modules=[encoder, pooling], device="cpu", prompts=prompts).save(str(out))
    return out


def router_folder(model: Path, prompts: dict[str, str]) -> Path:
    """`model` (a masked LM) as inference-free SPLADE, a sentence-transformers Router: queries by a
    SparseStaticEmbedding (weights drawn in [0.5, 1.5), one per vocabulary entry), documents by a Transformer
    (fill-mask, 24 tokens) then SpladePooling (max, log1p_relu, OpenSearch's); the prompts."""
    import torch
    from sentence_transformers.base.modules import Router
    from sentence_transformers.sentence_transformer.modules import Transformer
    from sentence_transformers.sparse_encoder import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding, SpladePooling

    out = model.parent / f"{model.name}-router"
    doc = Transformer(str(model), max_seq_length=24, transformer_task="fill-mask")
    vocab = doc.auto_model.config.vocab_size
    weight = 0.5 + torch.rand(vocab, generator=torch.Generator().manual_seed(3))
    query = SparseStaticEmbedding(tokenizer=doc.tokenizer, weight=weight, frozen=False)
    routes = Router.for_query_document(
        query_modules=[query], document_modules=[doc, SpladePooling("max", "log1p_relu")]
    )
    SparseEncoder(modules=[routes], device="cpu", prompts=prompts).save(str(out))
    return out
