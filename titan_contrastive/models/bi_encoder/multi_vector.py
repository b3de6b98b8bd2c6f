"""sentence-transformers' MultiVectorEncoder folders (its ColBERT models, sentence-transformers >= 6.3), read as a
ColBERT model (`read_multi_vector`) and written from a ColBERT run (`write_multi_vector`, `--to sentence-transformers`).

Such a folder is modules.json [Transformer, Dense, MultiVectorMask, Normalize]: the transformer (its
sentence_bert_config.json holds `query_length`, `document_length` and `query_expansion` {strategy, attend, token,
length}), the tokens' projection (a Linear without activation, `linear.weight`), the scoring mask (a skiplist of
document tokens) and the normalization. Its prompts (config_sentence_transformers.json, `query` / `document`) are
prepended to the text, as PyLate's prefixes are, and are the sides' prompts here. Without lengths in the folder, the
defaults are PyLate's (32 and 180), as for a new projection. What the bi_encoder's ColBERT does not compute is
refused in one line: another module order, an activation on the projection, query expansion that lets a long query
through (strategy "min"), a skiplist on queries, an allowlist of token ids (ColPali's image-only documents).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from titan_contrastive.config import ConfigError
from titan_contrastive.models.bi_encoder.colbert import SKIPLIST, ColbertFolder, expansion_id, read_dense

ORDER = ["Transformer", "Dense", "MultiVectorMask", "Normalize"]


def _json(file: Path) -> dict[str, Any]:
    return json.loads(file.read_text()) if file.is_file() else {}


def read_multi_vector(root: Path, modules: list[dict[str, Any]]) -> ColbertFolder:
    """The ColBERT settings of the MultiVectorEncoder folder `root` (its `modules`, from modules.json); ConfigError
    for what it holds and the bi_encoder does not compute (see the module docstring)."""
    order = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
    if order != ORDER:
        raise ConfigError(
            f"{root}/modules.json: a MultiVectorEncoder with modules {order}; {ORDER} is supported (a projection, "
            "then the scoring mask and the normalization, as sentence-transformers builds one)"
        )
    transformer, dense, mask = (root / m.get("path", "") for m in modules[:3])
    config = read_dense(dense, "sentence-transformers")
    masking = _json(mask / "config.json")
    tasks = masking.get("skiplist_tasks") or ["document"]
    if masking.get("keep_only_token_ids") or sorted(tasks) != ["document"]:
        what = (
            f"keep_only_token_ids={masking['keep_only_token_ids']}"
            if masking.get("keep_only_token_ids")
            else f"skiplist_tasks={tasks}"
        )
        raise ConfigError(
            f"{mask}/config.json: {what}; the skiplist is applied to documents only here, every token kept "
            "otherwise (skiplist_tasks=['document'], no keep_only_token_ids)"
        )
    bert = _json(transformer / "sentence_bert_config.json")
    expansion = bert.get("query_expansion") or {}
    if expansion and expansion.get("strategy", "fixed") != "fixed":
        raise ConfigError(
            f"{transformer}/sentence_bert_config.json: query_expansion strategy {expansion.get('strategy')!r} lets a "
            "long query through uncut; strategy 'fixed' (every query padded and cut to one length) is supported"
        )
    query_length = expansion.get("length") or bert.get("query_length") or bert.get("max_seq_length") or 32
    return ColbertFolder(
        str(dense),
        int(config["out_features"]),
        bool(config.get("bias", True)),
        query_prefix="",
        doc_prefix="",
        query_length=int(query_length),
        doc_length=int(bert.get("document_length") or bert.get("max_seq_length") or 180),
        skiplist=tuple(masking.get("skiplist_words") or ()),
        query_expansion=bool(expansion),
        attend_to_expansion=bool(expansion.get("attend", False)),
        expansion_token=expansion.get("token"),
        skip_unknown=False,
    )


def _skiplist_words(tokenizer: Any, late: ColbertFolder | None) -> list[str]:
    """The run's skiplist as MultiVectorMask words: a PyLate word outside the vocabulary skipped the unknown token,
    which sentence-transformers keeps only when the unknown token is listed itself."""
    words = list(late.skiplist if late else SKIPLIST)
    unknown = tokenizer.unk_token
    if (late is None or late.skip_unknown) and unknown is not None and unknown not in words:
        if any(tokenizer.convert_tokens_to_ids(w) == tokenizer.unk_token_id for w in words):
            words.append(unknown)
    return words


def write_multi_vector(tower: nn.Module, head: nn.Linear, args: Any, late: ColbertFolder | None, out: Path) -> None:
    """A MultiVectorEncoder folder in `out`, built and saved by sentence-transformers: the transformer with the run's
    lengths and query expansion, `head` as its Dense, the run's skiplist, Normalize and the run's prompts (`args`:
    the run's `BiEncoderArgs`; `late`: the ColBERT folder it started from, None for a new projection)."""
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.base.modules.dense import Dense
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    tokenizer = args.tokenizer
    expansion = None
    if args.query_expansion:  # the token the run padded queries with, named unless it is the mask token
        given = late.expansion_token if late else None
        pad = tokenizer.convert_tokens_to_ids(given) if given else expansion_id(tokenizer)
        token = None if pad == tokenizer.mask_token_id else tokenizer.convert_ids_to_tokens(pad)
        attend = bool(late and late.attend_to_expansion)
        expansion = {"strategy": "fixed", "attend": attend, "token": token, "length": args.query_length}
    with tempfile.TemporaryDirectory() as hf_dir:
        tower.save_pretrained(hf_dir)
        tokenizer.save_pretrained(hf_dir)
        trust = {"trust_remote_code": args.trust_remote_code}
        transformer = Transformer(
            hf_dir,
            query_length=args.query_length,
            document_length=args.doc_length,
            query_expansion=expansion,
            max_seq_length=args.doc_length,
            model_kwargs=trust,
            config_kwargs=trust,
            processor_kwargs=trust,
        )
        dense = Dense(
            head.in_features,
            head.out_features,
            bias=head.bias is not None,
            activation_function=nn.Identity(),
            init_weight=head.weight.detach().float().clone(),
            init_bias=None if head.bias is None else head.bias.detach().float().clone(),
            module_input_name="token_embeddings",
            module_output_name="token_embeddings",
        )
        modules = [
            transformer,
            dense,
            MultiVectorMask(_skiplist_words(tokenizer, late)),
            Normalize(module_input_name="token_embeddings", module_output_name="token_embeddings"),
        ]
        prompts = {"query": args.query_prompt, "document": args.doc_prompt}
        MultiVectorEncoder(modules=modules, prompts=prompts, device="cpu").save(str(out))
