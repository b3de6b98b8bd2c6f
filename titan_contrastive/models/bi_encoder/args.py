"""The bi_encoder family's args: `[model]`'s settings resolved against the model folder (`resolve`: pooling,
prompts, lengths, SPLADE's and ColBERT's settings), sized by the data, and the settings a pooling cannot take
refused in one line."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from titan_contrastive.components.lora import LoraFields, add_lora, default_targets
from titan_contrastive.models.bi_encoder.colbert import colbert_settings, refuse_for_colbert
from titan_contrastive.models.bi_encoder.folder import (
    POOLINGS,
    TextFolderError,
    is_causal,
    layer_blocks,
    load_config,
    load_tokenizer,
    pad_id,
    read_text_folder,
)
from titan_contrastive.models.bi_encoder.tower import text_model_class
from titan_contrastive.models.pretrained_scale import scale_fields

DEFAULT_DOC_LENGTH = 512  # a folder's documents when neither it nor the config says
MINILM_DOC_LENGTH = 16  # the bundled MiniLM's: a WordNet lemma fits


@dataclass(frozen=True)
class BiEncoderArgs(LoraFields):
    path: str = ""
    """`[model] path`: the model folder ("" = the bundled all-MiniLM-L6-v2)."""
    shared: bool = True
    """One tower for queries and documents (True) or two copies of the pretrained weights."""
    pooling: str = "auto"
    """cls / mean / last_token; `auto` = the folder's (sentence-transformers), else mean (encoder) or
    last_token (decoder)."""
    query_prompt: str = "auto"
    """Prepended to every query; `auto` = the sentence-transformers folder's `query` prompt, else none."""
    doc_prompt: str = "auto"
    """Prepended to every document; `auto` = the folder's `document` (or `passage`) prompt, else none."""
    query_length: int = 32
    """Query tokens (special tokens and prompt included); set from data.context_length."""
    doc_length: int = 0
    """Document tokens; `[data] doc_context_length`, else the folder's max_seq_length (at most 512 and
    its tokenizer's model_max_length), else (the bundled MiniLM) 16, which a WordNet lemma fits; 0
    until `resolve`."""
    init_scale: float = 20.0
    """t at the start (sentence-transformers' MultipleNegativesRankingLoss scale); `[loss] init_logit_scale` = log t."""
    learn_logit_scale: bool = True
    init_logit_bias: float | None = None
    """b at the start, for an objective with a bias (the sigmoid loss); None: no bias."""
    learn_logit_bias: bool = True
    include_prompt: bool | None = None
    """`[model] include_prompt`, else (None until resolved) the folder's sentence-transformers Pooling
    `include_prompt`: False pools without the prompt's tokens (INSTRUCTOR), as sentence-transformers does
    (`folder.prompt_tokens`)."""
    bidirectional: bool | None = None
    """`[model] bidirectional`, else (None until resolved) the folder's: whether each token attends to the whole
    text. True on a decoder turns its causal mask off (`load_text_tower`); False on a folder that attends both
    ways is refused."""
    inference_free: bool | None = None
    """`[model] inference_free`, else (None until resolved) whether the folder's query route is a
    SparseStaticEmbedding: SPLADE's queries as a learned weight per token they hold (`static_query.py`)."""
    splade_pooling: str = ""
    """`[model] splade_pooling`, else the SparseEncoder folder's, else max (sum: SPLADE v1); "" unless SPLADE."""
    splade_activation: str = ""
    """`[model] splade_activation`, else the folder's, else relu (log1p_relu: one more log); "" unless SPLADE."""
    colbert_dim: int = 0
    """`[model] colbert_dim`, else the PyLate folder's, else 128: a token's width (`colbert.py`); 0 unless ColBERT."""
    query_expansion: bool | None = None
    """`[model] query_expansion`, else the PyLate folder's, else True; None unless ColBERT."""
    attn_implementation: str = ""
    """`[model] attn_implementation`: transformers' attention kernel for the towers ("" = its default)."""
    trust_remote_code: bool = False
    """`[model] trust_remote_code`: run the code a folder ships (config.json `auto_map`) for its model, its
    tokenizer, and a guide's or teacher's folder; otherwise such a folder is refused."""
    exits: tuple[int, ...] = ()
    """`[loss] adaptive_layers`: the earlier layers whose pooled hidden states the model also embeds with in
    training, after the last layer's (`embedding.embed`, `losses/layers.py`); () for none."""
    exit_norm: bool = False
    """`[loss] adaptive_final_norm`: the exits' hidden states through the tower's final norm (a decoder's)."""
    retokenize_from: str = ""
    """A guide's (`as_guide`, `text_guide`) with another vocabulary: the folder (or bare `tokenizer.json`) of the
    tokenizer whose ids it reads as text (`retokenize.py`); empty: it embeds them as they are."""

    def update_from_config(self, cfg: Any) -> BiEncoderArgs:
        """A copy with `[model]`'s path, pooling and prompts and `[data] doc_context_length` resolved
        against the folder (`resolve`), and `[loss] init_logit_scale` (default: log 20; SPLADE's, 0) and
        `learn_logit_scale`."""
        m = cfg.model
        given = dataclasses.replace(
            self,
            trust_remote_code=m.trust_remote_code,
            include_prompt=m.include_prompt,
            bidirectional=m.bidirectional,
            attn_implementation=m.attn_implementation,
            inference_free=m.inference_free,
            splade_pooling="" if m.splade_pooling == "auto" else m.splade_pooling,
            splade_activation="" if m.splade_activation == "auto" else m.splade_activation,
            colbert_dim=m.colbert_dim,
            query_expansion=m.query_expansion,
        )
        resolved = given.resolve(
            m.path or self.path, m.pooling, m.query_prompt, m.doc_prompt, cfg.data.doc_context_length
        )
        if not resolved.include_prompt and (cfg.data.query_prompts or cfg.data.doc_prompts):
            raise TextFolderError(
                f"data.query_prompts / doc_prompts: {resolved.path} pools without its prompt (Pooling include_prompt "
                "false, or model.include_prompt=false), which is counted from one prompt per side; leave them empty "
                "and set model.query_prompt / doc_prompt"
            )
        frozen = cfg.loss.guide_model or cfg.loss.teacher_model
        if frozen and (cfg.data.query_prompts or cfg.data.doc_prompts) and not _includes_prompt(frozen):
            raise TextFolderError(
                f"data.query_prompts / doc_prompts: the guide or teacher {frozen} pools without the prompt (Pooling "
                "include_prompt false), which is counted from one prompt per side; leave them empty and set "
                "model.query_prompt / doc_prompt"
            )
        if m.freeze and read_text_folder(resolved.path).dense:  # a locked tower would run its head without a graph
            raise TextFolderError(
                f"model.freeze={m.freeze}: {resolved.path} ends in Dense modules, and locking its towers is not "
                "supported; train it whole or with LoRA (model.freeze=[])"
            )
        if resolved.pooling == "splade":
            _refuse_for_splade(cfg, resolved)
        elif resolved.pooling == "colbert":
            refuse_for_colbert(cfg)
        for key, pooling in (("splade_pooling", "splade"), ("splade_activation", "splade"), ("colbert_dim", "colbert")):
            if getattr(given, key) and resolved.pooling != pooling:
                raise TextFolderError(
                    f"model.{key}={getattr(given, key)}: model.pooling is {resolved.pooling!r}; it applies to "
                    f"model.pooling='{pooling}' only, so set that or remove it"
                )
        if given.query_expansion is not None and resolved.pooling != "colbert":
            raise TextFolderError(
                f"model.query_expansion={str(given.query_expansion).lower()}: model.pooling is {resolved.pooling!r}; "
                "it applies to model.pooling='colbert' only, so set that or remove it"
            )
        start = 1.0 if resolved.pooling in ("splade", "colbert") else self.init_scale  # plain dot products, MaxSim
        return dataclasses.replace(
            resolved,
            exits=_exits(cfg.loss.adaptive_layers, resolved),
            exit_norm=cfg.loss.adaptive_final_norm,
            **scale_fields(cfg, start),
            **LoraFields.from_config(cfg.lora, lambda: default_targets(resolved.config.model_type)),
        )

    def resolve(
        self,
        path: str | None = None,
        pooling: str = "auto",
        query_prompt: str = "auto",
        doc_prompt: str = "auto",
        doc_length: int = 0,
    ) -> BiEncoderArgs:
        """A copy with no `auto` left: the given settings, else these args' own, else the folder's (its
        sentence-transformers pooling and prompts; mean pooling for an encoder, last_token for a decoder;
        its max_seq_length for documents). A TextFolderError (one line, the fix) when they do not fit it."""
        path = self.path if path is None else path
        folder = read_text_folder(path)
        causal = is_causal(load_config(folder.model_dir, self.trust_remote_code))
        if self.bidirectional is False and not causal:
            raise TextFolderError(
                f"model.bidirectional=false: {folder.model_dir} attends both ways (an encoder, or a decoder whose "
                "config says so) and has no causal mask to keep; remove the setting"
            )
        causal = causal and not self.bidirectional
        pooling = pooling if pooling != "auto" else self.pooling
        if pooling == "auto":
            pooling = folder.pooling or ("last_token" if causal else "mean")
        static = bool(folder.static_query) if self.inference_free is None else self.inference_free
        if static and pooling != "splade":
            raise TextFolderError(
                f"model.inference_free=true with model.pooling={pooling!r}: its queries are weights over the "
                "vocabulary that meet SPLADE's documents; set model.pooling='splade' (on a masked LM), or "
                "model.inference_free=false"
            )
        if pooling not in POOLINGS:
            raise TextFolderError(f"model.pooling={pooling!r}: use one of {', '.join(POOLINGS)} (or auto)")
        if pooling == "cls" and causal:
            raise TextFolderError(
                f"model.pooling='cls' with {folder.model_dir}: a decoder's first token sees no other token; use "
                "model.pooling='last_token' (or mean), or let it attend both ways (model.bidirectional=true)"
            )
        if pooling == "splade":
            text_model_class(load_config(folder.model_dir, self.trust_remote_code), folder.model_dir, masked_lm=True)
            if folder.dense or self.include_prompt is False:
                raise TextFolderError(
                    f"model.pooling='splade' with {folder.model_dir}: its vocabulary-wide embedding takes no Dense "
                    "modules and pools every token (no include_prompt=false), as sentence-transformers' SpladePooling"
                )
        late = colbert_settings(folder, self.colbert_dim, self.query_expansion) if pooling == "colbert" else (0, None)
        if folder.colbert is not None and pooling != "colbert":
            raise TextFolderError(
                f"model.pooling={pooling!r} with {path}: a PyLate folder embeds every token (model.pooling='colbert'); "
                "leave model.pooling at auto"
            )
        if not doc_length:  # the given length, else these args' own, else the folder's
            limit = min(DEFAULT_DOC_LENGTH, load_tokenizer(folder.model_dir, self.trust_remote_code).model_max_length)
            default = min(folder.max_seq_length or limit, limit) if path else MINILM_DOC_LENGTH
            doc_length = self.doc_length if self.doc_length and path == self.path else default
        return dataclasses.replace(
            self,
            path=path,
            pooling=pooling,
            inference_free=static,
            splade_pooling=(self.splade_pooling or folder.splade_pooling or "max") if pooling == "splade" else "",
            splade_activation=(self.splade_activation or folder.splade_activation or "relu")
            if pooling == "splade"
            else "",
            colbert_dim=late[0],
            query_expansion=late[1],
            include_prompt=folder.include_prompt if self.include_prompt is None else self.include_prompt,
            bidirectional=not causal,
            query_prompt=_prompt(query_prompt, self.query_prompt, folder.query_prompt),
            doc_prompt=_prompt(doc_prompt, self.doc_prompt, folder.doc_prompt),
            doc_length=doc_length,
        )

    def as_guide(self, path: str) -> BiEncoderArgs:
        """The args of a frozen guide from folder `path` (`[loss] guide_model`, GISTEmbed): one tower, its
        folder's pooling, no adapters. With this model's tokenizer it embeds this model's token ids
        (prompts included), and its positions must hold these lengths (a TextFolderError, one line, if
        not); with another it reads them as text, up to its folder's sequence length (`retokenize_from`).
        A guide whose Pooling leaves the prompt out (`include_prompt` false) skips this model's prompts in the ids
        it reads, as sentence-transformers' GISTEmbedLoss hands the model's `prompt_length` to the guide; read
        as text, they are the guide's text and pooled."""
        guide = self._frozen(path)
        mine, theirs = self.tokenizer, guide.tokenizer
        if mine.get_vocab() != theirs.get_vocab() or pad_id(mine) != pad_id(theirs):
            return dataclasses.replace(guide, retokenize_from=self.model_dir)
        longest = max(self.query_length, self.doc_length)
        positions = getattr(guide.config, "max_position_embeddings", longest)
        if positions < longest:
            raise TextFolderError(
                f"{guide.model_dir} holds {positions} positions and the model's sequences reach {longest} tokens: "
                "use a guide with as many positions, or shorten data.context_length / data.doc_context_length"
            )
        if not guide.include_prompt:  # the prompts its ids carry, left out of its pooling (`BiEncoder.prompt_skip`)
            return dataclasses.replace(guide, query_prompt=self.query_prompt, doc_prompt=self.doc_prompt)
        return guide

    def _frozen(self, path: str) -> BiEncoderArgs:
        """These args (their kernel, trust in shipped code) on folder `path` as it stands: its pooling and sequence
        length, one tower, no prompts, no adapters; a dense embedder's (its cosines are compared or distilled)."""
        own = dict(
            path=path,
            pooling="auto",
            inference_free=None,
            include_prompt=None,
            bidirectional=None,
            shared=True,
            lora_rank=0,
            query_prompt="",
            doc_prompt="",
            doc_length=0,
            exits=(),
            exit_norm=False,
        )
        guide = dataclasses.replace(self, **own).resolve()
        if guide.pooling in ("splade", "colbert"):
            raise TextFolderError(
                f"loss.guide_model / teacher_model={path}: a {guide.pooling} folder, whose vectors have no cosine to "
                "compare or distill; use a dense embedder's folder"
            )
        return guide

    def update_from_data(
        self, *, image_shape: Any = None, vocab_size: int = 0, context_length: int = 32, eos_id: int = 0
    ) -> BiEncoderArgs:
        """The query length comes from data.context_length; vocabulary and widths from the checkpoint. A ValueError
        when a query or a document could be longer than the folder's positions (`max_position_embeddings`): past
        them a learnt table has no row, and sentence-transformers cuts the texts there."""
        positions = getattr(self.config, "max_position_embeddings", None)
        longest = max(context_length, self.doc_length)
        if isinstance(positions, int) and longest > positions:
            raise ValueError(
                f"data.context_length={context_length}, doc_context_length={self.doc_length}: {self.model_dir} holds "
                f"{positions} positions (max_position_embeddings); set both to at most {positions}"
            )
        return dataclasses.replace(self, query_length=context_length)

    @property
    def token_dim(self) -> int:
        """The width of a token in ColBERT's token sets (late interaction); 0 for one vector per text."""
        return self.colbert_dim if self.pooling == "colbert" else 0

    @property
    def model_dir(self) -> str:
        return read_text_folder(self.path).model_dir

    @property
    def width(self) -> int:
        """A text's embedding width: the last Dense module's, else the tower's hidden size (not SPLADE's, ColBERT's)."""
        dense = read_text_folder(self.path).dense
        return dense[-1].out_features if dense else int(self.config.hidden_size)

    @property
    def config(self) -> Any:
        """The folder's transformers config."""
        return load_config(self.model_dir, self.trust_remote_code)

    @property
    def tokenizer(self) -> Any:
        """The folder's transformers tokenizer."""
        return load_tokenizer(self.model_dir, self.trust_remote_code)

    @functools.cached_property
    def _counts(self) -> tuple[int, int]:
        """(all parameters, parameters in the repeated layers) of one tower with its adapters, counted on the
        meta device."""
        config = self.config
        with torch.device("meta"):
            tower = text_model_class(config, self.model_dir, self.pooling == "splade").from_config(
                config, trust_remote_code=self.trust_remote_code
            )
            if self.lora_rank:
                add_lora(tower, self)
        layers = sum(p.numel() for block in layer_blocks(tower) for p in block.parameters())
        pooler = getattr(tower, "pooler", None)
        unused = sum(p.numel() for p in pooler.parameters()) if isinstance(pooler, nn.Module) else 0
        return sum(p.numel() for p in tower.parameters()) - unused, layers

    def num_params(self) -> int:
        """Exact: the tower(s) without a pooler head, with the folder's Dense layers (ColBERT's projection), +
        logit_scale (and logit_bias)."""
        folder = read_text_folder(self.path)
        dense = sum(d.out_features * (d.in_features + d.bias) for d in folder.dense)
        if self.pooling == "colbert":
            dense += self.colbert_dim * (self.config.hidden_size + bool(folder.colbert and folder.colbert.bias))
        static = self.config.vocab_size if self.inference_free else 0
        return (self._counts[0] + dense) * (1 if self.shared else 2) + static + 1 + (self.init_logit_bias is not None)

    def flops_per_sample(self) -> int:
        """6 x layer parameters x tokens of one query and one document (attention scores excluded), with SPLADE's
        vocabulary head (hidden size x vocabulary) or ColBERT's projection at every token; inference-free SPLADE's
        query costs none."""
        config = self.config
        head = config.vocab_size if self.pooling == "splade" else self.colbert_dim  # 0 unless ColBERT
        head *= config.hidden_size
        tokens = (0 if self.inference_free else self.query_length) + self.doc_length  # a static query: a lookup
        return 6 * (self._counts[1] + head) * tokens


def _exits(layers: list[int], args: BiEncoderArgs) -> tuple[int, ...]:
    """`[loss] adaptive_layers` checked against the model: distinct, before its last layer, one vector per text."""
    if not layers:
        return ()
    if args.pooling in ("splade", "colbert") or args.inference_free:
        raise TextFolderError(
            f"loss.adaptive_layers={layers}: the layers' embeddings are pooled vectors, and this model's are "
            f"{'SPLADE' if args.pooling == 'splade' else 'ColBERT'}'s; use a dense pooling or leave them out"
        )
    last = int(args.config.num_hidden_layers)
    if len(set(layers)) != len(layers) or max(layers) >= last:
        raise TextFolderError(
            f"loss.adaptive_layers={layers}: {args.model_dir} has {last} layers; give distinct layers from 0 (the "
            f"token embeddings) to {last - 1} (the last is always trained)"
        )
    return tuple(layers)


def _includes_prompt(path: str) -> bool:
    """Whether the folder at `path` pools over the prompt (True where it cannot be read: building it says why)."""
    try:
        return read_text_folder(path).include_prompt
    except TextFolderError:
        return True


def _refuse_for_splade(cfg: Any, args: BiEncoderArgs) -> None:
    """The settings that read the embeddings as unit vectors whose leading dimensions matter, which SPLADE's
    vocabulary-wide ones are not, and those that name the towers of inference-free SPLADE, which has one, the
    documents': a one-line ConfigError."""
    if args.inference_free and (cfg.model.freeze or not args.shared):
        key, value = ("model.freeze", cfg.model.freeze) if cfg.model.freeze else ("model.flavor", cfg.model.flavor)
        raise TextFolderError(
            f"{key}={value}: inference-free SPLADE embeds its queries by a weight per token and has one tower, the "
            "documents'; remove it (model.flavor=shared)"
        )
    loss = cfg.loss
    for key, value in (
        ("loss.matryoshka_dims", loss.matryoshka_dims),
        ("eval.dims", cfg.eval.dims),
        ("loss.gor_weight", loss.gor_weight),
        ("loss.gor_mean_weight", loss.gor_mean_weight),
    ):
        if value:
            raise TextFolderError(
                f"{key}={value}: model.pooling='splade' embeds over the vocabulary, whose leading dimensions are no "
                "smaller embedding and whose vectors are not unit length; remove it (loss.flops_query_weight and "
                "flops_doc_weight keep SPLADE's embeddings sparse)"
            )


def _prompt(configured: str, flavor: str, folder: str) -> str:
    if configured != "auto":
        return configured
    return folder if flavor == "auto" else flavor


bi_encoder_flavors = {"shared": BiEncoderArgs(shared=True), "dual": BiEncoderArgs(shared=False)}


def text_guide(path: str, tokens_from: str, trust_remote_code: bool = False) -> BiEncoderArgs:
    """A frozen guide or teacher from the embedder's folder `path` for a model of another family whose batches hold
    the token ids of the tokenizer at `tokens_from` (a folder, or a bare `tokenizer.json`): it reads them as text
    (`retokenize.py`), up to its folder's sequence length; `trust_remote_code` runs the code either folder ships."""
    own = BiEncoderArgs(path=path, trust_remote_code=trust_remote_code)
    return dataclasses.replace(own._frozen(path), retokenize_from=tokens_from)
