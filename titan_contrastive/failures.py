"""Which error of a run gives which exit code (`exit_codes.py`), and its one `error: ...` line."""

from __future__ import annotations

import sys
from collections.abc import Callable

from titan_contrastive.checkpoint import CheckpointError
from titan_contrastive.components.memory_planner import MemoryBudgetError
from titan_contrastive.components.nonfinite import NonFiniteError
from titan_contrastive.config import ConfigError
from titan_contrastive.datasets import DataError
from titan_contrastive.exit_codes import BAD_INPUT, COLLECTIVE, NONFINITE
from titan_contrastive.models import ModelRegistryError
from titan_contrastive.models.weights import WeightsError
from titan_contrastive.parallelisms import collective_failure

__all__ = ["report"]


def report(error: BaseException, resume_hint: Callable[[], str] = str) -> int | None:
    """Print the one `error: ...` line of a known failure and return its code; None for anything
    else (a bug: let its traceback through). `resume_hint()` ends a non-finite stop's line with the
    checkpoint to go back to."""
    if isinstance(
        error, (ConfigError, DataError, CheckpointError, ModelRegistryError, MemoryBudgetError, WeightsError)
    ):
        line, code = str(error), BAD_INPUT
    elif isinstance(error, NonFiniteError):
        line, code = f"{error}{resume_hint()}", NONFINITE
    elif (
        isinstance(error, RuntimeError) and (failure := collective_failure(error)) is not None
    ):  # timed out or lost a peer
        line, code = failure, COLLECTIVE
    else:
        return None
    print(f"error: {line}", file=sys.stderr)
    return code
