"""Parameters of which some run only with the slow marker: where a test's matrix is longer than the default suite's
time allows (docs/testing.md#processes-and-markers), the cases whose features other default cases already cover run with
`-m slow`, which CI runs too."""

from __future__ import annotations

from collections.abc import Iterable

import pytest


def slow_ones(values: Iterable[object], slow: Iterable[object]) -> list[object]:
    """`values` as a parametrize list, those in `slow` under the slow marker; a tuple value is one case of several
    argument names."""
    slow = set(slow)
    unknown = slow - set(values := list(values))
    if unknown:  # a renamed case would otherwise run by default unnoticed
        raise ValueError(f"slow cases {sorted(map(str, unknown))} are not among the parameters {values}")
    return [
        pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.slow) if v in slow else v for v in values
    ]
