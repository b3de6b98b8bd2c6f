"""WordNet 3.0 definition <-> lemma pairs: a small, real dense-retrieval task.

Query: a synset's definition ("a masterly or brilliant feat"); document: its first lemma ("tour
de force"). The bundle (titan_contrastive/assets/wordnet, made by
scripts/build_wordnet_pairs.py from the Debian package wordnet-base; WordNet licence alongside)
holds 115,659 training pairs and 2,000 held-out test pairs whose lemmas are unique and never
appear in training. Evaluation: recall@1 and @10 of each test definition against the 2,000 test
lemmas. Texts are tokenized once, at load, by the model family's tokenizer (MiniLM WordPiece):
queries to `[data] context_length` tokens, documents to the family's `doc_length`.
"""

from __future__ import annotations

import gzip
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.tokenizer import PairTokenizer

BUNDLE_DIR = Path(__file__).resolve().parents[1] / "assets" / "wordnet"


def load_pairs(folder: Path, split: str) -> tuple[list[str], list[str]]:
    file = folder / f"pairs_{split}.tsv.gz"
    if not file.exists():
        raise DataError(
            f"{file} not found; data.path must hold pairs_train.tsv.gz and pairs_test.tsv.gz "
            "(scripts/build_wordnet_pairs.py makes them), or leave data.path empty for the bundle"
        )
    try:
        rows = [line.split("\t") for line in gzip.decompress(file.read_bytes()).decode("utf-8").splitlines() if line]
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(
            f"{file} is not a readable gzip TSV ({e}); rebuild it with scripts/build_wordnet_pairs.py"
        ) from None
    if not rows or any(len(r) != 2 for r in rows):
        raise DataError(f"{file}: every line must be 'definition<TAB>lemma'")
    return [r[0] for r in rows], [r[1] for r in rows]


class TextPairDataset:
    """Pre-tokenized (query, document) pairs; batches are {query, doc, index} id tensors."""

    def __init__(
        self,
        *,
        name: str,
        split: str,
        queries: list[str],
        docs: list[str],
        tokenizer: PairTokenizer,
        query_length: int,
        source: str,
    ) -> None:
        self.name, self.split, self.source, self.full = name, split, source, True
        self.image_shape = None
        self.class_names = None
        self.recall_ks = (1, 10)
        self.recall_direction = "query_to_doc"
        self.tokenizer = tokenizer
        self._queries = tokenizer.encode(queries, query_length)
        self._docs = tokenizer.encode(docs, tokenizer.doc_length)

    def __len__(self) -> int:
        return len(self._queries)

    def set_epoch(self, epoch: int) -> None:
        """No per-sample randomness: the pairs are fixed."""

    def __getitems__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        return {"query": self._queries[idx], "doc": self._docs[idx], "index": idx}


def build_wordnet(
    split: str, *, path: str = "", context_length: int = 32, tokenizer: Any = None, **_: Any
) -> TextPairDataset:
    if tokenizer is None:
        raise DataError(
            "data.dataset='wordnet' is text-to-text and needs a model family with a tokenizer: "
            "use model.name='bi_encoder'"
        )
    folder = Path(path) if path else BUNDLE_DIR
    queries, docs = load_pairs(folder, split)
    return TextPairDataset(
        name="wordnet",
        split=split,
        queries=queries,
        docs=docs,
        tokenizer=tokenizer,
        query_length=context_length,
        source=str(folder),
    )
