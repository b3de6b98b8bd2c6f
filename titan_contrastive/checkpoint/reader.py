"""The one way a checkpoint folder is read: verified against its manifest, unpickled without code.

Every reader of our step folders goes through here: resume (`CheckpointManager.load`),
`[model] init_from`, `export` and `models.weights.read_ours` (and the families' readers built on it).

Trust model: nothing read from a checkpoint can run code, and nothing corrupted is used.
- Integrity. `validate` checks the folder against its `manifest.json` before anything else is
  read: every listed file present with its size, then its SHA-256, and DCP's `.metadata` among
  them. A truncated, half-deleted or corrupted-in-place file (flipped bytes, same size) is an
  error naming the file. A DCP folder without a manifest cannot be verified and is refused;
  manifests that record sizes only (no checksums) still load, with a warning that their
  content is unverified. The manifest guards against accidents, not against an attacker, who
  can recompute it: that is what the next point is for.
- No code. Pickle runs whatever callables a file names, so each pickled piece is read with an
  allowlist of the globals it may name, and anything else is refused with a one-line error:
  DCP's `.metadata` (`SafeFileSystemReader`: DCP's own reader uses `pickle.load`), the byte items
  DCP stores for non-tensor values (`SafeLoadPlanner`: `torch.load(weights_only=True)` instead of
  DCP's `weights_only=False`), and the per-rank states (`unpickle_state`). Tensors in `.distcp`
  files are already read by DCP with `weights_only=True`. DCP's `.metadata` and the per-rank
  states are plain pickles of protocol 4, whose opcodes torch's weights-only unpickler does not
  implement (it reads torch.save's protocol 2), hence `RestrictedUnpickler`: Python's own
  unpickler with `find_class` answering only from an allowlist, the restriction the `pickle`
  documentation gives. Only the files the manifest lists are read (`.metadata` cannot send DCP
  elsewhere), and a stored item must have the kind the loading state expects: a pickled object
  or a non-float tensor where the model has a float tensor is refused rather than loaded.
Weights in other formats (`models.weights`): safetensors holds no code, `.bin`/`.pt` files load with
`torch.load(weights_only=True)`, configs are JSON.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import pathlib
import pickle
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

__all__ = [
    "MANIFEST",
    "METADATA",
    "CheckpointError",
    "RestrictedUnpickler",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "describe",
    "load",
    "sha256",
    "unpickle_state",
    "validate",
    "verify",
]

logger = logging.getLogger("titan_contrastive")

MANIFEST = "manifest.json"
METADATA = ".metadata"  # DCP's index of a checkpoint (what is stored where): a pickled `Metadata`


class CheckpointError(ValueError):
    """A checkpoint cannot be saved, verified or loaded; the message names it and what is wrong."""


def sha256(path: Path) -> str:
    """The file's SHA-256, read in 4 MiB blocks (checkpoint files can be many GB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def describe(exc: BaseException) -> str:
    """One line for an exception; for DCP's CheckpointException, each failing rank's error."""
    if isinstance(exc, CheckpointException):
        return "; ".join(f"rank {rank}: {describe(error)}" for rank, (error, _) in sorted(exc.failures.items()))
    if isinstance(exc, CheckpointError):  # already says what is wrong with which file
        return " ".join(str(exc).split())
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


# ------------------------------------------------------------------ unpickling without code


def _load_storage(data: bytes) -> Any:
    """Stands in for `torch.storage._load_from_bytes`, through which a plainly pickled tensor
    carries its storage (a torch.save file): the same file, read with `weights_only=True`
    (torch's version reads it with `weights_only=False`, which runs code)."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


# What DCP's `.metadata` names: its dataclasses, the entry of each stored piece (`_StorageInfo`),
# tensor sizes, dtypes and layouts, and the path it was saved to (`StorageMeta.checkpoint_id`).
METADATA_GLOBALS: dict[str, Any] = {
    **{
        f"torch.distributed.checkpoint.metadata.{name}": getattr(dcp_metadata, name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    },
    "torch.distributed.checkpoint.filesystem._StorageInfo": dcp_filesystem._StorageInfo,
    "torch.Size": torch.Size,
    "torch.serialization._get_layout": torch.serialization._get_layout,
    **{f"torch.{name}": value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
    "pathlib.PosixPath": pathlib.PosixPath,
    "pathlib._local.PosixPath": pathlib.PosixPath,  # its module from Python 3.13
}

# What a per-rank state names (`CheckpointManager`'s pickled data-loader and RNG states): the
# loader's state is builtins only; an RNG state is a uint8 tensor, pickled as a rebuild call
# (`_rebuild_tensor_v2`, with an OrderedDict of backward hooks) over a storage.
STATE_GLOBALS: dict[str, Any] = {
    "torch._utils._rebuild_tensor_v2": torch._utils._rebuild_tensor_v2,
    "collections.OrderedDict": OrderedDict,
    "torch.storage._load_from_bytes": _load_storage,
}


class RestrictedUnpickler(pickle.Unpickler):
    """Python's unpickler that resolves a global only from `allowed` ("module.name" -> object).

    Unpickling runs code only through the globals a pickle names (a callable it calls, a class
    whose `__setstate__` it runs), and every global goes through `find_class`, so a pickle that
    names anything else stops there, before anything is called. Persistent ids are refused too.
    """

    def __init__(self, file: Any, allowed: Mapping[str, Any]) -> None:
        super().__init__(file)
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[f"{module}.{name}"]
        except KeyError:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which is not on the allowlist") from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent id, which is not allowed")


def _refused(what: str, exc: BaseException) -> CheckpointError:
    reason = str(exc) if isinstance(exc, pickle.UnpicklingError) else describe(exc)
    if "WeightsUnpickler error:" in reason:  # torch's weights-only message: keep its reason, not its advice
        reason = (
            reason.split("WeightsUnpickler error:", 1)[1].split("Check the documentation")[0].split(". Please use")[0]
        )
    return CheckpointError(
        f"{what}: refused to unpickle: {' '.join(reason.split())}; unpickling that could run code, which "
        "the checkpoints this project writes never need (the file was altered or written by something else)"
    )


def restricted_loads(data: bytes, allowed: Mapping[str, Any], what: str) -> Any:
    """`pickle.loads(data)` naming only `allowed` globals; anything else is a CheckpointError."""
    try:
        return RestrictedUnpickler(io.BytesIO(data), allowed).load()
    except Exception as exc:  # noqa: BLE001 - damaged or hostile data: any failure is the file's
        raise _refused(what, exc) from None


def unpickle_state(data: bytes, what: str) -> Any:
    """A per-rank state as `CheckpointManager` pickles it (builtins and CPU tensors)."""
    return restricted_loads(data, STATE_GLOBALS, what)


# ------------------------------------------------------------------ DCP reader and planner


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader that unpickles `.metadata` with `METADATA_GLOBALS` only, and reads
    only `files` (the manifest's list) when given."""

    def __init__(self, path: str | Path, files: Iterable[str] | None = None) -> None:
        super().__init__(path)
        self.files = None if files is None else set(files)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # a rank-local `__N.metadata`: not written by this project
            raise CheckpointError(f"{self.path}: reads only the global {METADATA}")
        if self._metadata is None:
            path = Path(self.path) / METADATA
            metadata = restricted_loads(path.read_bytes(), METADATA_GLOBALS, str(path))
            if not isinstance(metadata, Metadata):
                raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP's Metadata")
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            self._metadata = metadata
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        for index, info in dict(self.storage_data).items():
            if not isinstance(info, dcp_filesystem._StorageInfo) or (
                self.files is not None and info.relative_path not in self.files
            ):
                where = getattr(info, "relative_path", info)
                raise CheckpointError(
                    f"{self.path}/{METADATA}: stores {getattr(index, 'fqn', index)!r} in {where!r}, "
                    f"which {MANIFEST} does not list"
                )


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's DefaultLoadPlanner that reads byte items with `weights_only=True` and refuses an item
    whose kind does not fit the state it loads into (see the module docstring). `optional`: the
    states a checkpoint may lack (written before they existed), which keep their values."""

    def __init__(self, optional: tuple[str, ...] = ()) -> None:
        super().__init__(allow_partial_load=bool(optional))
        self.optional = tuple(f"{name}." for name in optional)

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        stored = self.metadata.state_dict_metadata if self.metadata is not None else {}
        lacking = [fqn for fqn in self.state_dict if fqn not in stored and not fqn.startswith(self.optional)]
        if lacking:
            raise RuntimeError(f"Missing key in checkpoint state_dict: {lacking[0]}.")  # as DCP's own refusal
        for fqn, value in self.state_dict.items():
            entry = stored.get(fqn)
            if not isinstance(value, torch.Tensor) or entry is None:
                continue
            if isinstance(entry, BytesStorageMetadata):
                raise CheckpointError(f"checkpoint item {fqn!r} is a pickled object where a tensor is expected")
            if (
                isinstance(entry, TensorStorageMetadata)
                and value.is_floating_point()
                and not entry.properties.dtype.is_floating_point
            ):
                raise CheckpointError(
                    f"checkpoint item {fqn!r} is {entry.properties.dtype}, the model's tensor is {value.dtype}: "
                    "floating-point weights stored as integers are not loaded (a damaged or foreign checkpoint)"
                )
        return plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - damaged or hostile data
            raise _refused(f"checkpoint item {fqn!r}", exc) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


# ------------------------------------------------------------------ manifest, verification, loading


def _entries(files: Any) -> dict[str, dict[str, Any]]:
    """The manifest's files as {name: {"bytes", ["sha256"]}} (sizes-only manifests list ints)."""
    if not isinstance(files, dict) or not files:
        raise ValueError("lists no files")
    entries = {}
    for name, entry in files.items():
        entry = entry if isinstance(entry, dict) else {"bytes": entry}
        parts = pathlib.PurePosixPath(name).parts
        if not isinstance(entry.get("bytes"), int) or not isinstance(entry.get("sha256", ""), str):
            raise TypeError(f"its entry for {name!r} is not {{'bytes': int, 'sha256': str}}")
        if not parts or parts[0] == "/" or ".." in parts:
            raise ValueError(f"it lists {name!r}, a path outside the checkpoint folder")
        entries[name] = entry
    return entries


def validate(folder: Path, step: int | None = None) -> tuple[dict[str, Any] | None, str]:
    """(manifest, "") for a checkpoint folder whose files match its manifest (sizes, then
    SHA-256), else (None, what is wrong); `step`: the step the manifest must be for."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        saved_step, _, _ = int(manifest["step"]), int(manifest["dp_degree"]), int(manifest["world_size"])
        entries = _entries(manifest["files"])
    except FileNotFoundError:
        return None, f"{MANIFEST} is missing"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return None, f"{MANIFEST} is unreadable ({type(exc).__name__}: {exc})"
    if step is not None and saved_step != step:
        return None, f"{MANIFEST} is for step {saved_step}"
    if METADATA not in entries:
        return None, f"{MANIFEST} does not list {METADATA}, DCP's index of the checkpoint"
    wrong = []
    for name, entry in entries.items():  # sizes first: cheap, and a truncated file needs no hashing
        file = folder / name
        if not file.is_file():
            wrong.append(f"{name} is missing")
        elif file.stat().st_size != entry["bytes"]:
            wrong.append(f"{name} has {file.stat().st_size} bytes, {MANIFEST} says {entry['bytes']}")
    if not wrong:
        wrong = [
            f"{name}: its content does not match the sha256 in {MANIFEST} (corrupted in place)"
            for name, entry in entries.items()
            if "sha256" in entry and sha256(folder / name) != entry["sha256"]
        ]
    if wrong:
        return None, "; ".join(wrong[:3]) + (f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else "")
    unverified = sorted(name for name, entry in entries.items() if "sha256" not in entry)
    if unverified:
        logger.warning(
            f"checkpoint {folder}: {MANIFEST} has sizes but no sha256 for {', '.join(unverified[:3])}"
            f"{' ...' if len(unverified) > 3 else ''} (written by an older version): their content is unverified"
        )
    return manifest, ""


def verify(folder: str | Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder that `validate` accepts; else a one-line CheckpointError."""
    folder = Path(folder)
    manifest, problem = validate(folder)
    if manifest is not None:
        return manifest
    if not (folder / MANIFEST).exists():
        if (folder / METADATA).is_file():
            raise CheckpointError(
                f"{folder}: DCP checkpoint files without {MANIFEST}, so they cannot be verified (sizes, sha256) "
                "and are not read; give a step-N folder written by this project's checkpointing"
            )
        raise CheckpointError(f"{folder}: no {MANIFEST}; not a step-N folder written by this project's checkpointing")
    raise CheckpointError(f"checkpoint {folder} is corrupt: {problem}")


def load(
    state_dict: dict[str, Any],
    folder: str | Path,
    manifest: dict[str, Any],
    *,
    what: str | None = None,
    distributed: bool = False,
    optional: tuple[str, ...] = (),
) -> None:
    """`dcp.load(state_dict)` from a folder `verify`/`validate` accepted (collective when
    `distributed`), through `SafeFileSystemReader` and `SafeLoadPlanner` (`optional`: its states a
    checkpoint may lack); any failure is one CheckpointError line starting with `what` (default:
    "loading checkpoint FOLDER")."""
    folder = Path(folder)
    reader = SafeFileSystemReader(folder, _entries(manifest["files"]))
    what = what or f"loading checkpoint {folder}"
    try:
        reader.read_metadata()  # here rather than in DCP, which logs a failure with a traceback and tries another file
        with warnings.catch_warnings():  # no_dist is intended when not distributed
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(optional), no_dist=not distributed)
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"{what} failed: {describe(exc)}") from exc
