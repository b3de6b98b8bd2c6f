"""Write image-caption pairs as webdataset tar shards, in the layout img2dataset writes.

`python -m titan_contrastive.datasets.make_shards SRC --out DIR` reads (a) a CSV/TSV of image paths
and captions (open_clip's `--csv-*` options and defaults) or (b) a folder of images, each with its
caption in a sibling `<stem>.txt`, and writes to DIR:
- `00000.tar`, `00001.tar`, ...: per sample `<key>.<ext>` (the image file's bytes, not re-encoded),
  `<key>.txt` (caption), `<key>.json` {key, caption, filepath, width, height}; key = 5-digit shard
  id + index in shard, e.g. `000000003`; `<shard>_stats.json` {count, successes, failed_to_read};
- `shards.json`, a wids shard index (`wids.ShardListDataset("DIR/shards.json")` reads by index).
Why: sharded tars are what image-text loaders (open_clip, webdataset, wids) stream fast. Each tar is
written as `<name>.tar.tmp` then renamed, and `shards.json` last, so a killed run never leaves a
shard or an index that looks complete.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path

import webdataset as wds
from PIL import Image

from titan_contrastive.atomic_write import write_text_atomically
from titan_contrastive.datasets.tar_shards import read_regular

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
OUTPUTS = re.compile(
    r"\d{5,}(\.tar|\.tar\.tmp|_stats\.json)|shards\.json|\.(\d{5,}_stats|shards)\.json\.tmp-\w+\.json"
)  # what --overwrite deletes


class ShardError(Exception):
    """A problem with the input or output that the user can fix; main prints it on one line."""


def _read_image(path: Path) -> tuple[bytes, str, tuple[int, int]]:
    """The file's bytes, its tar extension, and (width, height) read from the header only."""
    data = read_regular(path)  # a FIFO or folder is refused (OSError), never opened
    with Image.open(io.BytesIO(data)) as img:  # lazy: reads the header, decodes no pixels
        size, fmt = img.size, (img.format or "").lower()
    ext = path.suffix.lower().lstrip(".") or fmt
    ext = "jpg" if ext == "jpeg" else ext
    if not ext.isalnum() or ext in ("txt", "json"):
        raise ValueError(f"cannot use file extension {ext!r} as a member name")
    return data, ext, size


def _write_json(path: Path, obj: dict) -> None:
    write_text_atomically(path, json.dumps(obj, indent=1, ensure_ascii=False))


def write_shards(
    samples: Iterable[tuple[str, str]],
    out: Path,
    samples_per_shard: int = 10000,
    *,
    root: Path | None = None,
    skip_bad: bool = False,
    overwrite: bool = False,
) -> dict:
    """Write (image path, caption) pairs to `out`, `samples_per_shard` written samples per shard.

    Paths go into the json as given; relative ones resolve against `root` (default: the working
    directory). An unreadable image raises ShardError, or with `skip_bad` is skipped and counted in
    its shard's `failed_to_read`. Returns {samples, shards, skipped_bad, shardlist}.
    """
    out = Path(out)
    if samples_per_shard < 1:
        raise ShardError(f"--samples-per-shard {samples_per_shard}: must be >= 1")
    if out.exists() and not out.is_dir():
        raise ShardError(f"{out}: exists and is not a folder; pass another --out")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ShardError(f"{out}: folder is not empty; pass an empty or new --out, or --overwrite")
        for old in out.iterdir():  # only this tool's outputs; other files stay
            if OUTPUTS.fullmatch(old.name) and old.is_file():
                old.unlink()
    out.mkdir(parents=True, exist_ok=True)
    digits = max(4, len(str(samples_per_shard - 1)))
    shardlist, shard_stats, writer, tmp, skipped = [], [], None, None, 0
    stats = {"count": 0, "successes": 0, "failed_to_read": 0}  # of the shard being filled

    def close_shard() -> None:
        nonlocal writer, stats
        writer.close()
        writer, name = None, f"{len(shardlist):05d}.tar"
        os.replace(tmp, out / name)
        shardlist.append({"url": name, "nsamples": stats["successes"], "filesize": (out / name).stat().st_size})
        shard_stats.append(stats)
        stats = {"count": 0, "successes": 0, "failed_to_read": 0}

    try:
        for filepath, caption in samples:
            stats["count"] += 1
            path = Path(root or ".") / filepath
            try:
                data, ext, (width, height) = _read_image(path)
            except (OSError, ValueError) as err:  # PIL.UnidentifiedImageError is an OSError
                if not skip_bad:
                    raise ShardError(f"{path}: unreadable image ({err}); fix or remove it, or pass --skip-bad") from err
                stats["failed_to_read"] += 1
                skipped += 1
                continue
            if writer is None:  # opened on a shard's first good sample, so no shard is empty
                tmp = out / f"{len(shardlist):05d}.tar.tmp"
                writer = wds.TarWriter(str(tmp), encoder=False)
            key = f"{len(shardlist):05d}{stats['successes']:0{digits}d}"
            meta = {"key": key, "caption": caption, "filepath": str(filepath), "width": width, "height": height}
            writer.write(
                {
                    "__key__": key,
                    ext: data,
                    "txt": caption.encode("utf-8"),
                    "json": json.dumps(meta, ensure_ascii=False).encode("utf-8"),
                }
            )
            stats["successes"] += 1
            if stats["successes"] == samples_per_shard:
                close_shard()
        if writer is not None:
            close_shard()
    finally:
        if writer is not None:  # failed mid-shard: drop the partial tar
            writer.close()
            tmp.unlink(missing_ok=True)
    if shard_stats:  # failures after the last good sample count in the last shard
        shard_stats[-1]["count"] += stats["count"]
        shard_stats[-1]["failed_to_read"] += stats["failed_to_read"]
    for i, st in enumerate(shard_stats):
        _write_json(out / f"{i:05d}_stats.json", st)
    _write_json(
        out / "shards.json",
        {"__kind__": "wids-shard-index-v1", "wids_version": 1, "name": out.resolve().name, "shardlist": shardlist},
    )
    return {
        "samples": sum(s["nsamples"] for s in shardlist),
        "shards": len(shardlist),
        "skipped_bad": skipped,
        "shardlist": shardlist,
    }


def read_csv(path: Path, img_key: str, caption_key: str, sep: str) -> list[tuple[str, str]]:
    """(image path as written, caption) per row of a CSV/TSV, in file order."""
    try:
        # -sig: a byte-order mark is not part of the first column
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f, delimiter=sep)
            columns = reader.fieldnames or []
            for key, flag in ((img_key, "--csv-img-key"), (caption_key, "--csv-caption-key")):
                if key not in columns:
                    raise ShardError(
                        f"{path}: no column {key!r} (columns: {', '.join(columns)}); pass {flag}"
                        + ("" if len(columns) > 1 else " or the right --csv-separator")
                    )
            rows = [(row[img_key] or "", row[caption_key] or "") for row in reader]
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise ShardError(f"{path}: cannot read as CSV ({err}); save it as UTF-8 CSV/TSV text") from err
    if not rows:
        raise ShardError(f"{path}: no rows after the header; add rows or pass another SRC")
    return rows


def _read_caption(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise ShardError(f"{path}: cannot read caption ({err}); save it as UTF-8 text") from err


def read_folder(folder: Path, skip_missing: bool, exclude: Path | None = None) -> tuple[list, int]:
    """(relative image path, caption) per image under `folder` (not under `exclude`), sorted by path;
    and how many images were skipped for want of a caption file."""
    images = sorted(
        (
            p
            for p in folder.rglob("*")
            if p.suffix.lower().lstrip(".") in IMAGE_EXTS
            and p.is_file()
            and not (exclude and p.resolve().is_relative_to(exclude))
        ),
        key=lambda p: p.relative_to(folder).as_posix(),
    )
    if not images:
        raise ShardError(f"{folder}: no image files ({', '.join(IMAGE_EXTS)}); pass another SRC")
    missing = [p for p in images if not p.with_suffix(".txt").is_file()]
    if missing and not skip_missing:
        names = ", ".join(p.relative_to(folder).as_posix() for p in missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise ShardError(
            f"{folder}: {len(missing)} image(s) without a caption file <stem>.txt: {names}; "
            "add them or pass --skip-missing"
        )
    skip = set(missing)
    return [
        (p.relative_to(folder).as_posix(), _read_caption(p.with_suffix(".txt"))) for p in images if p not in skip
    ], len(missing)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m titan_contrastive.datasets.make_shards", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "src",
        metavar="SRC",
        type=Path,
        help="a .csv/.tsv of image paths and captions, or an image "
        "folder (jpg/jpeg/png/webp, recursive) with a caption in each image's sibling <stem>.txt",
    )
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="output folder (created)")
    p.add_argument("--samples-per-shard", type=int, default=10000, metavar="N", help="default: %(default)s")
    p.add_argument(
        "--csv-img-key",
        default="filepath",
        metavar="COL",
        help="CSV column of image paths, relative to the CSV's folder (default: %(default)s)",
    )
    p.add_argument("--csv-caption-key", default="title", metavar="COL", help="CSV caption column (default: title)")
    p.add_argument("--csv-separator", default="\t", metavar="SEP", help="CSV separator, '\\t' for tab (default: tab)")
    p.add_argument("--skip-missing", action="store_true", help="folder mode: skip images without a caption file")
    p.add_argument("--skip-bad", action="store_true", help="skip missing or unreadable images instead of failing")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty DIR, first deleting its NNNNN.tar, NNNNN_stats.json and shards.json",
    )
    args = p.parse_args(argv)
    try:
        missing = 0
        if args.src.is_dir():
            samples, missing = read_folder(args.src, args.skip_missing, exclude=args.out.resolve())
            root = args.src
        elif args.src.is_file():
            sep = "\t" if args.csv_separator in ("\\t", "tab") else args.csv_separator
            if len(sep) != 1:
                raise ShardError(f"--csv-separator {args.csv_separator!r}: must be one character")
            samples, root = read_csv(args.src, args.csv_img_key, args.csv_caption_key, sep), args.src.parent
        else:
            raise ShardError(f"{args.src}: no such file or folder; pass a .csv/.tsv file or an image folder")
        res = write_shards(
            samples, args.out, args.samples_per_shard, root=root, skip_bad=args.skip_bad, overwrite=args.overwrite
        )
    except ShardError as err:
        print("error: " + " ".join(str(err).split()), file=sys.stderr)  # always one line
        return 2
    print(
        f"wrote {res['samples']} samples in {res['shards']} shards to {args.out} "
        f"(skipped: {res['skipped_bad']} unreadable, {missing} without caption)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
