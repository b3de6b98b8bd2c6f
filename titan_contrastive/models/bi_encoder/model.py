"""BiEncoder: a Hugging Face text model (encoder or decoder) from a local folder, pooled and
L2-normalized, as shared or separate query and document towers, with a learnable scale.

`[model] path` is a transformers or sentence-transformers folder (`folder.read_text_folder`;
empty: the bundled all-MiniLM-L6-v2). Pooling (`pooling.py`) is cls, mean (over real tokens),
last_token (the last real token, a decoder embedder's) or another of sentence-transformers' modes,
by default the sentence-transformers folder's own, else mean for an encoder and last_token for a
decoder; or SPLADE's (`splade`: the masked LM's vocabulary-wide sparse embedding, not normalized,
t = 1 by default). A sentence-transformers folder's Dense modules follow the pooling (`query_head`,
`doc_head`; trained in full, frozen under LoRA). Per-side prompts (E5's "query: ", an instruction)
are prepended by the tokenizer (`datasets.tokenizer.PairTokenizer`). `logit_scale` starts at
log(20), the scale of sentence-transformers' MultipleNegativesRankingLoss.

The batches hold right-padded ids at the full query / document length and no attention mask:
padding is `folder.pad_id` (-1 where the tokenizer's pad token also stands in real text), so the
mask is `ids != pad_id` and every tower call cuts its ids to the longest sequence of the call
(exact: the padding is masked), which makes a GradCache chunk, its re-forward, a plain microbatch
and an evaluation batch all skip the padding columns with the same shapes (so the same dropout
draws). `BiEncoder.padded_inputs` tells GradCache which inputs are padded token ids.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from titan_contrastive.batching import NEGATIVES
from titan_contrastive.components.lora import LoraFields, add_lora, default_targets
from titan_contrastive.datasets.tokenizer import PairTokenizer
from titan_contrastive.losses import temperature_from_config
from titan_contrastive.models.bi_encoder.embedding import dense_head, embed
from titan_contrastive.models.bi_encoder.folder import (
    POOLINGS,
    TextFolderError,
    is_causal,
    layer_blocks,
    load_config,
    load_tokenizer,
    pad_id,
    prompt_tokens,
    read_text_folder,
    text_model_class,
)
from titan_contrastive.models.bi_encoder.retokenize import Retokenizer
from titan_contrastive.models.bi_encoder.static_query import StaticQuery, static_weight
from titan_contrastive.models.bi_encoder.tower import load_text_tower

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
    attn_implementation: str = ""
    """`[model] attn_implementation`: transformers' attention kernel for the towers ("" = its default)."""
    trust_remote_code: bool = False
    """`[model] trust_remote_code`: run the code a folder ships (config.json `auto_map`) for its model, its
    tokenizer, and a guide's or teacher's folder; otherwise such a folder is refused."""
    retokenize_from: str = ""
    """A guide's (`as_guide`) with another vocabulary: the folder of the model whose token ids it reads as
    text (`retokenize.py`); empty: it embeds them as they are."""

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
        elif given.splade_pooling or given.splade_activation:
            key = "splade_pooling" if given.splade_pooling else "splade_activation"
            raise TextFolderError(
                f"model.{key}={getattr(given, key)}: model.pooling is {resolved.pooling!r}; it applies to "
                "model.pooling='splade' only, so set that or remove it"
            )
        start = 1.0 if resolved.pooling == "splade" else self.init_scale  # SPLADE's logits: the plain dot product
        t = temperature_from_config(cfg, default_logit_scale=math.log(start))
        return dataclasses.replace(
            resolved,
            init_scale=math.exp(t.init_logit_scale),
            learn_logit_scale=t.learn_logit_scale,
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
        )
        guide = dataclasses.replace(self, **own).resolve()  # its folder's pooling and sequence length
        if guide.pooling == "splade":
            raise TextFolderError(
                f"loss.guide_model / teacher_model={path}: a SPLADE folder, whose sparse vectors have no cosine to "
                "compare or distill; use a dense embedder's folder"
            )
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
    def model_dir(self) -> str:
        return read_text_folder(self.path).model_dir

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
        """Exact: the tower(s) without a pooler head, with the folder's Dense layers, + logit_scale."""
        dense = sum(d.out_features * (d.in_features + d.bias) for d in read_text_folder(self.path).dense)
        static = self.config.vocab_size if self.inference_free else 0
        return (self._counts[0] + dense) * (1 if self.shared else 2) + static + 1

    def flops_per_sample(self) -> int:
        """6 x layer parameters x tokens of one query and one document (attention scores excluded), with SPLADE's
        vocabulary head (hidden size x vocabulary) at every token; inference-free SPLADE's query costs none."""
        config = self.config
        head = config.vocab_size * config.hidden_size if self.pooling == "splade" else 0
        tokens = (0 if self.inference_free else self.query_length) + self.doc_length  # a static query: a lookup
        return 6 * (self._counts[1] + head) * tokens


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


def build_tokenizer(args: BiEncoderArgs) -> PairTokenizer:
    """`ModelSpec.build_tokenizer`: the folder's tokenizer, the args' prompts and document length."""
    args = args.resolve()
    hf = args.tokenizer
    return PairTokenizer(
        hf, doc_length=args.doc_length, pad_id=pad_id(hf), query_prompt=args.query_prompt, doc_prompt=args.doc_prompt
    )


class BiEncoder(nn.Module):
    def __init__(self, args: BiEncoderArgs) -> None:
        super().__init__()
        self.args = args = args.resolve()
        model_dir = args.model_dir
        splade = args.pooling == "splade"
        self.query_tower = load_text_tower(
            model_dir, args.trust_remote_code, args.bidirectional, splade, args.attn_implementation
        )
        if args.lora_rank:  # adapters before the copy: a separate document tower gets its own
            add_lora(self.query_tower, args)
        self.doc_tower = self.query_tower if args.shared else copy.deepcopy(self.query_tower)
        # the folder's Dense layers after the pooling; part of the frozen base under LoRA
        folder = read_text_folder(args.path)
        self.query_head = dense_head(folder.dense, self.query_tower.config.hidden_size)
        if self.query_head is not None and args.lora_rank:
            self.query_head.requires_grad_(False)
        self.doc_head = self.query_head if args.shared else copy.deepcopy(self.query_head)
        self.pad_id = pad_id(args.tokenizer)
        self.static_query = (
            StaticQuery(
                static_weight(folder.static_query, self.query_tower.config.vocab_size, args.tokenizer),
                {*args.tokenizer("")["input_ids"], self.pad_id},  # what the tokenizer adds (CLS, SEP), padding
            )
            if args.inference_free
            else None
        )
        prompts = (args.query_prompt, args.doc_prompt)
        self.prompt_skip = (0, 0) if args.include_prompt else tuple(prompt_tokens(args.tokenizer, p) for p in prompts)
        self.retokenize = (
            Retokenizer(load_tokenizer(args.retokenize_from, args.trust_remote_code), args.tokenizer, args.doc_length)
            if args.retokenize_from
            else None
        )
        self.logit_scale = nn.Parameter(
            torch.full((1,), math.log(args.init_scale)), requires_grad=args.learn_logit_scale
        )

    def init_weights(self) -> None:
        """Pretrained: only the scale has an initial value of its own."""
        with torch.no_grad():
            self.logit_scale.fill_(math.log(self.args.init_scale))

    @property
    def unit_embeddings(self) -> bool:
        """Whether the embeddings are unit vectors (the global-negatives step checks it once): not SPLADE's."""
        return self.args.pooling != "splade"

    @property
    def sparse_embeddings(self) -> bool:
        """Whether the embeddings are sparse (SPLADE's): evaluation reports their active dimensions."""
        return self.args.pooling == "splade"

    @property
    def padded_inputs(self) -> dict[str, int]:
        """Inputs (batch keys) that are right-padded token ids, and their pad id: what GradCache
        reads the sample lengths from (`[gradcache] chunk_tokens`, `batching.tokens`)."""
        return {"query": self.pad_id, "doc": self.pad_id, NEGATIVES: self.pad_id}

    def _embed(
        self, tower: nn.Module, ids: Tensor, index: int = 0, replay: Sequence[Tensor | None] | None = None
    ) -> Tensor:
        """`tower`'s embeddings of `ids`, through the query head (`index` 0) or the document head (1)."""
        head = self.query_head if index == 0 else self.doc_head
        args = self.args
        splade = (args.splade_pooling, args.splade_activation)
        return embed(tower, ids, self.pad_id, args.pooling, index, replay, head, self.prompt_skip[index], splade)

    def embed_side(self, side: str, ids: Tensor) -> Tensor:
        """`side`'s ("query" or "doc") embeddings of `ids`, outside a step (the exporter's probe)."""
        if side == "query" and self.static_query is not None:
            return self.static_query(ids)
        return self._embed(getattr(self, f"{side}_tower"), ids, 0 if side == "query" else 1)

    def forward(
        self, query: Tensor, doc: Tensor, *, replay: Sequence[Tensor | None] | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(query embeddings, document embeddings, exp(logit_scale)); `replay`: in a cached-gradient
        re-forward, pass 1's outputs of these samples (`grad_cache.engine.Replay`), which a locked
        tower returns instead of running."""
        if self.retokenize is not None:  # a guide with another vocabulary reads the ids as text
            query, doc = self.retokenize(query), self.retokenize(doc)
        static = self.static_query
        return (
            self._embed(self.query_tower, query, 0, replay) if static is None else static(query),
            self._embed(self.doc_tower, doc, 1, replay),
            self.logit_scale.exp(),
        )


def bi_encoder_blocks(model: BiEncoder) -> list[nn.Module]:
    """Each tower's transformer layers (`folder.layer_blocks`): FSDP2, activation checkpointing and compile units."""
    towers = [model.query_tower] if model.args.shared else [model.query_tower, model.doc_tower]
    return [layer for tower in towers for layer in layer_blocks(tower)]
