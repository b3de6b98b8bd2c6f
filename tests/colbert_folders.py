"""Tiny ColBERT folders built at test time: a BERT-like encoder whose tokenizer holds a mask token, two punctuation
marks and PyLate's prefix tokens (added, the embedding table resized, as PyLate does), and that encoder as a PyLate
folder (modules.json: Transformer, pylate.models.Dense.Dense; config_sentence_transformers.json with PyLate's keys),
written from PyLate's save format (PyLate itself pins an older sentence-transformers than the one installed); and
that encoder as a sentence-transformers MultiVectorEncoder, built and saved by sentence-transformers."""

from __future__ import annotations

import json
from pathlib import Path

from tests.hf_folders import _saved, _tokenizer

PREFIXES = ("[Q] ", "[D] ")


def colbert_encoder(root: Path, dropout: float = 0.1) -> Path:
    """A 2-layer, 16-wide BERT: [CLS] text [SEP], [PAD] on the right, [MASK], "." and ",", the prefix tokens."""
    import torch
    import transformers

    tokenizer = _tokenizer(
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ","], "[CLS] $A [SEP]", "[PAD]", None, "right"
    )
    tokenizer.mask_token = "[MASK]"
    tokenizer.add_tokens(list(PREFIXES))
    drop = dict(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    shape = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    config = transformers.BertConfig(vocab_size=len(tokenizer), max_position_embeddings=64, **shape, **drop)
    torch.manual_seed(0)
    return _saved(root / "tiny-colbert-bert", transformers.BertModel(config), tokenizer)


def pylate_folder(model: Path, dim: int = 8, **settings) -> Path:
    """`model` with a Dense projection to `dim` (random weights, no bias) as a PyLate ColBERT folder; `settings`
    override PyLate's keys in config_sentence_transformers.json (query_length 12, document_length 10 here)."""
    import shutil

    import torch
    from safetensors.torch import save_file

    out = model.parent / f"{model.name}-pylate-{dim}"
    shutil.copytree(model, out)
    dense = out / "1_Dense"
    dense.mkdir()
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    torch.manual_seed(1)
    save_file({"linear.weight": torch.randn(dim, hidden) / hidden**0.5}, str(dense / "model.safetensors"))
    linear = {"in_features": hidden, "out_features": dim, "bias": False, "use_residual": False}
    (dense / "config.json").write_text(
        json.dumps({**linear, "activation_function": "torch.nn.modules.linear.Identity"})
    )
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"},
    ]
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 9, "do_lower_case": False}))
    config = {
        "prompts": {},
        "default_prompt_name": None,
        "similarity_fn_name": "MaxSim",
        "query_prefix": PREFIXES[0],
        "document_prefix": PREFIXES[1],
        "query_length": 12,
        "document_length": 10,
        "attend_to_expansion_tokens": False,
        "skiplist_words": [".", ",", "!"],
        "do_query_expansion": True,
        **settings,
    }
    (out / "config_sentence_transformers.json").write_text(json.dumps(config))
    return out


def multi_vector_folder(model: Path, dim: int = 8, *, expansion: dict | None = None, **settings) -> Path:
    """`model` as a sentence-transformers MultiVectorEncoder built and saved by sentence-transformers: a Dense
    projection to `dim` (random weights, no bias), the scoring mask, Normalize; query length 12, document length 10,
    `expansion` its query_expansion (None: none), `settings` its prompts, skiplist_words, keep_only_token_ids,
    skiplist_tasks, dense_activation, or modules (the module list's order, by name)."""
    import hashlib

    import torch
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.base.modules.dense import Dense
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    name = "-".join(f"{k}{v}" for k, v in sorted({**settings, "expansion": expansion}.items()) if v is not None)
    out = model.parent / f"{model.name}-mve-{dim}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    transformer = Transformer(str(model), query_length=12, document_length=10, query_expansion=expansion)
    torch.manual_seed(1)
    hidden = transformer.get_embedding_dimension()
    activation = settings.pop("dense_activation", torch.nn.Identity())
    dense = Dense(
        hidden, dim, bias=False, activation_function=activation,
        module_input_name="token_embeddings", module_output_name="token_embeddings",
    )  # fmt: skip
    mask = MultiVectorMask(
        settings.pop("skiplist_words", [".", ","]),
        skiplist_tasks=settings.pop("skiplist_tasks", None),
        keep_only_token_ids=settings.pop("keep_only_token_ids", None),
    )
    normalize = Normalize(module_input_name="token_embeddings", module_output_name="token_embeddings")
    named = {"transformer": transformer, "dense": dense, "mask": mask, "normalize": normalize}
    modules = [named[k] for k in settings.pop("modules", ["transformer", "dense", "mask", "normalize"])]
    MultiVectorEncoder(modules=modules, device="cpu", **settings).save(str(out))
    return out
