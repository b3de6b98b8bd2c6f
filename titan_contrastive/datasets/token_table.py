"""Texts tokenized once each and kept unpadded: a text-pairs set's queries and documents (`pairs.PairsDataset`).

A FlagEmbedding or tevatron file names the same passages as hard negatives of many queries, and most texts are far
shorter than the length they are padded to. Tokenized and padded row by row, such a file's documents take
rows x documents x length x 8 bytes. `TokenTable` tokenizes each distinct text once, keeps its ids unpadded in one
int32 array, and pads the rows a batch asks for as the tokenizer pads them (`tokenizer.padded`): a batch is the same
int64 tensor, bit for bit, that tokenizing every text at load and padding it gave. Texts come as an iterable and are
tokenized `CHUNK` distinct texts at a time, so no list of every text's ids is ever held.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from itertools import chain

import numpy as np
import torch

from titan_contrastive.datasets.tokenizer import PairTokenizer, padded

__all__ = ["TokenTable"]

CHUNK = 8192
"""Distinct texts tokenized in one call."""


class TokenTable:
    """`texts`' token ids through `tokenizer` at `length` (each text exactly as it is tokenized: its prompt already
    before it); `table[places]` is int64 [*places.shape, length], the padded ids of the texts at those places of
    `texts`, and `len(table)` how many texts came."""

    def __init__(self, tokenizer: PairTokenizer, texts: Iterable[str], length: int) -> None:
        self.length, self._pad, self._left = length, tokenizer.pad_value, tokenizer.pad_left
        distinct: dict[str, int] = {}
        places, waiting, parts, lengths = array("q"), [], [], array("q")

        def tokenize() -> None:
            rows = tokenizer.token_rows(waiting, length)
            lengths.extend(len(r) for r in rows)
            parts.append(np.fromiter(chain.from_iterable(rows), dtype=np.int32, count=sum(map(len, rows))))
            waiting.clear()

        for text in texts:
            at = distinct.get(text)
            if at is None:
                at = distinct[text] = len(distinct)
                waiting.append(text)
                if len(waiting) == CHUNK:
                    tokenize()
            places.append(at)
        if waiting:
            tokenize()
        self._places = torch.frombuffer(places, dtype=torch.int64) if places else torch.zeros(0, dtype=torch.int64)
        self._lengths = torch.tensor(np.frombuffer(lengths, dtype=np.int64) if lengths else [], dtype=torch.int64)
        self._starts = self._lengths.cumsum(0) - self._lengths
        self._ids = torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32))
        self.distinct = len(distinct)
        """How many distinct texts the table holds."""

    def __len__(self) -> int:
        return len(self._places)

    def __getitem__(self, places: torch.Tensor) -> torch.Tensor:
        text = self._places[places]
        return padded(self._ids, self._starts[text], self._lengths[text], self.length, self._pad, self._left)

    @property
    def nbytes(self) -> int:
        """The memory the table keeps."""
        return sum(t.nbytes for t in (self._places, self._lengths, self._starts, self._ids))
