"""The structure the step protocol promises, checked on the source (cheap; fails on a regression):
one module owns gradient-sync deferral and one owns the RNG streams (both in `grad_cache/`, which
stands alone; the rest of the project imports them from there), the trainer
stays small and does not know the step kinds, the memory planner does not know the trainer, no
file is huge. The import rules between packages are `tests/test_imports.py`'s."""

from __future__ import annotations

from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "titan_contrastive"
SOURCES = {p.relative_to(PACKAGE).as_posix(): p.read_text() for p in PACKAGE.rglob("*.py")}


@pytest.mark.parametrize(
    "needle, owner", [("set_requires_gradient_sync", "grad_cache/sync.py"), ("get_rng_state", "grad_cache/rng.py")]
)
def test_one_module_owns_it(needle: str, owner: str) -> None:
    assert [name for name, text in SOURCES.items() if needle in text] == [owner]


def test_the_trainer_is_small_and_kind_agnostic() -> None:
    train = SOURCES["train.py"]
    assert len(train.splitlines()) <= 300
    for kind in (
        "AccumulateStep",
        "GradCacheStep",
        "GlobalNegativesStep",
        "PixelStep",
        "StreamingClipStep",
        "GradCache(",
    ):
        assert kind not in train, kind


def test_the_planner_does_not_know_the_trainer() -> None:
    assert "trainer" not in SOURCES["components/memory_planner.py"].lower()


def test_no_module_is_huge() -> None:
    sizes = {name: len(text.splitlines()) for name, text in SOURCES.items()}
    assert max(sizes.values()) <= 500, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
