"""BiEncoder: a Hugging Face text model (encoder or decoder) from a local folder, pooled and
L2-normalized, as shared or separate query and document towers, with a learnable scale.

`[model] path` is a transformers or sentence-transformers folder (`folder.read_text_folder`;
empty: the bundled all-MiniLM-L6-v2). Pooling (`pooling.py`) is cls, mean (over real tokens),
last_token (the last real token, a decoder embedder's) or another of sentence-transformers' modes,
by default the sentence-transformers folder's own, else mean for an encoder and last_token for a
decoder; or SPLADE's (`splade`: the masked LM's vocabulary-wide sparse embedding, not normalized,
t = 1 by default); or ColBERT's (`colbert`: every token projected and normalized, scored by late
interaction, `colbert.py`). A sentence-transformers folder's Dense modules follow the pooling
(`query_head`, `doc_head`; trained in full, frozen under LoRA; ColBERT's projection sits there too).
The settings and their resolution against the folder are `args.py`'s. Per-side prompts (E5's
"query: ", an instruction) are prepended by the tokenizer (`datasets.tokenizer.PairTokenizer`).
`logit_scale` starts at log(20), the scale of sentence-transformers' MultipleNegativesRankingLoss.

The batches hold right-padded ids at the full query / document length and no attention mask:
padding is `folder.pad_id` (-1 where the tokenizer's pad token also stands in real text), so the
mask is `ids != pad_id` and every tower call cuts its ids to the longest sequence of the call
(exact: the padding is masked), which makes a GradCache chunk, its re-forward, a plain microbatch
and an evaluation batch all skip the padding columns with the same shapes (so the same dropout
draws). `BiEncoder.padded_inputs` tells GradCache which inputs are padded token ids.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from torch import Tensor, nn

from titan_contrastive.batching import NEGATIVES
from titan_contrastive.components.freeze import locked_forward
from titan_contrastive.components.lora import add_lora
from titan_contrastive.datasets.tokenizer import PairTokenizer
from titan_contrastive.models.bi_encoder.args import BiEncoderArgs
from titan_contrastive.models.bi_encoder.colbert import colbert_embed, colbert_sides, projection
from titan_contrastive.models.bi_encoder.embedding import dense_head, embed
from titan_contrastive.models.bi_encoder.folder import (
    TextFolderError,
    layer_blocks,
    pad_id,
    prompt_tokens,
    read_text_folder,
)
from titan_contrastive.models.bi_encoder.retokenize import Retokenizer, source_tokenizer
from titan_contrastive.models.bi_encoder.static_query import StaticQuery, static_weight
from titan_contrastive.models.bi_encoder.tower import load_text_tower
from titan_contrastive.models.pretrained_scale import PretrainedScale


def build_tokenizer(args: BiEncoderArgs) -> PairTokenizer:
    """`ModelSpec.build_tokenizer`: the folder's tokenizer, the args' prompts and document length, a PyLate
    folder's query length."""
    args = args.resolve()
    hf, late = args.tokenizer, read_text_folder(args.path).colbert
    return PairTokenizer(
        hf,
        doc_length=args.doc_length,
        pad_id=pad_id(hf),
        query_prompt=args.query_prompt,
        doc_prompt=args.doc_prompt,
        query_length=late.query_length if late and args.pooling == "colbert" else 0,
    )


class BiEncoder(PretrainedScale, nn.Module):
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
        width = self.query_tower.config.hidden_size
        colbert = args.pooling == "colbert"
        self.query_head = (
            projection(width, args.colbert_dim, folder.colbert) if colbert else dense_head(folder.dense, width)
        )
        if self.query_head is not None and args.lora_rank and (folder.dense or folder.colbert):
            self.query_head.requires_grad_(False)
        self.doc_head = self.query_head if args.shared else copy.deepcopy(self.query_head)
        self.pad_id = pad_id(args.tokenizer)
        self.colbert_sides = colbert_sides(args, folder) if colbert else ()
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
            Retokenizer(
                *source_tokenizer(args.retokenize_from, args.trust_remote_code), args.tokenizer, args.doc_length
            )
            if args.retokenize_from
            else None
        )
        if args.exit_norm and not isinstance(getattr(self.query_tower, "norm", None), nn.Module):
            raise TextFolderError(
                f"loss.adaptive_final_norm=true: {model_dir} has no final norm after its layers (an encoder's layers "
                "each end in their own); leave it false"
            )
        self.add_logit_scale()
        self.exits_in_eval = False
        """Evaluation's recall at each exit (`components.evaluate.eval_mode`): the exits' embeddings out of training."""

    @property
    def unit_embeddings(self) -> bool:
        """Whether the embeddings are unit vectors (the global-negatives step checks it once): not SPLADE's, nor
        ColBERT's token sets."""
        return self.args.pooling not in ("splade", "colbert") and not self.args.exits  # exits: several side by side

    @property
    def sparse_embeddings(self) -> bool:
        """Whether the embeddings are sparse (SPLADE's): evaluation reports their active dimensions."""
        return self.args.pooling == "splade"

    @property
    def token_dim(self) -> int:
        """The width of a token in ColBERT's token sets (scored by late interaction); 0 for one vector per text."""
        return self.args.token_dim

    @property
    def padded_inputs(self) -> dict[str, int]:
        """Inputs (batch keys) that are right-padded token ids, and their pad id: what GradCache
        reads the sample lengths from (`[gradcache] chunk_tokens`, `batching.tokens`); not ColBERT's expanded
        queries, whose padding is read as mask tokens."""
        expanded = self.colbert_sides and self.colbert_sides[0].expansion is not None
        return {**({} if expanded else {"query": self.pad_id}), "doc": self.pad_id, NEGATIVES: self.pad_id}

    def _embed(
        self, tower: nn.Module, ids: Tensor, index: int = 0, replay: Sequence[Tensor | None] | None = None
    ) -> Tensor:
        """`tower`'s embeddings of `ids`, through the query head (`index` 0) or the document head (1)."""
        head = self.query_head if index == 0 else self.doc_head
        args = self.args
        if self.colbert_sides:
            side = self.colbert_sides[index]
            return locked_forward(tower, index, lambda: colbert_embed(tower, ids, self.pad_id, head, side), replay)
        splade = (args.splade_pooling, args.splade_activation)
        exits = args.exits if self.training or self.exits_in_eval else ()  # else the last layer's alone
        norm = tower.norm if exits and args.exit_norm else None
        return embed(
            tower, ids, self.pad_id, args.pooling, index, replay, head, self.prompt_skip[index], splade, exits, norm
        )

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
            *self.temperature(),
        )


def bi_encoder_blocks(model: BiEncoder) -> list[nn.Module]:
    """Each tower's transformer layers (`folder.layer_blocks`): FSDP2, activation checkpointing and compile units."""
    towers = [model.query_tower] if model.args.shared else [model.query_tower, model.doc_tower]
    return [layer for tower in towers for layer in layer_blocks(tower)]
