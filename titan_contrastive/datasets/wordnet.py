"""WordNet 3.0 definition <-> lemma pairs: a small, real dense-retrieval task.

Query: a synset's definition ("a masterly or brilliant feat"); document: its first lemma ("tour
de force"). The bundle (titan_contrastive/assets/wordnet, made by
scripts/build_wordnet_pairs.py from the Debian package wordnet-base; WordNet licence alongside)
holds 115,659 training pairs and 2,000 held-out test pairs whose lemmas are unique and never
appear in training. Evaluation: recall@1 and @10 of each test definition against the 2,000 test
lemmas. Texts are tokenized once, at load, by the model family's tokenizer (MiniLM WordPiece):
queries to `[data] context_length` tokens, documents to the family's `doc_length`.

A training file may carry a third column, a mined hard negative per definition (a lemma of a
sibling synset): `definition<TAB>lemma<TAB>negative lemma`, every line of a file as wide. It is
served as `neg` [B, 1, L] unless data.hard_negatives is false; the pairs are a `PairsDataset`
built from the rows, like the user's text pairs.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.frozen import EmbeddingTable
from titan_contrastive.datasets.pairs import PairsDataset

BUNDLE_DIR = Path(__file__).resolve().parents[1] / "assets" / "wordnet"


def load_rows(folder: Path, split: str) -> list[list[str]]:
    """The split's rows: [definition, lemma] or [definition, lemma, negative lemma], all one width."""
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
    if not rows or len({len(r) for r in rows}) != 1 or len(rows[0]) not in (2, 3) or not all(all(r) for r in rows):
        raise DataError(
            f"{file}: every line must be 'definition<TAB>lemma' or 'definition<TAB>lemma<TAB>negative lemma', all "
            "lines of a file alike; rebuild it with scripts/build_wordnet_pairs.py"
        )
    return rows


def load_pairs(folder: Path, split: str) -> tuple[list[str], list[str]]:
    """The split's definitions and their lemmas (without any negatives)."""
    rows = load_rows(folder, split)
    return [r[0] for r in rows], [r[1] for r in rows]


def build_wordnet(
    split: str,
    *,
    path: str = "",
    context_length: int = 32,
    tokenizer: Any = None,
    hard_negatives: bool = True,
    frozen: EmbeddingTable | None = None,
    group: Any = None,
    **_: Any,
) -> PairsDataset:
    if tokenizer is None:
        raise DataError(
            "data.dataset='wordnet' is text-to-text and needs a model family with a tokenizer: "
            "use model.name='bi_encoder'"
        )
    folder = Path(path) if path else BUNDLE_DIR
    return PairsDataset.from_rows(
        load_rows(folder, split),
        name="wordnet",
        split=split,
        source=str(folder),
        tokenizer=tokenizer,
        query_length=context_length,
        hard_negatives=hard_negatives,
        frozen=frozen,
        group=group,
    )
