"""The text evaluations a run asks for beside its own held-out split: retrieval on a BEIR folder (`[eval]
beir_path`, `beir_eval`) and semantic similarity on scored sentence pairs (`[eval] sts_path`, `sts_eval`). Both
read a text-pair model through its query and document embedders (`beir_eval.pair_embedders`): BEIR's queries
and corpus through their own sides, both sentences of a pair through the query side (its prompt: E5's "query:
" for symmetric tasks, an instruction)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from titan_contrastive.components.beir_eval import evaluate_beir, load_beir, pair_embedders
from titan_contrastive.components.retrieval_metrics import BeirSet
from titan_contrastive.components.sts_eval import StsSet, evaluate_sts, load_sts

__all__ = ["TextEvals"]


@dataclass(frozen=True)
class TextEvals:
    beir: BeirSet | None = None
    sts: StsSet | None = None
    forward: Callable[[dict[str, torch.Tensor]], Any] | None = None
    """The model's forward on a batch of `query` and `doc` ids (`pair_embedders`)."""
    tokenizer: object = None
    """Its `PairTokenizer` (prompts and lengths)."""

    @classmethod
    def from_config(cls, ev: Any, forward: Callable[[dict[str, torch.Tensor]], Any], tokenizer: object) -> TextEvals:
        """The sets `[eval]` names (none when evaluation is off), read now: a bad file, or sets for a model family
        without text pairs, stop the run at start (a DataError, one line)."""
        if not ev.enable:
            return cls()
        evals = cls(
            load_beir(ev.beir_path, ev.beir_split) if ev.beir_path else None,
            load_sts(ev.sts_path, ev.sts_split) if ev.sts_path else None,
            forward,
            tokenizer,
        )
        if evals:
            pair_embedders(forward, tokenizer, 0)
        return evals

    def __bool__(self) -> bool:
        return self.beir is not None or self.sts is not None

    def __call__(
        self,
        query_length: int,
        *,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        dims: Sequence[int] = (),
        model: object = None,
    ) -> dict[str, float]:
        """Every set's metrics (`beir/...`, `sts/...`; with `dims`, also `dim{m}/beir/...`, `dim{m}/sts/...`), each
        text embedded once across the ranks; for a `model` whose embeddings are sparse (`sparse_embeddings`,
        SPLADE's), BEIR's active dimensions too; for one whose embeddings are token sets (`token_dim`, ColBERT's),
        BEIR by late interaction (STS, which compares two vectors, is refused for it before the run)."""
        queries, docs = pair_embedders(self.forward, self.tokenizer, query_length)
        common = {"batch_size": batch_size, "rank": rank, "world_size": world_size, "dims": dims}
        embeddings = {
            "sparse": bool(getattr(model, "sparse_embeddings", False)),
            "token_dim": getattr(model, "token_dim", 0),
        }
        results = evaluate_beir(self.beir, queries, docs, **common, **embeddings) if self.beir is not None else {}
        return results | (evaluate_sts(self.sts, queries, **common) if self.sts is not None else {})
