"""What `[model] path` holds for the static family, read without building anything:

- a sentence-transformers folder whose first module is a StaticEmbedding (a Normalize may follow it): its table,
  its tokenizer, its prompts;
- a model2vec folder (`model.safetensors` holding `embeddings`, and `tokenizer.json`): its table, folded by
  sentence-transformers' own loader (a vocabulary-quantized model's mapping and per-token weights included);
- any other folder with a fast tokenizer (a transformers or sentence-transformers model's, a `tokenizer.json`
  alone): its tokenizer and prompts, and no table (`[model] static_dim` starts one); "" is the bundled MiniLM's.

Every problem is a `TextFolderError` whose one line names the folder and the fix."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titan_contrastive.models.bi_encoder.folder import (
    TextFolderError,
    bundled_minilm,
    folder_json,
    load_tokenizer,
    local_folder,
    st_prompts,
)

TABLE_KEYS = ("embedding.weight", "embeddings")
"""A StaticEmbedding's weights (sentence-transformers) and a model2vec model's."""


@dataclass(frozen=True)
class StaticFolder:
    root: str
    table_dir: str
    """The folder of the table's `model.safetensors` and `tokenizer.json`; "" where the folder holds no table."""
    tokenizer_dir: str
    """Where the tokenizer is read: `table_dir`, else the folder itself (a transformers tokenizer)."""
    query_prompt: str = ""
    doc_prompt: str = ""


def read_static_folder(path: str) -> StaticFolder:
    """What `path` holds (see the module docstring)."""
    root = bundled_minilm() if not path else local_folder(path)
    modules_file = root / "modules.json"
    if modules_file.is_file():
        modules = folder_json(modules_file)
        kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
        if kinds and kinds[0] == "Transformer":  # a transformer's folder: its tokenizer, for a table to start
            return StaticFolder(str(root), "", str(root / str(modules[0].get("path", ""))), *st_prompts(root))
        if not kinds or kinds[0] != "StaticEmbedding" or any(k != "Normalize" for k in kinds[1:]):
            raise TextFolderError(
                f"{root}/modules.json: modules {kinds}; a static model is a StaticEmbedding (then a Normalize, or "
                "nothing); give its folder, or a folder with a tokenizer and model.static_dim"
            )
        table = root / str(modules[0].get("path", ""))
        if not _holds_table(table):
            raise TextFolderError(f"{table}: its StaticEmbedding has no model.safetensors with {TABLE_KEYS[0]}")
        return StaticFolder(str(root), str(table), str(table), *st_prompts(root))
    if _holds_table(root):  # model2vec's layout
        return StaticFolder(str(root), str(root), str(root))
    return StaticFolder(str(root), "", str(root))


def _holds_table(folder: Path) -> bool:
    """Whether `folder` holds a table sentence-transformers' StaticEmbedding loads: `tokenizer.json` and a
    `model.safetensors` with one of `TABLE_KEYS`."""
    from safetensors import safe_open

    weights = folder / "model.safetensors"
    if not (weights.is_file() and (folder / "tokenizer.json").is_file()):
        return False
    try:
        with safe_open(str(weights), framework="pt") as f:
            return any(key in f.keys() for key in TABLE_KEYS)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a damaged file
        raise TextFolderError(f"{weights}: not a readable safetensors file ({str(e)[:120]}); repair it") from None


def read_tokenizer(folder: StaticFolder, trust: bool = False) -> Any:
    """The `tokenizers.Tokenizer` the texts are read with: the table's `tokenizer.json`, as StaticEmbedding reads
    it, else the folder's fast tokenizer (transformers'; with `trust`, one whose code the folder ships)."""
    if folder.table_dir:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(Path(folder.table_dir) / "tokenizer.json"))
    backend = getattr(load_tokenizer(folder.tokenizer_dir, trust), "backend_tokenizer", None)
    if backend is None:
        raise TextFolderError(
            f"{folder.tokenizer_dir}: its tokenizer is not a fast (Rust) one, which a StaticEmbedding needs; save it "
            "as tokenizer.json (transformers' convert_slow_tokenizer)"
        )
    return backend


def read_table(folder: StaticFolder) -> torch.Tensor:
    """The folder's table [V, d], through sentence-transformers' `StaticEmbedding.load` (which folds a model2vec
    model's mapping and per-token weights)."""
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding

    return StaticEmbedding.load(folder.table_dir, local_files_only=True).embedding.weight.detach().clone()


def table_shape(folder: StaticFolder) -> tuple[int, int]:
    """(rows, width) of the table `read_table` gives, from the safetensors header alone: a model2vec model's token
    mapping, where it has one, sets the rows (a row per token id, as the loader folds it)."""
    from safetensors import safe_open

    with safe_open(str(Path(folder.table_dir) / "model.safetensors"), framework="pt") as f:
        table = f.get_slice(next(key for key in TABLE_KEYS if key in f.keys())).get_shape()
        rows = f.get_slice("mapping").get_shape()[0] if "mapping" in f.keys() else table[0]
    return rows, table[1]


def vocab_size(tokenizer: Any) -> int:
    """The rows of a table over `tokenizer`'s vocabulary, added tokens included (sentence-transformers')."""
    return tokenizer.get_vocab_size()
