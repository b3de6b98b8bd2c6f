"""The static family's args: `[model]`'s path, prompts and `static_dim` resolved against the folder
(`folder.read_static_folder`), the lengths from the data, and the exact counts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_contrastive.models.bi_encoder.args import BiEncoderArgs, text_guide
from titan_contrastive.models.bi_encoder.folder import TextFolderError
from titan_contrastive.models.pretrained_scale import scale_fields
from titan_contrastive.models.static.folder import read_static_folder, read_tokenizer, table_shape, vocab_size

DEFAULT_DOC_LENGTH = 256
"""A document's tokens when `[data] doc_context_length` is 0 (a StaticEmbedding reads any length; the batches hold
a fixed one)."""


@dataclass(frozen=True)
class StaticArgs:
    path: str = ""
    """`[model] path` (`folder.py`): a StaticEmbedding or model2vec folder, or a tokenizer's; "" = MiniLM's."""
    shared: bool = True
    """One table for queries and documents (sentence-transformers'), or two copies of it."""
    static_dim: int = 0
    """`[model] static_dim`: a table this wide started at random over the tokenizer's vocabulary; 0 = the folder's."""
    vocab: int = 0
    """Rows of the table (the tokenizer's vocabulary); set from the folder."""
    dim: int = 0
    """Width of the table; set from the folder or `static_dim`."""
    query_prompt: str = "auto"
    """Prepended to every query; `auto` = the sentence-transformers folder's `query` prompt, else none."""
    doc_prompt: str = "auto"
    """Prepended to every document; `auto` = the folder's `document` (or `passage`) prompt, else none."""
    query_length: int = 32
    """Query tokens (the prompt's included; no special tokens: a StaticEmbedding adds none); data.context_length."""
    doc_length: int = DEFAULT_DOC_LENGTH
    """Document tokens: `[data] doc_context_length`, else `DEFAULT_DOC_LENGTH`."""
    init_scale: float = 20.0
    """t at the start (MultipleNegativesRankingLoss's scale); `[loss] init_logit_scale` = log t."""
    learn_logit_scale: bool = True
    init_logit_bias: float | None = None
    """b at the start, for an objective with a bias (the sigmoid loss); None: no bias."""
    learn_logit_bias: bool = True
    trust_remote_code: bool = False
    """`[model] trust_remote_code`: run the code a folder ships (config.json `auto_map`) for the tokenizer's folder
    and a guide's or teacher's; otherwise such a folder is refused."""

    def update_from_config(self, cfg: Any) -> StaticArgs:
        """A copy with `[model]`'s path, prompts, `static_dim` and `trust_remote_code` resolved against the folder,
        `[data] doc_context_length`, and `[loss] init_logit_scale` (default: log 20) and `learn_logit_scale`; a
        TextFolderError (one line, the fix) for a folder without a table and no `static_dim`."""
        m = cfg.model
        path = m.path or self.path
        folder = read_static_folder(path)
        if not (folder.table_dir or m.static_dim):
            raise TextFolderError(
                f"model.path={path!r}: {folder.root} holds a tokenizer and no table of token vectors (a "
                "sentence-transformers StaticEmbedding or model2vec folder); set model.static_dim (e.g. 1024) to start "
                "one at random over its vocabulary, or point model.path at such a folder"
            )
        trust = m.trust_remote_code
        shape = (vocab_size(read_tokenizer(folder, trust)), m.static_dim) if m.static_dim else table_shape(folder)
        return dataclasses.replace(
            self,
            path=path,
            static_dim=m.static_dim,
            vocab=shape[0],
            dim=shape[1],
            query_prompt=folder.query_prompt if m.query_prompt == "auto" else m.query_prompt,
            doc_prompt=folder.doc_prompt if m.doc_prompt == "auto" else m.doc_prompt,
            doc_length=cfg.data.doc_context_length or DEFAULT_DOC_LENGTH,
            **scale_fields(cfg, self.init_scale),
            trust_remote_code=trust,
        )

    def update_from_data(
        self, *, image_shape: Any = None, vocab_size: int = 0, context_length: int = 32, eos_id: int = 0
    ) -> StaticArgs:
        """The query length comes from data.context_length; the vocabulary and width from the folder."""
        return dataclasses.replace(self, query_length=context_length)

    def as_guide(self, path: str) -> BiEncoderArgs:
        """The frozen guide or teacher (`[loss] guide_model` / `teacher_model`) from the embedder's folder `path`: a
        bi_encoder that reads this model's token ids as text (`bi_encoder.args.text_guide`)."""
        folder = read_static_folder(self.path)
        tokens_from = str(Path(folder.table_dir) / "tokenizer.json") if folder.table_dir else folder.tokenizer_dir
        return text_guide(path, tokens_from, self.trust_remote_code)

    def num_params(self) -> int:
        """Exact: the table (two with `shared` false), logit_scale (and logit_bias)."""
        return self.vocab * self.dim * (1 if self.shared else 2) + 1 + (self.init_logit_bias is not None)

    def flops_per_sample(self) -> int:
        """0: a lookup and a mean, no matrix products to count (no MFU is logged)."""
        return 0


static_flavors = {"shared": StaticArgs(shared=True), "dual": StaticArgs(shared=False)}
