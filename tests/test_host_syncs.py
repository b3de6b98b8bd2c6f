"""The call-site naming of `components.host_syncs` (the sync debug mode itself needs CUDA: tests/test_gpu.py)."""

from __future__ import annotations

from pathlib import Path

import titan_contrastive
from titan_contrastive.components.host_syncs import _site

PACKAGE = Path(titan_contrastive.__file__).parent


def test_a_sync_is_named_by_the_innermost_frame_of_the_package() -> None:
    stack = [
        ("/usr/lib/python3.12/runpy.py", "_run_module_as_main"),
        (str(PACKAGE / "train.py"), "Trainer.train_step"),
        (str(PACKAGE / "steps" / "gradcache.py"), "GradCacheStep.__call__"),
        ("/site-packages/torch/_tensor.py", "Tensor.item"),
        ("/usr/lib/python3.12/warnings.py", "_showwarnmsg"),
    ]
    assert _site(stack) == "steps/gradcache.py:GradCacheStep.__call__"


def test_a_sync_outside_the_package_is_named_by_its_own_frame() -> None:
    stack = [("/bench/run.py", "main"), ("/site-packages/torch/cuda/__init__.py", "synchronize")]
    assert _site([*stack, ("/usr/lib/python3.12/warnings.py", "warn")]) == "__init__.py:synchronize"


def test_the_recorder_is_not_a_site() -> None:
    recorder = (str(PACKAGE / "components" / "host_syncs.py"), "sync_sites.<locals>.record")
    stack = [(str(PACKAGE / "steps" / "accumulate.py"), "AccumulateStep.__call__"), recorder]
    assert _site(stack) == "steps/accumulate.py:AccumulateStep.__call__"
