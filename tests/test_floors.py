"""pyproject.toml's floors are the versions `scripts/floors.txt` pins, the file the suite is run with
at every floor (docs/testing.md#the-floors): a floor raised or lowered in one and not the other
fails here, so neither claims a version nobody ran. torch's floor is checked on import instead
(tests/test_imports.py)."""

from __future__ import annotations

import re
from pathlib import Path

from titan_contrastive.config.manager import tomllib

REPO = Path(__file__).resolve().parents[1]
REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*(>=|==)\s*([^;,\s]+)\s*(;.*)?$")


def floors_in(requirements: list[str]) -> dict[str, str]:
    """name -> version of every `name>=version` (not `==`, a pin; not one for another Python)."""
    found = {}
    for line in requirements:
        m = REQUIREMENT.match(line)
        if m and m[2] == ">=" and not m[4]:
            found[m[1].lower()] = m[3]
    return found


def test_every_floor_is_pinned_in_scripts_floors_txt() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = [
        *project["dependencies"],
        *(r for extra in project["optional-dependencies"].values() for r in extra),
    ]
    floors = floors_in(requirements)
    floors.pop("torch")  # its floor is MIN_TORCH (tests/test_imports.py)
    assert len(floors) >= 15, floors  # the parser read them all
    pins = {}
    for line in (REPO / "scripts" / "floors.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            m = REQUIREMENT.match(line)
            assert m and m[2] == "==", f"scripts/floors.txt: {line!r} is not name==version"
            pins[m[1].lower()] = m[3]
    # a floor written short (2.15) is the release pinned in full (2.15.0)
    short = {
        name: v for name, v in pins.items() if name in floors and re.fullmatch(rf"{re.escape(floors[name])}(\.0)*", v)
    }
    assert short == pins and pins.keys() == floors.keys(), (
        f"pyproject.toml floors {floors} against scripts/floors.txt pins {pins}"
    )


def test_the_parser_reads_floors_pins_and_markers() -> None:
    assert floors_in(["a>=1.2", "b==3", "c", "d>=2; python_version < '3.11'", "E_f>=0.4.3  "]) == {
        "a": "1.2",
        "e_f": "0.4.3",
    }
