"""`python -m titan_contrastive.export SRC --to FORMAT --out DIR`: checkpoints for the ecosystem, FORMAT one of hf,
open_clip, sentence-transformers, peft, pylate, colpali, model2vec.

SRC's family decides what it can be written as: the family one of our step-N folders names in
its manifest (FSDP shards are consolidated by DCP on load), else the family whose state-dict
adapter (`ModelSpec.state_dict_adapter`) claims the path; `--to` must be one of its formats.

- clip (`models.clip.state_dict_adapter`; SRC also a Hugging Face CLIP folder or an open_clip
  checkpoint): `--to hf`, what `transformers.CLIPModel` and `CLIPTokenizerFast` load from DIR;
  `--to open_clip`, the layout `open_clip.create_model("local-dir:DIR")` reads.
- bi_encoder (`models.bi_encoder.export`; `--tower query|doc` picks the tower, the same one when
  shared; default the query tower): `--to sentence-transformers`, the tower with its tokenizer, pooling,
  normalization and prompts (a ColBERT run: a MultiVectorEncoder, both sides; a run of two towers without
  `--tower`: a Router of both, `encode_query` and `encode_document`); `--to hf`, the tower as a transformers
  folder; with LoRA both hold the merged weights;
  `--to peft`, the LoRA adapters alone, what `peft.PeftModel.from_pretrained(base, DIR)` loads over
  the run's `[model] path`; `--to pylate`, a ColBERT run as a PyLate folder (both sides). `--layers K`: a run
  trained with `loss.adaptive_layers` cut to its first K layers (`models.bi_encoder.cut`).
- qwen_vl (`models.qwen_vl.export`): `--to sentence-transformers`, the tower (LoRA merged) with its
  processing, a chat template of the run's templates, pooling and Normalize (`encode_query` / `encode_document`
  on texts and images; a ColQwen run's as a MultiVectorEncoder; needs torchvision); `--to hf`, the tower with
  its tokenizer and image processor, what `transformers.AutoModel` loads; `--to peft`, the adapters;
  `--to colpali`, a ColBERT run (ColQwen) as colpali-engine's folder.
- static (`models.static.export`; `--tower`): `--to sentence-transformers`, a StaticEmbedding and a Normalize
  with the run's prompts (two tables without `--tower`: a Router of both); `--to model2vec`, model2vec's own folder
  (no prompts).

What DIR may be, checked before anything is read: a folder that does not exist yet, an empty one,
or (with `--overwrite`) a previous export of this tool, recognised by the `MARKER` file it writes
(format, source and the files written) and holding nothing else. Never, even with `--overwrite`:
the source or a folder holding it, the working directory or a folder holding it, a run folder
(`metrics.jsonl`, `tb/`, the run lock, a checkpoint's `manifest.json` or `step-N/manifest.json`
one or two levels down), a file or a symbolic link. Why: replacing a folder deletes what is in it,
so only what this tool wrote itself may be replaced.

How DIR is written: into a fresh temporary folder beside it (`.DIR.tmp-*`), which is checked and
then renamed into place; a previous export is renamed aside first and removed only once the new
one is in place, and restored if that rename fails. On any failure the temporary folder goes and
DIR is as it was.

What is checked before the rename (faithfulness, `models.export_check`): the written folder is
loaded back by the library it is for and its embeddings of fixed probes must equal the source
model's within `export_check.TOLERANCE`; a model the target format cannot express is a one-line
error naming why, rather than a folder computing something else.

Needs transformers (`pip install -e '.[hf]'`; sentence-transformers for its format).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from titan_contrastive.extras import import_failure
from titan_contrastive.model_card import write_card

FORMATS = ("hf", "open_clip", "sentence-transformers", "peft", "pylate", "colpali", "model2vec")
"""The built-in families' formats; a registered family may add its own (`StateDictAdapter.writes`)."""
MARKER = ".titan_contrastive_export.json"
"""Written last into every export: {"format", "source", "files"}; what `--overwrite` may replace."""
_STEP = re.compile(r"step-\d+")


def _refuse(message: str) -> NoReturn:
    """Raise `message` as the project's one-line WeightsError (imported when needed: torch comes with it)."""
    from titan_contrastive.models.weights import WeightsError

    raise WeightsError(message)


# ------------------------------------------------------------------ where the export goes


def _run_data(folder: Path) -> str | None:
    """What marks `folder` as a run folder or a checkpoint folder (the first found), else None."""
    from titan_contrastive.components.run_lock import LOCK_FILE

    for name in ("metrics.jsonl", LOCK_FILE, "manifest.json"):
        if (folder / name).exists():
            return name
    if (folder / "tb").is_dir():
        return "tb/"
    for pattern in ("step-*/manifest.json", "*/step-*/manifest.json"):
        for found in folder.glob(pattern):
            if _STEP.fullmatch(found.parent.name):
                return found.relative_to(folder).as_posix()
    return None


def _files(folder: Path) -> list[str]:
    """Every non-directory under `folder` (links included, not followed), relative, sorted."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_symlink() or not p.is_dir())


def check_out(out: Path, src: str | Path, overwrite: bool) -> Path:
    """The resolved folder to write, or a one-line InteropError saying why `out` may not be (module
    doc); reads only names and the marker, never weights."""
    out = Path(out).expanduser()
    if out.is_symlink():
        _refuse(
            f"--out {out} is a symbolic link; give the folder itself (export replaces it, never what a link points to)"
        )
    target, source, cwd = out.resolve(), Path(src).expanduser().resolve(), Path.cwd().resolve()
    if target == source or target in source.parents:
        _refuse(f"--out {out} is the source {src} or holds it; export never replaces its source: choose a new folder")
    if target == cwd or target in cwd.parents:
        _refuse(f"--out {out} ({target}) is the working directory or holds it; choose a new folder")
    if not target.exists():
        return target
    if not target.is_dir():
        _refuse(f"--out {out} is a file; choose a new or empty folder")
    if not any(target.iterdir()):
        return target
    found = _run_data(target)
    if found:
        _refuse(
            f"--out {out} holds {found}: a run or checkpoint folder, which export never replaces (not even with "
            "--overwrite); choose a new folder"
        )
    marker = target / MARKER
    if not marker.is_file():
        if overwrite:
            _refuse(
                f"--out {out} holds files this exporter did not write (no {MARKER}); --overwrite replaces only a "
                "previous export: choose a new or empty folder"
            )
        _refuse(f"--out {out} is not empty; choose a new or empty folder (or --overwrite to replace a previous export)")
    if not overwrite:
        _refuse(f"--out {out} holds a previous export; pass --overwrite to replace it, or choose a new folder")
    try:
        listed = set(json.loads(marker.read_text())["files"]) | {MARKER}
    except (OSError, ValueError, KeyError, TypeError):
        _refuse(f"--out {out}: {MARKER} is unreadable, so what the folder holds is unknown; choose a new folder")
    extra = [f for f in _files(target) if f not in listed]
    if extra:
        _refuse(
            f"--out {out} holds {extra[0]}{f' and {len(extra) - 1} more' if len(extra) > 1 else ''}, which the "
            "previous "
            "export did not write; --overwrite replaces only an export's own files: move them or choose a new folder"
        )
    return target


def _install(tmp: Path, target: Path) -> None:
    """Rename `tmp` to `target`; an existing (empty or previous-export) `target` is set aside first,
    removed after, and put back when the rename fails."""
    aside = None
    if target.exists():
        aside = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(target, aside)
    try:
        os.rename(tmp, target)
    except OSError:
        if aside is not None:
            os.rename(aside, target)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
        if aside.exists():
            print(
                f"warning: the previous export, set aside at {aside}, could not be removed completely", file=sys.stderr
            )


def export(src: str, out: Path, to: str, *, tower: str | None = None, overwrite: bool = False, layers: int = 0) -> Path:
    """Write `src` as a `to` folder at `out` (module doc: refusals, temporary folder, faithfulness check); `layers`:
    cut to that many layers (a writer that takes `layers`: the bi_encoder's)."""
    target = check_out(out, src, overwrite)
    write = writer(src, to)
    if layers and "layers" not in inspect.signature(write).parameters:
        _refuse(f"--layers {layers}: cuts a bi_encoder run trained with loss.adaptive_layers; {src} is not one")
    options = {"layers": layers} if layers else {}
    created = [p for p in (target.parent, *target.parent.parents) if not p.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would make the export private
    try:
        write(src, tmp, tower, **options)
        write_card(src, tmp, to, target.name)
        files = _files(tmp)
        (tmp / MARKER).write_text(
            json.dumps({"format": to, "source": str(Path(src).expanduser().resolve()), "files": files}, indent=1)
        )
        check_out(out, src, overwrite)  # again: nothing appeared in `out` while this ran
        _install(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in created:  # deepest first
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    return target


# ------------------------------------------------------------------ the family's writer


def _our_family(src: str) -> str | None:
    """The family one of our step folders names in its manifest (JSON only, nothing else read), else None."""
    try:
        return json.loads((Path(src).expanduser() / "manifest.json").read_text())["model"]["family"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def writer(src: str, to: str) -> Callable[[str, Path, str], None]:
    """The `to` writer of the family `src` belongs to (its `StateDictAdapter`): the family our step
    folder names, else the one whose adapter claims the path."""
    from titan_contrastive.models import get_model_spec, list_models

    family = _our_family(src)
    if family is None and (Path(src).expanduser() / ".metadata").is_file():  # DCP files: refused as unverifiable
        from titan_contrastive.models.weights import read_ours

        read_ours(Path(src))
    if family is None:
        claimed = [f for f in list_models() if get_model_spec(f).state_dict_adapter.claims(Path(src).expanduser())]
        if not claimed:
            _refuse(
                f"{src}: not a checkpoint this project reads; give one of our step-N folders (with manifest.json), "
                "a Hugging Face CLIP folder (config.json + model.safetensors) or an open_clip state dict "
                "(.safetensors/.bin/.pt, open_clip_config.json beside it)"
            )
        family = claimed[0]
    writes = get_model_spec(family).state_dict_adapter.writes
    if to not in writes:
        _refuse(
            f"--to {to}: {src} is a {family} checkpoint, which exports to {', '.join(writes) or 'no format'}; "
            "pick one of those"
        )
    return writes[to]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_contrastive.export", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "src", help="one of our step-N checkpoint folders, a Hugging Face CLIP folder or an open_clip checkpoint"
    )
    parser.add_argument(
        "--to",
        required=True,
        metavar="{" + ",".join(FORMATS) + "}",
        help="one of the source family's formats (a family of your own may add more). hf: a transformers folder "
        "(clip: CLIPModel; bi_encoder: the tower, LoRA merged), open_clip: open_clip's folder layout (clip); "
        "sentence-transformers: a SentenceTransformer folder (bi_encoder; ColBERT: a MultiVectorEncoder); "
        "qwen_vl: sentence-transformers (ColQwen: a MultiVectorEncoder), hf, peft, colpali; static: "
        "sentence-transformers, model2vec (model2vec's folder); "
        "peft: the LoRA adapters as a PEFT folder (bi_encoder trained with [lora]); pylate: a ColBERT bi_encoder as a "
        "PyLate folder; colpali: a ColBERT qwen_vl run as colpali-engine's ColQwen folder",
    )
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        help="folder to write: new or empty (a previous export with --overwrite); written under a temporary "
        "name, checked by reloading, then renamed",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace --out when it is a previous export of this tool (never another folder)",
    )
    parser.add_argument(
        "--tower",
        choices=("query", "doc"),
        default=None,
        help="bi_encoder, static: which tower (default: both of a two-tower run to sentence-transformers, a Router; "
        "else the query tower)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=0,
        metavar="K",
        help="bi_encoder trained with loss.adaptive_layers: the towers cut to their first K layers (one of those "
        "layers), checked against the run's layer-K embeddings (sentence-transformers, hf)",
    )
    parser.add_argument(
        "--custom-import",
        default="",
        metavar="MODULE",
        help="a module of yours to import first: the one registering your model family (the run's job.custom_import)",
    )
    args = parser.parse_args(argv)
    try:
        if args.custom_import:
            import importlib

            importlib.import_module(args.custom_import)
        export(args.src, args.out, args.to, tower=args.tower, overwrite=args.overwrite, layers=args.layers)
    except ImportError as e:
        print(f"error: {import_failure(e, f'--to {args.to}', 'hf')}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({args.to}) from {args.src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
