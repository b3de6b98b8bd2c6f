"""`datasets/text_index.py`: the (side, text) -> row index of a table of embeddings, against a dict written here:
each key's first row, the repeated rows and their first, keys the table lacks, and digests whose high halves collide
(forced), so the binary search and its run scan are both exercised."""

from __future__ import annotations

import random

import numpy as np
import pytest

from titan_contrastive.datasets import text_index
from titan_contrastive.datasets.text_index import TextIndex


def _keys(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """`n` keys of three sides, about a fifth of them repeats of an earlier one."""
    rng = random.Random(seed)
    keys: list[tuple[str, str]] = []
    for i in range(n):
        if keys and rng.random() < 0.2:
            keys.append(rng.choice(keys))
        else:
            keys.append((rng.choice(["query", "document", ""]), f"text {i} {rng.random():.6f}"))
    return keys


def _want(keys: list[tuple[str, str]]) -> tuple[dict, list[int], list[int]]:
    first: dict[tuple[str, str], int] = {}
    later, of_first = [], []
    for row, key in enumerate(keys):
        if key in first:
            later.append(row)
            of_first.append(first[key])
        else:
            first[key] = row
    return first, later, of_first


def _check(keys: list[tuple[str, str]]) -> None:
    index, later, first = TextIndex.of(keys)
    want, want_later, want_first = _want(keys)
    assert later.tolist() == want_later and first.tolist() == want_first
    assert len(index.rows) == len(want) and index.sides == {side for side, _ in keys}
    missing = [(side, text + " (not in the table)") for side, text in keys[:50]] + [("image", keys[0][1])]
    probe = [*keys, *missing]
    random.Random(1).shuffle(probe)
    assert index.find(probe).tolist() == [want.get(key, -1) for key in probe]
    assert index.find([]).shape == (0,)


def test_every_key_finds_its_first_row_and_no_other() -> None:
    _check(_keys(3000))


def test_digests_whose_high_halves_collide_are_told_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every high half cut to 3 bits: runs of hundreds of keys per high value, told apart by the low half."""
    digests = text_index.digests

    def colliding(keys):
        high, low = digests(keys)
        return high & np.uint64(7), low

    monkeypatch.setattr(text_index, "digests", colliding)
    keys = _keys(2000, seed=2)
    index = TextIndex.of(keys)[0]
    assert len(np.unique(index.high)) <= 8
    _check(keys)


def _first_seen_as_a_set_does(batches: int, keys: int) -> None:
    rng = random.Random(3)
    seen, first = set(), text_index.FirstSeen()
    for _ in range(batches):
        batch = [f"k{rng.randrange(keys)}é" for _ in range(rng.choice([0, 1, 7, 40]))]
        want = []
        for key in batch:
            want.append(key not in seen)
            seen.add(key)
        assert first.new(batch).tolist() == want
        sizes = [len(high) for high, _ in first.runs]
        assert all(a >= 2 * b for a, b in zip(sizes, sizes[1:])) and sum(sizes) == len(seen)
        assert all(np.all(high[1:] >= high[:-1]) for high, _ in first.runs)
    assert len(first.runs) <= 5 and len(seen) > 0.75 * keys


def test_first_seen_tells_each_key_s_first_coming_as_a_set_does() -> None:
    """Batches of ragged sizes (empty ones too), keys repeated within a batch and across batches: `FirstSeen.new`
    against a Python set, over enough batches that its runs merge many times."""
    _first_seen_as_a_set_does(300, 2000)


def test_first_seen_tells_keys_apart_whose_high_halves_collide(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every high half cut to 2 bits: runs of hundreds of keys per high value in each run, told apart by the low
    half."""
    hashed = text_index.hashed

    def colliding(texts):
        high, low = hashed(texts)
        return high & np.uint64(3), low

    monkeypatch.setattr(text_index, "hashed", colliding)
    _first_seen_as_a_set_does(300, 2000)
