"""Which of a row's documents an epoch serves: one positive and k negatives (`data.negatives_per_row`).

tevatron and FlagEmbedding train a query that has a list of positives and a longer list of hard
negatives as a group of one positive and k negatives drawn from them (their `train_group_size` − 1).
Here the draw is a function of the seed, the row and the epoch alone, so it is the same on every rank
and in every worker, whatever the rank count, and a resumed run serves what the uninterrupted one would:

- each row's positives, and its negatives, are put in an order once: shuffled by the seed (the train
  split), or kept in the file's order (`seed` None: evaluation, and rows served whole);
- epoch e serves the positive at place e mod P of that order and the negatives at places
  (e·k + j) mod N, j = 0 … k − 1: a window of k that moves by k each epoch (tevatron's), so a row
  holding k or more negatives serves k distinct ones per epoch and, over epochs, each of them equally
  often (to within one); a row holding fewer than k serves them in turn, some twice.

Rows served whole (every row one positive and its k negatives, in order) are the case P = 1, N = k
with no shuffle, so every pairs dataset serves through this one rule.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["Pools"]


class Pools:
    """The documents of rows laid out flat (row by row: its positives, then its negatives) and each
    epoch's choice among them (module docstring)."""

    def __init__(self, positives: Sequence[int], negatives: Sequence[int], k: int, seed: int | None) -> None:
        """`positives`, `negatives`: how many of each row i holds (its documents are the flat places
        `start[i]` on, positives first); `k`: the negatives served per row (0: none); `seed`: the
        shuffle's, None for the file's order."""
        self.positives = torch.as_tensor(positives, dtype=torch.int64)
        self.negatives = torch.as_tensor(negatives, dtype=torch.int64)
        if bool((self.positives < 1).any()) or k and bool((self.negatives < 1).any()):
            raise ValueError("every row needs a positive, and a negative when k > 0")
        sizes = self.positives + self.negatives
        self.start = torch.cumsum(sizes, 0) - sizes
        self.k = k
        self.order = torch.arange(int(sizes.sum()))
        if seed is not None:  # each (row, positives or negatives) group shuffled in place
            row = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
            group = 2 * row + (self.order - self.start[row] >= self.positives[row]).long()
            keys = torch.rand(len(self.order), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
            by_key = torch.argsort(keys)
            self.order = by_key[torch.argsort(group[by_key], stable=True)]

    def __len__(self) -> int:
        """The documents of all rows."""
        return len(self.order)

    def draw(self, rows: torch.Tensor, epoch: int) -> torch.Tensor:
        """int64 [B, 1 + k]: the flat places of the positive and the k negatives that `epoch` serves to
        each of `rows`."""
        start, p, n = self.start[rows], self.positives[rows], self.negatives[rows]
        positive = start + epoch % p
        if not self.k:
            return self.order[positive][:, None]
        window = (epoch * self.k + torch.arange(self.k)) % n.clamp(min=1)[:, None]
        negatives = (start + p)[:, None] + window
        return self.order[torch.cat([positive[:, None], negatives], 1)]
