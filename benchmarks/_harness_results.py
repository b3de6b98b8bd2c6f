"""Run metadata and result files, the output half of benchmarks/harness.py (which re-exports all of it;
benchmarks import `harness`, not this module). Imports only torch and the standard library (matplotlib
lazily, for figures).

Metadata (`metadata`): date, device, CPU model and core counts, torch / CUDA / Python versions, torch
threads, the repository's commit (`git rev-parse HEAD` where git and the .git folder are there, else
$BENCH_COMMIT), the command line, the load average. `package_at` extracts an earlier revision's package,
for a benchmark that runs its code beside this tree's.

Files (`write_results`): NAME.json ({"meta": ..., payload..., "rows": ...}), NAME.csv (the rows plus
meta_* columns) and NAME.png (stamped with the metadata), under benchmarks/results unless the
benchmark's --out says otherwise.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
META_COLUMNS = ("date", "commit", "device", "torch")  # repeated on every CSV row as meta_<key>


# ---------------------------------------------------------------- metadata


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_name(device: torch.device | str | None = None) -> str:
    """The CUDA device's name, or "CPU"."""
    dev = torch.device(device) if device is not None else default_device()
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def git_commit(tree: Path = REPO) -> dict[str, Any]:
    """{"commit": HEAD of `tree`, "commit_dirty": tracked files changed}. $BENCH_COMMIT, when set, names the
    commit instead (a copy of the work tree on a lent machine: it may carry no .git, or the .git of an older
    commit under newer files)."""
    if os.environ.get("BENCH_COMMIT"):
        return {"commit": os.environ["BENCH_COMMIT"], "commit_dirty": None}

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", "--no-optional-locks", "-C", str(tree), *args],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip()

    commit = git("rev-parse", "HEAD")
    if not commit:
        return {"commit": None, "commit_dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "commit_dirty": None if status is None else bool(status)}


def package_at(revision: str, into: Path, repo: Path = REPO) -> Path:
    """The `titan_contrastive` package of git `revision` extracted under `into` (git archive; the work tree
    and the installed package untouched); `into`. ValueError naming the revision when git cannot read it."""
    done = subprocess.run(
        ["git", "-C", str(repo), "archive", "--format=tar", revision, "titan_contrastive"], capture_output=True
    )
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()
        raise ValueError(
            f"--baseline {revision}: git cannot read that revision in {repo} ({why[-1] if why else 'no git'}); "
            "name a commit this clone has (git log), or leave --baseline out"
        )
    tar = into / "package.tar"
    tar.write_bytes(done.stdout)
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    tar.unlink()
    return into


def metadata(device: torch.device | str | None = None, **extra: Any) -> dict[str, Any]:
    """What a result needs to be read later: when, on what, with which code. `extra` is added."""
    dev = torch.device(device) if device is not None else default_device()
    cores = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(dev),
        "cpu": cpu_model(),
        "cores": cores,
        "cores_usable": usable,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        **git_commit(),
        "command": " ".join(getattr(sys, "orig_argv", [sys.executable, *sys.argv])),
        "loadavg_1_5_15min": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "CUDA_VISIBLE_DEVICES")},
        **extra,
    }


def stamp(meta: Mapping[str, Any]) -> str:
    """One line of metadata for a figure."""
    commit = meta.get("commit")
    code = "no git" if not commit else commit[:10] + ("+changes" if meta.get("commit_dirty") else "")
    device = meta.get("device", "?")
    if device == "CPU":
        device = f"{meta.get('cpu', 'CPU')}, {meta.get('cores')} cores"
    return f"{device} | torch {meta.get('torch')} | {code} | {str(meta.get('date', ''))[:16]}"


# ---------------------------------------------------------------- result files


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)  # Path, argparse values and the like


def write_json(path: Path | str, meta: Mapping[str, Any], payload: Mapping[str, Any] | None = None) -> Path:
    """{"meta": meta, **payload} as indented JSON at `path` (folders made)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": dict(meta), **(payload or {})}, indent=1, default=_jsonable) + "\n")
    return path


def write_csv(
    path: Path | str,
    rows: Iterable[Mapping[str, Any]],
    meta: Mapping[str, Any] | None = None,
    fields: Sequence[str] | None = None,
) -> Path:
    """`rows` as CSV at `path`: `fields` (default: every key, first seen first), lists and dicts as JSON
    text, then the meta_* columns (META_COLUMNS) from `meta`."""
    path, rows = Path(path), list(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(fields) if fields is not None else list(dict.fromkeys(k for row in rows for k in row))
    extra = {f"meta_{k}": (meta or {}).get(k, "") for k in META_COLUMNS} if meta is not None else {}
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*fields, *extra], extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            cells = {
                k: json.dumps(v, default=_jsonable) if isinstance(v, (list, tuple, dict)) else v
                for k, v in row.items()
                if k in fields
            }
            writer.writerow({**cells, **extra})
    return path


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (imported only when a figure is drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path | str, meta: Mapping[str, Any] | None = None, dpi: int = 120) -> Path:
    """Save `fig` as `path` with the metadata stamped below it, and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    if meta is not None:
        fig.text(0.5, -0.005, stamp(meta), ha="center", va="top", fontsize=7, color="0.35")
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    pyplot().close(fig)
    return path


def write_results(
    out: Path | str,
    name: str,
    meta: Mapping[str, Any],
    payload: Mapping[str, Any] | None = None,
    *,
    rows: Sequence[Mapping[str, Any]] | None = None,
    fields: Sequence[str] | None = None,
    rows_key: str = "rows",
    figure: Callable[[], Any] | None = None,
    dpi: int = 120,
) -> list[Path]:
    """One benchmark's file set under `out`: NAME.json ({"meta", **payload, rows_key: rows}), NAME.csv when
    there are rows, NAME.png when `figure()` returns a figure. Returns the paths written."""
    out = Path(out)
    body = {**(payload or {}), **({rows_key: list(rows)} if rows is not None else {})}
    paths = [write_json(out / f"{name}.json", meta, body)]
    if rows:
        paths.append(write_csv(out / f"{name}.csv", rows, meta, fields))
    fig = figure() if figure is not None else None
    if fig is not None:
        paths.append(save_figure(fig, out / f"{name}.png", meta, dpi))
    return paths
