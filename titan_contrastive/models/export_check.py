"""The faithfulness check every family's export goes through: the written folder is loaded back by
the library it is for and its embeddings of fixed probes must equal the source model's.

Why: the formats carry conventions the weights do not (which token the text pools at, how many
image channels, the pooling and prompts of a sentence-transformers folder), and a folder that
loads without error can still compute other embeddings. Any failure is a one-line `WeightsError`
and `titan_contrastive.export` then installs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch

from titan_contrastive.models.weights import WeightsError

__all__ = ["PROBE_TEXTS", "TOLERANCE", "compare", "packed_tokens", "refuse", "reloaded"]

TOLERANCE = 1e-4
"""Largest difference allowed between the source's and the reloaded export's L2-normalized
embeddings (unit vectors, so absolute and relative at once): float32 rounding of a different
kernel order is ~1e-6; a wrong pooling token or weight is ~1e-1."""
PROBE_TEXTS = ["a photo of a cat", "", "Two dogs, playing in the snow at night! " * 8]


def refuse(message: str) -> NoReturn:
    """Raise `message` as the one-line error of an export that cannot be written faithfully."""
    raise WeightsError(message)


def compare(to: str, what: str, want: torch.Tensor, got: Any, library: str) -> None:
    """Refuse when `library`'s reloaded `what` embeddings (`got`) are not the source's (`want`)."""
    got = torch.as_tensor(got, dtype=torch.float32)
    if got.shape != want.shape:
        refuse(
            f"--to {to}: {library} gives {what} embeddings of shape {tuple(got.shape)}, the source "
            f"{tuple(want.shape)}; the export would change the model, so nothing was written"
        )
    diff = (got - want).abs().max().item()
    if not diff <= TOLERANCE:  # NaN too
        refuse(
            f"--to {to}: reloaded with {library}, the {what} embeddings differ from the source's by up to {diff:.3g} "
            f"(tolerance {TOLERANCE:g}); the export would change the model, so nothing was written"
        )


def reloaded(library: str, load: Callable[[], Any]) -> Any:
    """`load()`, the written folder through `library`; whatever it raises becomes a one-line refusal."""
    try:
        return load()
    except Exception as e:  # noqa: BLE001 - whatever the library raises: the folder it was given does not load
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        refuse(
            f"the written folder does not load back with {library} ({type(e).__name__}: {first}); nothing was written"
        )


def packed_tokens(texts: list[Any], length: int = 0) -> torch.Tensor:
    """[n, max(length, longest), d]: each sample's token vectors first, then zeros, so two libraries' token sets (ours
    keep a left-out token's place as a zero, sentence-transformers' leave it out) compare as one tensor."""
    rows = [torch.as_tensor(t, dtype=torch.float32) for t in texts]
    length = max([length, *(len(t) for t in rows)])
    return torch.stack([torch.nn.functional.pad(t, (0, 0, 0, length - len(t))) for t in rows])
