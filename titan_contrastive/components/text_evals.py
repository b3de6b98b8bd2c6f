"""The retrieval evaluations a run asks for beside its own held-out split: retrieval on a BEIR folder (`[eval]
beir_path`, `beir_eval`), semantic similarity on scored sentence pairs (`[eval] sts_path`, `sts_eval`), reranking of
each query's own candidates (`[eval] reranking_path`, `reranking_eval`), clustering (`[eval] clustering_path`,
`clustering_eval`), pair classification (`[eval] pair_classification_path`, `pair_classification_eval`), triplets
(`[eval] triplet_path`, `triplet_eval`) and MMEB's tasks (`[eval] mmeb_path`, `mmeb_eval`). The text sets read the
model through its query and document embedders (`beir_eval.pair_embedders` for a text-pair model, `side_embedders`
for one whose processor fills both sides: qwen_vl's, whose documents may be page images): BEIR's queries and corpus,
reranking's and triplets' through their own sides; both sentences of an STS or a classified pair and a clustering
row's sentences through the query side (its prompt: E5's "query: " for symmetric tasks, an instruction); MMEB's sets
each in their own mode through that processor (`mmeb_eval.mode_embedders`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from titan_contrastive.components.beir_eval import (
    check_corpus,
    evaluate_sets,
    load_beir,
    pair_embedders,
    side_embedders,
)
from titan_contrastive.components.classification_eval import (
    ClassificationSet,
    evaluate_classification,
    load_classification,
)
from titan_contrastive.components.clustering_eval import ClusteringSet, evaluate_clustering, load_clustering
from titan_contrastive.components.mmeb_eval import evaluate_mmeb, mode_embedders
from titan_contrastive.components.pair_classification_eval import (
    PairSet,
    evaluate_pair_classification,
    load_pair_classification,
)
from titan_contrastive.components.reranking_eval import evaluate_reranking
from titan_contrastive.components.sts_eval import StsSet, evaluate_sts, load_sts
from titan_contrastive.components.triplet_eval import TripletSet, evaluate_triplets, load_triplets
from titan_contrastive.config import ConfigError
from titan_contrastive.config.evaluation import EVAL_SETS
from titan_contrastive.datasets.beir_folder import BeirSet
from titan_contrastive.datasets.mmeb_sets import MmebSet, read_mmeb
from titan_contrastive.datasets.reranking_sets import RerankSet, read_reranking

__all__ = ["TextEvals"]


@dataclass(frozen=True)
class TextEvals:
    beir: dict[str, BeirSet] = field(default_factory=dict)
    """The BEIR sets by split name (`[eval] beir_split`: one, or several, each evaluated and averaged)."""
    sts: StsSet | None = None
    forward: Callable[[dict[str, torch.Tensor]], Any] | None = None
    """The model's forward on a batch of `query` and `doc` ids (`pair_embedders`)."""
    tokenizer: object = None
    """Its `PairTokenizer` (prompts and lengths), or the processor that fills both sides (`side_embedders`)."""
    graded: bool = False
    """BEIR's nDCG with the qrels' grades as gains (`[eval] beir_graded`)."""
    pool: tuple[float, int] = (1.0, 1)
    """A late-interaction model's document tokens pooled: factor, protected tokens (`[eval] beir_pool_factor`)."""
    precisions: tuple[str, ...] = ()
    """The corpus precisions BEIR is also searched in (`[eval] beir_precisions`)."""
    mmeb: dict[str, MmebSet] = field(default_factory=dict)
    """MMEB's sets by name (`[eval] mmeb_path`)."""
    reranking: RerankSet | None = None
    """Queries each with its own candidates (`[eval] reranking_path`)."""
    clustering: ClusteringSet | None = None
    """Rows of sentences and their labels (`[eval] clustering_path`)."""
    pair_classification: PairSet | None = None
    """Sentence pairs labelled 0 or 1 (`[eval] pair_classification_path`)."""
    triplets: TripletSet | None = None
    """Anchors, each with a positive and a negative (`[eval] triplet_path`)."""
    classification: ClassificationSet | None = None
    """Texts and labels in a train and a test split (`[eval] classification_path`)."""
    per_label: int = 8
    """Train rows per label each classifier fit takes (`[eval] classification_per_label`)."""

    @classmethod
    def from_config(
        cls, ev: Any, forward: Callable[[dict[str, torch.Tensor]], Any], tokenizer: object, args: object = None
    ) -> TextEvals:
        """The sets `[eval]` names (none when evaluation is off), read now: a bad file, sets for a model family
        without text queries, or a corpus the model cannot read (pages for a text model, texts for a page
        embedder), stop the run at start (a DataError, one line). `args`: the model's, whose `processor()` (qwen_vl)
        fills both sides, in place of `tokenizer`."""
        if not ev.enable or not any(getattr(ev, f"{s.name}_path") for s in EVAL_SETS):
            return cls()
        if callable(getattr(args, "processor", None)):
            tokenizer = args.processor()  # type: ignore[attr-defined]
        evals = cls(
            load_beir(ev.beir_path, ev.beir_split) if ev.beir_path else {},
            load_sts(ev.sts_path, ev.sts_split) if ev.sts_path else None,
            forward,
            tokenizer,
            ev.beir_graded,
            (ev.beir_pool_factor, ev.beir_pool_protected),
            tuple(ev.beir_precisions),
            read_mmeb(ev.mmeb_path, ev.mmeb_image_root) if ev.mmeb_path else {},
            read_reranking(ev.reranking_path, ev.reranking_split) if ev.reranking_path else None,
            load_clustering(ev.clustering_path, ev.clustering_split) if ev.clustering_path else None,
            load_pair_classification(ev.pair_classification_path, ev.pair_classification_split)
            if ev.pair_classification_path
            else None,
            load_triplets(ev.triplet_path, ev.triplet_split) if ev.triplet_path else None,
            load_classification(ev.classification_path, ev.classification_split) if ev.classification_path else None,
            ev.classification_per_label,
        )
        if evals.mmeb and (not hasattr(evals.tokenizer, "sides") or getattr(args, "token_dim", 0)):
            raise ConfigError(
                f"eval.mmeb_path={ev.mmeb_path!r}: MMEB's queries and candidates are images and texts, scored as one "
                "vector each; evaluate it with a qwen_vl model of last_token or mean pooling, or leave it empty"
            )
        if ev.beir_pool_factor != 1 and not getattr(args, "token_dim", 0):
            raise ConfigError(
                f"eval.beir_pool_factor={ev.beir_pool_factor!r} pools the tokens of a late-interaction model's "
                "documents, and this model embeds a text as one vector; set model.pooling='colbert' or leave it at 1"
            )
        one_vector = not getattr(args, "token_dim", 0) and getattr(args, "pooling", "") != "splade"
        if ev.beir_precisions and not one_vector:
            raise ConfigError(
                f"eval.beir_precisions={ev.beir_precisions}: quantized search is for one dense vector per text, and "
                f"this model embeds a text as {'its tokens' if getattr(args, 'token_dim', 0) else 'a sparse vector'}; "
                "leave it empty"
            )
        if evals.texts:
            evals._embedders(0)
        for key in (f"{s.name}_path" for s in EVAL_SETS if s.text_documents):
            if getattr(ev, key) and evals.pages:
                raise ConfigError(
                    f"eval.{key}={getattr(ev, key)!r}: its documents are texts, and this run's documents are images; "
                    "measure it with a model of text documents (data.retrieval_mode=t2t), or leave it empty"
                )
        for beir in evals.beir.values():
            check_corpus(beir, evals.pages)
        return evals

    @property
    def pages(self) -> bool:
        """Whether the model's documents are images (its processor's document side)."""
        return getattr(self.tokenizer, "kinds", {}).get("doc") == "image"

    def _embedders(self, query_length: int) -> tuple[Callable[[list[str]], torch.Tensor], Callable[..., torch.Tensor]]:
        if hasattr(self.tokenizer, "sides"):
            return side_embedders(self.forward, self.tokenizer)  # type: ignore[arg-type]
        return pair_embedders(self.forward, self.tokenizer, query_length)  # type: ignore[arg-type]

    @property
    def texts(self) -> bool:
        """Whether a set reads the model through its text embedders (BEIR, STS, reranking, clustering, pairs, ...)."""
        one_vector = (self.sts, self.reranking, self.clustering, self.pair_classification, self.triplets)
        one_vector += (self.classification,)
        return bool(self.beir) or any(s is not None for s in one_vector)

    def __bool__(self) -> bool:
        return self.texts or bool(self.mmeb)

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
        """Every set's metrics (`beir/...`, `sts/...`, `reranking/...`, `clustering/...`, `pair_classification/...`,
        `triplet/...`, `classification/...`, `mmeb/...`; with `dims`,
        also at each cut, `dim{m}/...`), each text embedded once across the ranks; for a `model` whose embeddings are
        sparse (`sparse_embeddings`, SPLADE's), BEIR's active dimensions too; for one whose embeddings are token sets
        (`token_dim`, ColBERT's), BEIR by late interaction (the other sets, which compare one vector per text, are
        refused for it before the run: `colbert.refuse_for_colbert`)."""
        sizes = {"batch_size": batch_size, "rank": rank, "world_size": world_size}
        mmeb = (
            evaluate_mmeb(
                self.mmeb, lambda mode: mode_embedders(self.forward, self.tokenizer, mode), **sizes, dims=dims
            )
            if self.mmeb
            else {}
        )
        if not self.texts:
            return mmeb
        queries, docs = self._embedders(query_length)
        common = {**sizes, "dims": dims}
        embeddings = {
            "sparse": bool(getattr(model, "sparse_embeddings", False)),
            "token_dim": getattr(model, "token_dim", 0),
        }
        scoring = {
            "graded": self.graded,
            "pages": self.pages,
            "pool_factor": self.pool[0],
            "pool_protected": self.pool[1],
            "precisions": self.precisions,
        }
        results = evaluate_sets(self.beir, queries, docs, **common, **embeddings, **scoring) if self.beir else {}
        if self.reranking is not None:
            results |= evaluate_reranking(self.reranking, queries, docs, **common)
        if self.clustering is not None:
            results |= evaluate_clustering(self.clustering, queries, **common)
        if self.pair_classification is not None:
            results |= evaluate_pair_classification(self.pair_classification, queries, **common)
        if self.triplets is not None:
            results |= evaluate_triplets(self.triplets, queries, docs, **common)
        if self.classification is not None:
            results |= evaluate_classification(self.classification, queries, **common, per_label=self.per_label)
        return mmeb | results | (evaluate_sts(self.sts, queries, **common) if self.sts is not None else {})
