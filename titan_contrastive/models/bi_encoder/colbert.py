"""ColBERT's multi-vector embedding (`[model] pooling = "colbert"`), as PyLate computes it, and PyLate's folders.

Every token's last hidden state is projected to `colbert_dim` (PyLate's Dense: a Linear, no activation) and
L2-normalized. A query is padded to the query length with the tokenizer's mask token (PyLate's query expansion:
the padding is not attended to, unless the folder says `attend_to_expansion_tokens`, and every position is scored);
without expansion its padding is left out. A document's padding and its skiplist tokens (punctuation) are left
out. The embedding of a text is its L tokens end to end, [L * colbert_dim], a token left out being the zero
vector: what late interaction reads (`losses/late_interaction.py`). PyLate inserts its `[Q] ` / `[D] ` prefix
token after the first token; here the prefix is the start of the side's prompt, which tokenizes to the same ids.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titan_contrastive.batching import right_trimmed
from titan_contrastive.config import ConfigError
from titan_contrastive.config.evaluation import EVAL_SETS

DEFAULT_DIM = 128  # PyLate's embedding_size when it adds the projection
SKIPLIST = tuple(string.punctuation)  # PyLate's skiplist_words: left out of documents


@dataclass(frozen=True)
class ColbertFolder:
    """What a ColBERT folder says: PyLate's (config_sentence_transformers.json, its Dense module), or
    sentence-transformers' MultiVectorEncoder (`multi_vector.py`)."""

    dense: str
    """The Dense module's folder (config.json; model.safetensors with `linear.weight`)."""
    dim: int
    bias: bool
    query_prefix: str = "[Q] "
    doc_prefix: str = "[D] "
    query_length: int = 32
    doc_length: int = 180
    skiplist: tuple[str, ...] = SKIPLIST
    query_expansion: bool = True
    attend_to_expansion: bool = False
    expansion_token: str | None = None
    """The token that pads a query; None: the mask token (else the end-of-sequence token)."""
    skip_unknown: bool = True
    """A skiplist word outside the vocabulary skips the unknown token (PyLate); False: the word is dropped
    (sentence-transformers' MultiVectorMask)."""


def read_dense(dense: Path, library: str) -> dict[str, Any]:
    """The config.json of a ColBERT folder's token projection `dense` (saved by `library`); ConfigError for what the
    folder can hold and this cannot (a residual or an activation on the projection, no safetensors)."""
    config = json.loads((dense / "config.json").read_text()) if (dense / "config.json").is_file() else {}
    activation = config.get("activation_function") or "torch.nn.modules.linear.Identity"
    if config.get("use_residual") or activation != "torch.nn.modules.linear.Identity":
        raise ConfigError(
            f"{dense}: a Dense with {'use_residual' if config.get('use_residual') else activation} projects the "
            "tokens; a Linear without activation is supported (or export the transformer alone for a new one)"
        )
    if not (dense / "model.safetensors").is_file():
        raise ConfigError(
            f"{dense}: no model.safetensors (a pytorch_model.bin is never unpickled here); load the model with "
            f"{library} and save it again, which writes safetensors"
        )
    return config


def read_pylate(root: Path, dense: Path) -> ColbertFolder:
    """The settings of the PyLate folder `root` whose Dense module is `dense`; ConfigError for what PyLate can hold
    and this cannot (`read_dense`)."""
    config = read_dense(dense, "PyLate")
    file = root / "config_sentence_transformers.json"
    st = json.loads(file.read_text()) if file.is_file() else {}
    given = {
        "query_prefix": st.get("query_prefix"),
        "doc_prefix": st.get("document_prefix"),
        "query_length": st.get("query_length"),
        "doc_length": st.get("document_length"),
        "skiplist": tuple(st["skiplist_words"]) if st.get("skiplist_words") is not None else None,
        "query_expansion": st.get("do_query_expansion"),
        "attend_to_expansion": st.get("attend_to_expansion_tokens"),
    }
    settings = {key: value for key, value in given.items() if value is not None}
    return ColbertFolder(str(dense), int(config["out_features"]), bool(config.get("bias", True)), **settings)


def projection(width: int, dim: int, folder: ColbertFolder | None) -> nn.Linear:
    """PyLate's Dense as a Linear from `width` to `dim`: the folder's weights, else new ones (torch's default init,
    no bias, as PyLate adds it)."""
    if folder is None:
        return nn.Linear(width, dim, bias=False)
    from safetensors.torch import load_file

    linear = nn.Linear(width, folder.dim, bias=folder.bias)
    weights = load_file(str(Path(folder.dense) / "model.safetensors"))
    try:
        linear.load_state_dict({k.removeprefix("linear."): v for k, v in weights.items() if k.startswith("linear.")})
    except RuntimeError as e:
        raise ConfigError(f"{folder.dense}: its weights do not fit its config.json ({str(e)[:160]})") from None
    return linear


@dataclass(frozen=True)
class Side:
    """How one side's tokens are embedded: at least `length` tokens out (the side's padded length: a chunk of
    trimmed ids is padded back to it; expanded queries, never trimmed, are as long as their ids); `expansion`: the
    id that pads a query (PyLate's query expansion), None to leave padding out; `attend_all`: the expansion attended
    to; `skip`: ids left out."""

    length: int
    expansion: int | None = None
    attend_all: bool = False
    skip: tuple[int, ...] = ()


def expansion_id(tokenizer: Any) -> int:
    """The id PyLate pads a query with: the mask token, else the end-of-sequence token; ConfigError without either."""
    for token_id in (tokenizer.mask_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    raise ConfigError(
        "model.query_expansion=true: the tokenizer has no mask token nor end-of-sequence token to pad queries with; "
        "set model.query_expansion=false"
    )


def skip_ids(tokenizer: Any, words: tuple[str, ...], unknown: bool = True) -> tuple[int, ...]:
    """The ids of the skiplist words, as PyLate converts them (a word outside the vocabulary: the unknown token's);
    `unknown=False`: such a word dropped, as sentence-transformers' MultiVectorMask does."""
    ids = [tokenizer.convert_tokens_to_ids(word) for word in words]
    if not unknown:
        unk = tokenizer.unk_token_id
        ids = [i for i, word in zip(ids, words) if unk is None or i != unk or word == tokenizer.unk_token]
    return tuple(sorted({int(i) for i in ids if i is not None}))


def colbert_embed(tower: nn.Module, ids: Tensor, pad: int, head: nn.Module, side: Side) -> Tensor:
    """[B, side.length * dim]: the tokens of right-padded `ids` through `tower` and the projection `head`,
    normalized, those left out zero (see the module docstring)."""
    if side.expansion is not None:
        real = ids != pad
        inputs, attention, kept = ids.masked_fill(~real, side.expansion), real, torch.ones_like(real)
        if side.attend_all:
            attention = kept
    else:
        inputs = right_trimmed(ids, pad)
        attention = inputs != pad
        inputs = inputs.masked_fill(~attention, 0)
        kept = attention
        if side.skip:
            kept = kept & ~torch.isin(inputs, torch.tensor(side.skip, device=ids.device))
    hidden = tower(input_ids=inputs, attention_mask=attention.long()).last_hidden_state
    vectors = F.normalize(head(hidden), dim=-1) * kept[..., None]
    return F.pad(vectors, (0, 0, 0, max(0, side.length - vectors.shape[1]))).flatten(1)


def colbert_settings(folder: Any, dim: int, expansion: bool | None) -> tuple[int, bool]:
    """(token width, query expansion) of a ColBERT model on `folder` (a `folder.TextFolder`): the given ones, else
    the PyLate folder's, else 128 and True; ConfigError for a width the folder's projection does not have, or a
    folder whose Dense modules follow a pooling."""
    late = folder.colbert
    if folder.dense:
        raise ConfigError(
            f"model.pooling='colbert' with {folder.model_dir}: its Dense modules project a pooled embedding, not the "
            "tokens; export the transformer alone, or use a PyLate folder"
        )
    if late is not None and dim and dim != late.dim:
        raise ConfigError(
            f"model.colbert_dim={dim}: the PyLate folder projects tokens to {late.dim}; remove the setting (or start "
            "from the transformer alone, for a new projection)"
        )
    default_expansion = True if late is None else late.query_expansion
    return dim or (DEFAULT_DIM if late is None else late.dim), default_expansion if expansion is None else expansion


def refuse_for_colbert(cfg: Any) -> None:
    """The settings that read one vector per text, which ColBERT's token sets are not, and locked towers (a locked
    tower runs without a graph, its projection too): a one-line ConfigError. A guide stays: its masks read its own
    vectors (`losses/late_interaction.py`)."""
    if cfg.model.freeze:
        raise ConfigError(
            f"model.freeze={cfg.model.freeze}: a locked tower runs without a graph, and ColBERT's projection follows "
            "it; train the towers whole or with LoRA (model.freeze=[])"
        )
    loss = cfg.loss
    for key, value in (
        ("loss.gor_weight", loss.gor_weight),
        ("loss.gor_mean_weight", loss.gor_mean_weight),
        ("loss.flops_query_weight", loss.flops_query_weight),
        ("loss.flops_doc_weight", loss.flops_doc_weight),
        ("loss.teacher_model", loss.teacher_model),
        ("loss.teacher_embeddings", loss.teacher_embeddings),
        *((f"eval.{s.name}_path", getattr(cfg.eval, f"{s.name}_path")) for s in EVAL_SETS if s.one_vector),
    ):
        if value:
            raise ConfigError(
                f"{key}={value}: model.pooling='colbert' embeds a text as its tokens, scored by late interaction, and "
                "this reads one vector per text; remove it"
            )


def colbert_sides(args: Any, folder: Any) -> tuple[Side, Side]:
    """How the query and document sides of a ColBERT model (`BiEncoderArgs`, its `folder.TextFolder`) are embedded."""
    late, tokenizer = folder.colbert, args.tokenizer
    token = late.expansion_token if late else None
    expansion = (
        (tokenizer.convert_tokens_to_ids(token) if token else expansion_id(tokenizer)) if args.query_expansion else None
    )
    query = Side(args.query_length, expansion, bool(late and late.attend_to_expansion))
    skip = skip_ids(tokenizer, late.skiplist, late.skip_unknown) if late else skip_ids(tokenizer, SKIPLIST)
    return query, Side(args.doc_length, skip=skip)


def prefix_of(prompt: str, tokenizer: Any, side: str) -> str:
    """The PyLate prefix a side's prompt is written as: the prompt itself, one token of the vocabulary (or "");
    ConfigError for a prompt PyLate could not insert as one token."""
    if prompt and prompt not in tokenizer.get_vocab():
        raise ConfigError(
            f"--to pylate: the {side} prompt {prompt!r} is not one token of the tokenizer, and PyLate inserts its "
            "prefix as one token; train with a prefix token as the prompt (a PyLate folder's [Q] / [D]) or none"
        )
    return prompt


def write_pylate(tower: nn.Module, head: nn.Linear, args: Any, late: ColbertFolder | None, out: Path) -> None:
    """A PyLate ColBERT folder in `out` (as PyLate saves one): the transformer and its tokenizer at the root, the
    projection as `1_Dense` (pylate.models.Dense.Dense), the ColBERT settings in config_sentence_transformers.json
    (`args`: the run's `BiEncoderArgs`; the skiplist and `attend_to_expansion_tokens` of the PyLate folder it
    started from, `late`, else PyLate's defaults)."""
    from safetensors.torch import save_file

    tokenizer = args.tokenizer
    tower.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    (out / "1_Dense").mkdir()
    weights = {"linear.weight": head.weight.detach().float().contiguous()}
    if head.bias is not None:
        weights["linear.bias"] = head.bias.detach().float().contiguous()
    save_file(weights, str(out / "1_Dense" / "model.safetensors"))
    dense = {"in_features": head.in_features, "out_features": head.out_features, "bias": head.bias is not None}
    files = {
        "1_Dense/config.json": {
            **dense,
            "activation_function": "torch.nn.modules.linear.Identity",
            "use_residual": False,
        },
        "modules.json": [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"},
        ],
        "sentence_bert_config.json": {"max_seq_length": args.doc_length - 1, "do_lower_case": False},
        "config_sentence_transformers.json": {
            "model_type": "ColBERT",
            "prompts": {},
            "default_prompt_name": None,
            "similarity_fn_name": "MaxSim",
            "query_prefix": prefix_of(args.query_prompt, tokenizer, "query"),
            "document_prefix": prefix_of(args.doc_prompt, tokenizer, "document"),
            "query_length": args.query_length,
            "document_length": args.doc_length,
            "attend_to_expansion_tokens": bool(late and late.attend_to_expansion),
            "skiplist_words": list(late.skiplist if late else SKIPLIST),
            "do_query_expansion": bool(args.query_expansion),
        },
    }
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2))
