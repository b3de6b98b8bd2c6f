"""Table rows kept in one bytes object and one NumPy array, which forked DataLoader workers read without copying them.

Rows kept as Python objects (a list of dicts, of tuples, of strings) are copied into every worker that reads them:
reading an object writes its reference count, and the memory page it sits on becomes that worker's own. Over an epoch
each worker of each rank comes to hold a copy of nearly all the rows. `PackedRows` keeps each row as JSON, one row
after another in one bytes object, and where each row ends in an array: there is no object per row, and a worker only
reads the pages it shares with the process that read the file. A row comes back as `json.loads` of its bytes, a fresh
object each time (a string exactly as it went in, a lone surrogate of a JSON escape too).

A row holds what JSON holds: strings, numbers (NaN and the infinities too), None, booleans, lists (a tuple comes back
as a list) and dicts (a key comes back as a string, as JSON writes it). Anything else (bytes, a date, a set) is an
`Unpackable` naming the row.
"""

from __future__ import annotations

import json
import operator
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = ["PackedRows", "Unpackable", "packable"]

_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class Unpackable(TypeError):
    """A row holds a value JSON cannot: `row` is its place among the rows, `value` the row."""

    def __init__(self, row: int, reason: str, value: Any = None) -> None:
        super().__init__(f"row {row}: {reason}")
        self.row, self.value = row, value


class PackedRows(Sequence[Any]):
    """The rows, indexable and iterable as a list of them is; `nbytes` is what they take. `rows` may be a generator:
    each row is packed as it comes and then let go, so a file's rows are never all held as objects at once."""

    def __init__(self, rows: Iterable[Any]) -> None:
        data, ends = bytearray(), array("q")
        for n, row in enumerate(rows):
            try:
                data += _encode(row).encode("utf-8", "surrogatepass")
            except (TypeError, ValueError) as e:
                raise Unpackable(n, str(e), row) from None
            ends.append(len(data))
        self._ends = np.frombuffer(ends, dtype=np.int64) if ends else np.zeros(0, np.int64)
        self._data = data

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        try:
            at = operator.index(index)  # an int, a NumPy or a torch integer
        except TypeError:
            raise TypeError(f"PackedRows take one row at a time (an int), not {type(index).__name__}") from None
        n = len(self._ends)
        j = at + n if at < 0 else at
        if not 0 <= j < n:
            raise IndexError(f"row {index} of {n}")
        start = int(self._ends[j - 1]) if j else 0
        return json.loads(self._data[start : int(self._ends[j])].decode("utf-8", "surrogatepass"))

    @property
    def nbytes(self) -> int:
        return len(self._data) + self._ends.nbytes


def packable(value: Any) -> bool:
    """Whether a row may hold `value` (what JSON holds)."""
    if value is None or isinstance(value, (str, int, float)):
        return True
    if isinstance(value, (list, tuple)):
        return all(map(packable, value))
    return isinstance(value, dict) and all(
        (k is None or isinstance(k, (str, int, float))) and packable(v) for k, v in value.items()
    )
