"""Where a parameter sits in its tower (`ModelSpec.towers`: a name prefix per tower): before the residual blocks
(embeddings, a pre-norm: layer 0), in block i (layer i + 1), or after them (final norms, projections, pooling
heads: layer depth + 1). `[model] unlocked_layers` (`freeze.py`) and `[optimizer] layer_decay` (`optimizer.py`)
read it.

A block's index is the outermost `block(s)`/`layer(s)` number of the name within its tower (Llama's `layers.N`,
BERT's `layer.N`, T5's `block.N`, ours `blocks.N`); a name without one is after the blocks when it is a final
or post norm, a projection or a head, and before them otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["tower_depth", "tower_layer"]

_BLOCK = re.compile(r"\.(?:blocks?|layers?)\.(\d+)\.")  # a residual block's index in its tower (the outermost)
_AFTER = re.compile(r"(?:proj|projection|\.head)(?:\.|$)")  # a projection or pooling head (after the blocks)


def tower_layer(name: str, prefix: str, depth: int) -> int:
    """0 before the blocks, i + 1 in block i, depth + 1 after them (`name` starts with the tower's `prefix`)."""
    match = _BLOCK.search(name[len(prefix) - 1 :])
    if match:
        return int(match.group(1)) + 1
    return depth + 1 if "post" in name or "final" in name or _AFTER.search(name) else 0


def tower_depth(names: Iterable[str], prefix: str) -> int:
    """The number of blocks of the tower at `prefix` (the highest block index of its names, plus one)."""
    indices = [int(m.group(1)) for n in names if n.startswith(prefix) and (m := _BLOCK.search(n[len(prefix) - 1 :]))]
    return max(indices, default=-1) + 1
