"""`python -m titan_contrastive.export SRC --to hf|open_clip|sentence-transformers|peft --out DIR`:
checkpoints for the ecosystem.

`--to hf` (clip family): SRC is anything `[model] init_from` reads (`interop.detect_format`): one
of our step-N folders (FSDP shards are consolidated by DCP on load), a Hugging Face CLIP folder
or an open_clip checkpoint. DIR receives what `transformers.CLIPModel.from_pretrained(DIR)` and
`CLIPTokenizerFast.from_pretrained(DIR)` load: `config.json`, `model.safetensors` and CLIP's BPE
tokenizer files (built by transformers from the vocabulary this package ships).

`--to open_clip` (clip family, same SRC): `open_clip_config.json` + `open_clip_model.safetensors`,
the layout open_clip reads from a local folder or the hub (`create_model_and_transforms(
"local-dir:DIR")`).

bi_encoder family (`models.bi_encoder.export`): SRC is one of our step folders, `--tower
query|doc` picks the tower (the same one when shared). `--to sentence-transformers`: what
`sentence_transformers.SentenceTransformer(DIR)` loads, the tower with its tokenizer, the run's
pooling, L2 normalization and prompts, cut at its query / document length; `--to hf`: the tower
as a transformers folder with its tokenizer; with LoRA both hold the merged weights. `--to peft`:
the LoRA adapters alone, what `peft.PeftModel.from_pretrained(base, DIR)` loads over the run's
`[model] path`.

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

What is checked before the rename (faithfulness): the written folder is loaded back by the
library it is for (transformers' `CLIPModel`; `SentenceTransformer`; open_clip's
`create_model("local-dir:...")` where open_clip imports, else this project's own
open_clip reader, `interop.load_clip`, which follows open_clip's conventions: its config fields,
pooling rule and layout) and its image and text embeddings on a few fixed inputs (random pixels;
token rows laid out as our tokenizers write them, BOS, ids, EOS, padding; texts through the
tokenizer for sentence-transformers) must equal the source model's within `TOLERANCE`. Why: the
formats carry conventions the weights do not (which token the text pools at, how many image
channels), and a folder that loads without error can still compute other embeddings. A
model the target format cannot express is a one-line error naming why (`interop.hf_clip`,
`interop.openclip`) rather than a folder computing something else.

Needs transformers (`pip install -e '.[hf]'`; sentence-transformers for its format).
"""

from __future__ import annotations

import argparse
import dataclasses
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
from typing import Any, NoReturn

FORMATS = ("hf", "open_clip", "sentence-transformers", "peft")
MARKER = ".titan_contrastive_export.json"
"""Written last into every export: {"format", "source", "files"}; what `--overwrite` may replace."""
TOLERANCE = 1e-4
"""Largest difference allowed between the source's and the reloaded export's L2-normalized
embeddings (unit vectors, so absolute and relative at once): float32 rounding of a different
kernel order is ~1e-6; a wrong pooling token or weight is ~1e-1."""
PROBE_TEXTS = ["a photo of a cat", "", "Two dogs, playing in the snow at night! " * 8]
_STEP = re.compile(r"step-\d+")


def _refuse(message: str) -> NoReturn:
    """Raise `message` as the project's one-line InteropError (interop, and torch with it, is imported when needed)."""
    from titan_contrastive.interop import InteropError

    raise InteropError(message)


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


def export(src: str, out: Path, to: str, *, tower: str = "query", overwrite: bool = False) -> Path:
    """Write `src` as a `to` folder at `out` (module doc: refusals, temporary folder, faithfulness check)."""
    target = check_out(out, src, overwrite)
    created = [p for p in (target.parent, *target.parent.parents) if not p.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would make the export private
    try:
        WRITERS[to](src, tmp, tower)
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


# ------------------------------------------------------------------ faithfulness


def _compare(to: str, tower: str, want: Any, got: Any, library: str) -> None:
    """One-line InteropError when the reloaded export's embeddings are not the source's."""
    import torch

    got = torch.as_tensor(got, dtype=torch.float32)
    if got.shape != want.shape:
        _refuse(
            f"--to {to}: {library} gives {tower} embeddings of shape {tuple(got.shape)}, the source "
            f"{tuple(want.shape)}; the export would change the model, so nothing was written"
        )
    diff = (got - want).abs().max().item()
    if not diff <= TOLERANCE:  # NaN too
        _refuse(
            f"--to {to}: reloaded with {library}, the {tower} embeddings differ from the source's by up to {diff:.3g} "
            f"(tolerance {TOLERANCE:g}); the export would change the model, so nothing was written"
        )


def _reloaded(library: str, load: Callable[[], Any]) -> Any:
    try:
        return load()
    except Exception as e:  # noqa: BLE001 - whatever the library raises: the folder it was given does not load
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        _refuse(
            f"the written folder does not load back with {library} ({type(e).__name__}: {first}); nothing was written"
        )


def probe_images(args: Any) -> Any:
    """Three fixed random images of the model's shape."""
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randn(3, args.in_channels, args.image_size, args.image_size, generator=g)


def probe_ids(args: Any) -> Any:
    """Token rows laid out as our tokenizers write them: PROBE_TEXTS through the model's tokenizer
    when it is one of ours (byte: BOS 1, bytes + 3, EOS 2, PAD 0; CLIP BPE: 49406, ..., 49407, 0),
    then random ids with EOS at the second, middle and last position and 0-padding after it."""
    import torch

    from titan_contrastive.datasets.tokenizer import ByteTokenizer

    length, vocab = args.context_length, args.vocab_size
    rows = []
    if vocab == ByteTokenizer.vocab_size and args.eos_id == ByteTokenizer.EOS and length >= 3:
        rows.append(ByteTokenizer(length).encode(PROBE_TEXTS))
    elif vocab == 49408 and args.eos_id in (-1, 49407):
        from titan_contrastive.datasets.clip_bpe import ClipBpeTokenizer

        rows.append(ClipBpeTokenizer(length).encode(PROBE_TEXTS))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (3, length), generator=g)
    for row, end in enumerate((min(1, length - 1), length // 2, length - 1)):
        ids[row, end] = args.eos_id if args.eos_id >= 0 else vocab - 1
        ids[row, end + 1 :] = 0
    return torch.cat([*rows, ids])


def _source_clip(args: Any, state: dict[str, Any], src: str) -> Any:
    from titan_contrastive.interop import load_state
    from titan_contrastive.models.clip.model import CLIP

    model = CLIP(dataclasses.replace(args, dropout=0.0))
    load_state(model, state, src)
    return model.eval()


def _check_clip(
    to: str, args: Any, ours: Any, library: str, image: Callable[[Any], Any], text: Callable[[Any], Any]
) -> None:
    import torch

    images, ids = probe_images(args), probe_ids(args)
    with torch.no_grad():
        _compare(to, "image", ours.encode_image(images), image(images), library)
        _compare(to, "text", ours.encode_text(ids), text(ids), library)


# ------------------------------------------------------------------ writers


def write_hf_tokenizer(out: Path, context_length: int) -> None:
    """CLIP's BPE as transformers' CLIPTokenizerFast files (vocab.json + merges.txt -> its converter)."""
    from transformers import CLIPTokenizerFast

    from titan_contrastive.datasets.clip_bpe import vocab_and_merges

    vocab, merges = vocab_and_merges()
    ids = {t: i for i, t in enumerate(vocab)}
    if "vocab" in inspect.signature(CLIPTokenizerFast.__init__).parameters:  # transformers >= 5 takes them directly
        CLIPTokenizerFast(vocab=ids, merges=merges, model_max_length=context_length).save_pretrained(str(out))
        return
    with tempfile.TemporaryDirectory() as tmp:  # transformers 4 reads files
        (Path(tmp) / "vocab.json").write_text(json.dumps(ids, ensure_ascii=False))
        (Path(tmp) / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
        CLIPTokenizerFast(
            vocab_file=str(Path(tmp) / "vocab.json"),
            merges_file=str(Path(tmp) / "merges.txt"),
            model_max_length=context_length,
        ).save_pretrained(str(out))


def _our_family(src: str) -> str | None:
    """The family one of our step folders names in its manifest (JSON only, nothing else read), else None."""
    try:
        return json.loads((Path(src).expanduser() / "manifest.json").read_text())["model"]["family"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_text(to: str, src: str, tmp: Path, tower: str = "query") -> None:
    """A bi_encoder step folder's `tower` as `to` (`models.bi_encoder.export`), checked by reloading."""
    from titan_contrastive.interop import read_ours
    from titan_contrastive.models.bi_encoder.export import write

    family, args, model = read_ours(Path(src).expanduser())
    if family != "bi_encoder":
        _refuse(
            f"{src}: a {family} checkpoint; --to {to} exports the bi_encoder family here (clip: --to hf, open_clip)"
        )
    write(
        to,
        model,
        args,
        tmp,
        tower,
        PROBE_TEXTS,
        _reloaded,
        lambda library, want, got: _compare(to, tower, want, got, library),
        _refuse,
    )


def write_open_clip(src: str, tmp: Path, tower: str = "") -> None:
    from safetensors.torch import save_file

    from titan_contrastive.interop import load_clip, read_checkpoint
    from titan_contrastive.interop.openclip import CONFIG_FILE, WEIGHT_FILES, open_clip_config, to_open_clip_state_dict

    args, state = read_checkpoint(src)
    (tmp / CONFIG_FILE).write_text(json.dumps(open_clip_config(args), indent=1))
    save_file(to_open_clip_state_dict(state, rgb=True), str(tmp / WEIGHT_FILES[0]))
    ours = _source_clip(args, state, src)
    try:
        import open_clip
    except Exception:  # noqa: BLE001 - not installed, or its torchvision does not import: our reader of its format
        theirs = _reloaded("this project's open_clip reader", lambda: load_clip(tmp))
        _check_clip("open_clip", args, ours, "this project's open_clip reader", theirs.encode_image, theirs.encode_text)
        return
    # the model, not transforms
    model = _reloaded("open_clip", lambda: open_clip.create_model(f"local-dir:{tmp}", device="cpu").eval())
    # a grayscale image as open_clip's RGB
    rgb = (lambda x: x.expand(-1, 3, -1, -1)) if args.in_channels == 1 else (lambda x: x)
    _check_clip(
        "open_clip",
        args,
        ours,
        "open_clip",
        lambda x: model.encode_image(rgb(x), normalize=True),
        lambda ids: model.encode_text(ids, normalize=True),
    )


def write_hf(src: str, tmp: Path, tower: str = "") -> None:
    if _our_family(src) == "bi_encoder":
        write_text("hf", src, tmp, tower or "query")
        return
    from transformers import CLIPModel

    from titan_contrastive.interop import read_checkpoint
    from titan_contrastive.interop.hf_clip import hf_config_from_args, to_hf_state_dict

    args, state = read_checkpoint(src)
    model = CLIPModel(hf_config_from_args(args))
    # position_ids buffers are the model's own
    result = model.load_state_dict(to_hf_state_dict(state, args), strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("position_ids")]
    if missing or result.unexpected_keys:
        _refuse(f"{src}: transformers' CLIPModel lacks {result.unexpected_keys[:3]} and wants {missing[:3]}")
    model.save_pretrained(str(tmp), safe_serialization=True)
    if args.vocab_size == 49408:  # CLIP's vocabulary: ship its tokenizer (the byte tokenizer has no HF equivalent)
        write_hf_tokenizer(tmp, args.context_length)
    theirs = _reloaded("transformers", lambda: CLIPModel.from_pretrained(str(tmp)).eval())

    def features(out: Any) -> Any:
        import torch.nn.functional as F

        return F.normalize(getattr(out, "pooler_output", out), dim=-1)

    _check_clip(
        "hf",
        args,
        _source_clip(args, state, src),
        "transformers",
        lambda x: features(theirs.get_image_features(pixel_values=x)),
        lambda ids: features(theirs.get_text_features(input_ids=ids)),
    )


WRITERS: dict[str, Callable[[str, Path, str], None]] = {
    "hf": write_hf,
    "open_clip": write_open_clip,
    "sentence-transformers": lambda src, tmp, tower: write_text("sentence-transformers", src, tmp, tower),
    "peft": lambda src, tmp, tower: write_text("peft", src, tmp, tower),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_contrastive.export", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "src", help="one of our step-N checkpoint folders, a Hugging Face CLIP folder or an open_clip checkpoint"
    )
    parser.add_argument(
        "--to",
        choices=FORMATS,
        required=True,
        help="hf: a transformers folder (clip: CLIPModel; bi_encoder: the tower, LoRA merged), open_clip: "
        "open_clip's folder layout (clip); sentence-transformers: a SentenceTransformer folder (bi_encoder); "
        "peft: the LoRA adapters as a PEFT folder (bi_encoder trained with [lora])",
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
        "--tower", choices=("query", "doc"), default="query", help="bi_encoder: which tower (default: query)"
    )
    args = parser.parse_args(argv)
    try:
        export(args.src, args.out, args.to, tower=args.tower, overwrite=args.overwrite)
    except ImportError as e:
        print(f"error: --to {args.to} needs {e.name}: pip install -e '.[hf]'", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({args.to}) from {args.src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
