"""StaticEmbedder: sentence-transformers' StaticEmbedding trained as a dual encoder. A text's embedding is the
mean of its tokens' rows in a table (the tokenizer run without special tokens, as StaticEmbedding runs it),
L2-normalized; one table for queries and documents (`shared`) or two.

The batches hold right-padded ids padded with -1, which no token is, so the mean counts exactly the text's
tokens. It is a sum over the row with weights 1 / (tokens) (`F.embedding_bag`, `per_sample_weights`): no
[B, L, d] tensor of gathered rows, no data-dependent shape. A text without tokens embeds as 0, as
StaticEmbedding's does.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titan_contrastive.batching import NEGATIVES, right_trimmed
from titan_contrastive.datasets.tokenizer import PairTokenizer
from titan_contrastive.models.pretrained_scale import PretrainedScale
from titan_contrastive.models.static.args import StaticArgs
from titan_contrastive.models.static.folder import read_static_folder, read_table, read_tokenizer

PAD = -1
"""What padding is written as: never a token id."""


def hf_tokenizer(backend: object) -> object:
    """A transformers fast tokenizer around the `tokenizers.Tokenizer` a StaticEmbedding reads with."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=copy.deepcopy(backend))


def build_tokenizer(args: StaticArgs) -> PairTokenizer:
    """`ModelSpec.build_tokenizer`: the folder's tokenizer without special tokens, the prompts and lengths."""
    return PairTokenizer(
        hf_tokenizer(read_tokenizer(read_static_folder(args.path), args.trust_remote_code)),
        doc_length=args.doc_length,
        pad_id=PAD,
        query_prompt=args.query_prompt,
        doc_prompt=args.doc_prompt,
        special_tokens=False,
    )


def mean_rows(table: nn.EmbeddingBag, ids: Tensor) -> Tensor:
    """[B, d]: the mean of `table`'s rows over each row of right-padded `ids` [B, L] (padding `PAD`), 0 for a row
    without tokens; the trailing all-padding columns skipped."""
    ids = right_trimmed(ids, PAD)
    real = (ids != PAD).to(table.weight.dtype)
    weights = real / real.sum(1, keepdim=True).clamp_min(1)
    return table(ids.clamp_min(0), per_sample_weights=weights)


class StaticEmbedder(PretrainedScale, nn.Module):
    def __init__(self, args: StaticArgs) -> None:
        super().__init__()
        self.args = args
        self.query_embedding = nn.EmbeddingBag(args.vocab, args.dim, mode="sum")  # N(0, 1), StaticEmbedding's start
        if not args.static_dim:
            with torch.no_grad():
                self.query_embedding.weight.copy_(read_table(read_static_folder(args.path)))
        self.doc_embedding = self.query_embedding if args.shared else copy.deepcopy(self.query_embedding)
        self.add_logit_scale()

    @property
    def unit_embeddings(self) -> bool:
        """False: a text without tokens embeds as 0 (the global-negatives step checks unit length otherwise)."""
        return False

    @property
    def padded_inputs(self) -> dict[str, int]:
        """The right-padded token-id inputs and their pad id (`[gradcache] chunk_tokens` reads the lengths)."""
        return {"query": PAD, "doc": PAD, NEGATIVES: PAD}

    def embed_side(self, side: str, ids: Tensor) -> Tensor:
        """`side`'s ("query" or "doc") unit embeddings of `ids`."""
        return F.normalize(mean_rows(getattr(self, f"{side}_embedding"), ids), dim=-1)

    def forward(self, query: Tensor, doc: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(query embeddings, document embeddings, exp(logit_scale))."""
        return self.embed_side("query", query), self.embed_side("doc", doc), *self.temperature()


def static_blocks(model: StaticEmbedder) -> list[nn.Module]:
    """The table(s): FSDP2 shards each by rows."""
    return [model.query_embedding] if model.args.shared else [model.query_embedding, model.doc_embedding]
