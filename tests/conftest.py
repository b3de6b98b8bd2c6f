"""Session-wide test setup.

Without CUDA, Triton kernels run in Triton's interpreter. The switch must be set before anything
imports triton (torch.compile's inductor does, in other tests), because triton reads it once.
After collection the imported objects are frozen out of the garbage collector's sight.
`guide_dir`: a frozen model folder the guide and teacher-model tests share. `hf_cache`: datasets' cache in the
test's folder, for tests whose code calls load_dataset (it writes one).
"""

import gc
import os
from pathlib import Path

import pytest
import torch

from tests.needs import require

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch, transformers, every test module) lives for the session:
    frozen out of the collector's sight, each collection (automatic, or the trainer's at the end of
    a distributed run) scans what the tests made since, not half a million module objects."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config: pytest.Config) -> None:
    gc.unfreeze()  # the interpreter's last collection sees them again (Triton's bindings count leaks)


@pytest.fixture(scope="session")
def guide_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MiniLM with every weight moved by a third of its spread, saved as a sentence-transformers
    folder: the same tokenizer as the bundled MiniLM, other cosines (a guide's or a teacher's)."""
    require("hf")
    from tests.test_objectives_vs_sentence_transformers import _model, perturbed

    model = perturbed(_model()).float()
    path = tmp_path_factory.mktemp("guide") / "perturbed-minilm"
    model.save(str(path))
    return path


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require("hf")
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
