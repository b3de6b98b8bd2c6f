"""Where image-caption records come from: CSV files, webdataset tar shards (and Hugging Face datasets
on disk, `hf_disk.HfSource`, built on the records and checks here).

A source is an indexable list of raw records: `read(i)` returns the image's encoded bytes (or a
decoded image, for a Hugging Face image column) and its caption, or raises `BadSample` naming the
file or shard, the sample key and the reason. Decoding, cropping and tokenizing happen in
`files.FileImageTextDataset`, the same for every source.

Negative captions (hard negatives: `data.csv_negative_keys`, `wds_negative_key`,
`hf_negative_columns`): k per record, fixed per source (`num_negatives`: the number of columns, or
for a list-valued field the first record's count, read when the source opens), so that a batch
is a [B, k] block; a record whose negatives are missing or of another count is a `BadSample`
(missing_negatives, ragged_negatives), substituted and counted like any other.

Why random access (map-style) also for tar shards: the loader's blocked sampler gives every DP
rank a slice of one global permutation, which is what makes the global batch independent of the
number of ranks and workers, and mid-epoch resumption exact (the sampler's position is in the
checkpoint). A shard is indexed once (`tar_shards.TarShard`: wids' `IndexedTarSamples`, whose
index is checked for damage) and then any sample is read at its offset through mmap; shards are
opened lazily, a few at a time.

Nothing is dropped silently. A shard that is not a tar, has no samples, or breaks off (cut short,
or bad bytes) is found when the source is opened (with a `shards.json`, only a shard whose size
disagrees with it is scanned then; the others are checked when first read): the samples before
the break are kept, and the loss (`ShardLoss`: reason, shard, samples kept and lost, detail) is
logged as a warning and listed in `losses`, which the data line at start and the `bad_shards`
metrics report. How many samples a shard should hold comes from `shards.json` or from the
`<shard>_stats.json` that make_shards and img2dataset write beside it. A sample that cannot be
read later is a `BadSample`, counted per read. A path that is not a regular file (a FIFO would
block the reader forever) is never opened.

Several sources of one kind are joined with `::` (open_clip's syntax) and weighted by
`data.upsampling_factors`: source i contributes round(f_i * n_i) samples to each epoch; a
fraction reads consecutive windows of the source, epoch after epoch, so all of it is seen.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import stat
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np

from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.formats import DAMAGED, open_text
from titan_contrastive.datasets.mixing import SourceMix
from titan_contrastive.datasets.packed_rows import PackedRows
from titan_contrastive.datasets.tar_shards import NotRegularFile, TarShard, looks_like_tar, read_regular

logger = logging.getLogger("titan_contrastive")

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")


class BadSample(Exception):
    """A record that cannot be used; the dataset skips it and counts it by `reason`."""

    def __init__(self, reason: str, where: str, key: str, detail: str = "") -> None:
        super().__init__(f"{where} sample {key}: {reason}{f' ({detail})' if detail else ''}")
        self.reason, self.where, self.key, self.detail = reason, where, key, detail

    def __reduce__(self) -> tuple[Any, ...]:  # crosses from DataLoader workers by pickle
        return BadSample, (self.reason, self.where, self.key, self.detail)


class ShardLoss(NamedTuple):
    """A shard, or its tail, that indexing left out (logged once when the source is opened)."""

    reason: str
    """unreadable_shard (not a tar), empty_shard (no samples), truncated_shard (the file ends inside a
    member or header), damaged_shard (bad bytes where a header should be), missing_samples (a whole
    tar with fewer samples than its index lists)."""
    where: str
    kept: int
    """Samples of the shard that are read."""
    lost: int
    """Samples lost: what its index promised minus `kept`; else the sample at the break if one was
    left out (a lower bound)."""
    promised: str
    """Where its sample count comes from ("shards.json", "00000_stats.json"), "" when nothing says."""
    detail: str

    def __str__(self) -> str:
        kept = f"kept its first {self.kept} samples" if self.kept else "left out"
        if self.promised:
            lost = f"lost {self.lost} of the {self.kept + self.lost} samples {self.promised} lists"
        else:
            whatever = (
                "whatever followed the break"
                if self.reason in ("truncated_shard", "damaged_shard")
                else "whatever it held"
            )
            lost = f"lost {whatever} (no shards.json or _stats.json says how many samples)"
        return f"bad shard {self.where}: {self.reason} ({self.detail}); {kept}, {lost}"


def read_file(path: str, where: str, key: str) -> bytes:
    """A sample's file, or BadSample: unreadable_file, or not_a_regular_file (never opened)."""
    try:
        return read_regular(path)
    except NotRegularFile as e:
        raise BadSample("not_a_regular_file", path or where, key, str(e)) from None
    except OSError as e:
        raise BadSample("unreadable_file", path or where, key, e.strerror or str(e)) from None


class Record(NamedTuple):
    image: Any
    """Encoded image bytes, or a Pillow image."""
    caption: str
    where: str
    """The file or shard it was read from."""
    key: str
    """The sample's key in it (a row number, a tar key)."""
    negatives: tuple[str, ...] = ()
    """Its negative captions, the source's `num_negatives` of them (none unless configured)."""


class Source(Protocol):
    location: str
    losses: list[ShardLoss]
    """What indexing left out (see the module docstring); empty for sources without shards."""
    num_negatives: int
    """Negative captions per record (0: none read)."""

    def __len__(self) -> int: ...

    def read(self, index: int) -> Record: ...


def caption_text(text: Any, where: str, key: str) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if not isinstance(text, str) or not text.strip():
        raise BadSample("missing_caption", where, key)
    return text.strip()


def _flatten(values: Sequence[Any]) -> list[Any]:
    """Field values, a list-valued one expanded in place."""
    return [t for v in values for t in (v if isinstance(v, (list, tuple)) else [v])]


def negative_captions(values: Sequence[Any], count: int, where: str, key: str) -> tuple[str, ...]:
    """A record's `count` negative captions from its fields' values (strings or lists of strings,
    flattened in order), stripped; else BadSample missing_negatives or ragged_negatives."""
    texts = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in _flatten(values)]
    if not texts or any(not isinstance(t, str) or not t.strip() for t in texts):
        raise BadSample("missing_negatives", where, key, "a negative caption is missing or empty")
    if len(texts) != count:
        raise BadSample("ragged_negatives", where, key, f"{len(texts)} negative captions where the source has {count}")
    return tuple(t.strip() for t in texts)


def first_negative_count(values_of: Callable[[int], Sequence[Any]], size: int, setting: str, where: str) -> int:
    """The negatives per record of a list-valued field: the count of the first readable record that has any."""
    for index in range(min(size, 64)):
        try:
            count = len(_flatten(values_of(index)))
        except BadSample:
            continue
        if count:
            return count
    raise DataError(
        f"{setting}: none of the first {min(size, 64)} samples of {where} has negative captions there; fix the "
        "setting or the data"
    )


class CsvSource:
    """Rows of a CSV/TSV (compressed too): an image path (relative paths resolve against `image_root`, else the file's
    folder), a caption and, with `negative_keys`, one negative caption per named column."""

    def __init__(
        self,
        path: str,
        *,
        img_key: str = "filepath",
        caption_key: str = "title",
        separator: str = "\t",
        negative_keys: Sequence[str] = (),
        image_root: str = "",
    ) -> None:
        file = Path(path).expanduser()
        if not file.is_file():
            what = "not a regular file" if file.exists() else "no such CSV file"
            raise DataError(f"data.path={path}: {what}; give a CSV/TSV with columns {img_key!r} and {caption_key!r}")
        self.location, self.losses = str(file), []
        try:  # a byte-order mark (Excel's "CSV UTF-8") is not part of the first column's name; gzipped: read so
            with open_text(file, newline="") as f:
                reader = csv.DictReader(f, delimiter=separator)
                columns = reader.fieldnames or []
                missing = [c for c in (img_key, caption_key) if c not in columns]
                if missing:
                    raise DataError(
                        f"{file}: no column {missing[0]!r} (columns: {', '.join(columns) or 'none'}, separator "
                        f"{separator!r}); set data.csv_img_key / data.csv_caption_key / data.csv_separator"
                    )
                unknown = [c for c in negative_keys if c not in columns]
                if unknown:
                    raise DataError(
                        f"{file}: no column {unknown[0]!r} (columns: {', '.join(columns)}); fix "
                        f"data.csv_negative_keys={list(negative_keys)}"
                    )
                folder = str(Path(image_root).expanduser()) if image_root else str(file.parent)
                self._rows = PackedRows(
                    [rooted(folder, row[img_key]), row[caption_key], *(row[c] for c in negative_keys)] for row in reader
                )
                """Per row: [image path, caption, negative captions...], packed as read (shared by forked workers)."""
        except (UnicodeDecodeError, csv.Error, *DAMAGED) as e:
            raise DataError(f"{file}: not a readable UTF-8 CSV ({e}); fix the file or data.csv_separator") from None
        if not self._rows:
            raise DataError(f"{file}: no rows; give a CSV with at least one image and caption")
        self.num_negatives = len(negative_keys)

    def __len__(self) -> int:
        return len(self._rows)

    def read(self, index: int) -> Record:
        where, key = self.location, f"row {index + 2}"  # line number in the file (header is line 1)
        path, text, *others = self._rows[index]
        data = read_file(path, where, key)
        caption = caption_text(text, where, key)
        negatives = negative_captions(others, self.num_negatives, where, key) if self.num_negatives else ()
        return Record(data, caption, path, key, negatives)


def rooted(folder: str, path: Any) -> Any:
    """An image path relative to a table file's `folder`, joined to it (an absolute path, "" or a non-path stays as
    it is)."""
    return os.path.join(folder, path) if isinstance(path, str) and path and not os.path.isabs(path) else path


def expand_shards(pattern: str) -> list[str]:
    """`shards/{000000..000123}.tar` (brace expansion) or a glob-free list of paths."""
    import braceexpand

    return [url for part in pattern.split(",") for url in braceexpand.braceexpand(part.strip()) if url]


class WebDatasetSource:
    """Samples of webdataset tar shards (img2dataset's layout: `<key>.jpg`, `<key>.txt`, `<key>.json`).

    `path`: a brace pattern / comma list of tars, every one scanned at start, or a wids descriptor
    `*.json` (`make_shards` writes `shards.json`), whose sample counts spare the scans: only a shard
    whose size differs from the descriptor's `filesize` (or, without one, that does not start with
    a tar header) is scanned then. `caption_key`: `txt`, or `json:<field>` for a field of the sample's JSON.
    `negative_key`: `json:<field>`, a list of negative captions in the sample's JSON, or a member's
    extension whose text holds one negative caption per line; empty: none.
    Shards left out or cut short: `losses`, each also logged (see the module docstring).
    """

    MAX_OPEN = 8

    def __init__(
        self, path: str, *, image_keys: str = "jpg;jpeg;png;webp", caption_key: str = "txt", negative_key: str = ""
    ) -> None:
        self.location = path
        self.image_keys = ["." + k.strip().lstrip(".") for k in image_keys.split(";") if k.strip()]
        self.caption_key, self.negative_key, self.num_negatives = caption_key, negative_key, 0
        self.losses: list[ShardLoss] = []
        self._open: OrderedDict[int, TarShard] = OrderedDict()  # shard -> its index (at most MAX_OPEN held)
        if path.endswith(".json"):
            urls, listed, sizes = self._descriptor(Path(path))
        else:
            urls = expand_shards(path)
            listed, sizes = [None] * len(urls), [None] * len(urls)
        self._urls = urls
        self._check_files(path, urls)
        counts = []
        for shard, url in enumerate(urls):
            # a brace pattern: scan, comparing with make_shards' / img2dataset's stats if present
            if listed[shard] is None:
                stats, promised = self._stats_count(url)
                counts.append(self._scan(shard, url, promised, stats))
            elif os.stat(url).st_size != sizes[shard] if sizes[shard] is not None else not looks_like_tar(url):
                counts.append(self._scan(shard, url, listed[shard], Path(path).name))  # changed since the descriptor
            else:
                counts.append(listed[shard])
        self._counts = counts
        self._ends = np.cumsum(counts)
        if not self._ends.size or not self._ends[-1]:
            first = f" (first: {self.losses[0]})" if self.losses else ""
            raise DataError(
                f"data.path={path}: no readable samples in {len(urls)} shard(s){first}; check or rebuild the tar files"
            )
        if negative_key:
            setting = f"data.wds_negative_key={negative_key!r}"
            self.num_negatives = first_negative_count(
                lambda i: self._negative_values(*self._sample(i)), len(self), setting, path
            )

    @staticmethod
    def _descriptor(file: Path) -> tuple[list[str], list[int | None], list[int | None]]:
        """(shard paths, sample counts, file sizes or None) of a wids descriptor."""
        try:
            spec = json.loads(file.read_text(encoding="utf-8-sig"))
            shards = spec["shardlist"]
            urls = [str(file.parent / s["url"]) if not os.path.isabs(s["url"]) else s["url"] for s in shards]
            sizes = [int(s["filesize"]) if s.get("filesize") is not None else None for s in shards]
            return urls, [int(s["nsamples"]) for s in shards], sizes
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise DataError(
                f"{file}: not a wids shard descriptor ({type(e).__name__}: {e}); give the shards.json that "
                "make_shards writes, or the tar files as a brace pattern"
            ) from None

    @staticmethod
    def _check_files(path: str, urls: list[str]) -> None:
        """Every shard exists and is a regular file (a FIFO would block the reader): else one DataError."""
        if not urls:
            raise DataError(
                f"data.path={path}: names no shards; give tar files as a brace pattern (shards/{{00000..00009}}.tar) "
                "or a shards.json from make_shards"
            )
        for url in urls:
            try:
                mode = os.stat(url).st_mode
            except OSError as e:
                raise DataError(
                    f"data.path={path}: no such shard {url} ({e.strerror}); give existing tar files as a brace "
                    "pattern (shards/{00000..00009}.tar) or a shards.json from make_shards"
                ) from None
            if not stat.S_ISREG(mode):
                raise DataError(
                    f"data.path={path}: shard {url} is not a regular file; give tar files (a FIFO or folder "
                    "cannot be read by offset)"
                )

    @staticmethod
    def _stats_count(url: str) -> tuple[str, int | None]:
        """(file name, its `successes`) of the `<shard>_stats.json` beside a shard, or ("", None)."""
        stats = Path(url).with_name(Path(url).name.removesuffix(".tar") + "_stats.json")
        try:
            return stats.name, int(json.loads(read_regular(stats))["successes"])
        except (OSError, ValueError, KeyError, TypeError):
            return "", None

    def _scan(self, shard: int, url: str, promised: int | None, origin: str) -> int:
        """Index a shard now; log and list what it loses (see `ShardLoss`). Returns its readable samples."""
        origin = origin if promised is not None else ""
        try:
            samples = TarShard(url)
        except Exception as e:  # noqa: BLE001 - any failure to index a tar means an unusable shard
            detail = " ".join(f"not a tar: {type(e).__name__}: {e}".split())
            loss = ShardLoss("unreadable_shard", url, 0, promised or 0, origin, detail)
        else:
            kept = len(samples)
            self._keep(shard, samples)  # the first reads use this index instead of scanning again
            if samples.damage:
                lost = max(promised - kept, 0) if promised is not None else int(bool(samples.lost_key))
                at_break = f"; sample {samples.lost_key} at the break left out" if samples.lost_key else ""
                loss = ShardLoss(
                    "truncated_shard" if samples.cut_short else "damaged_shard",
                    url,
                    kept,
                    lost,
                    origin,
                    samples.damage + at_break,
                )
            elif promised is not None and kept < promised:
                loss = ShardLoss(
                    "missing_samples", url, kept, promised - kept, origin, f"a whole tar of {kept} samples"
                )
            elif not kept:
                loss = ShardLoss("empty_shard", url, 0, 0, origin, "a tar without samples")
            else:
                return kept
        self.losses.append(loss)
        logger.warning(str(loss))
        return loss.kept

    def __len__(self) -> int:
        return int(self._ends[-1])

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers: open shards stay behind
        return {**self.__dict__, "_open": OrderedDict()}

    def _keep(self, shard: int, samples: TarShard) -> None:
        """Hold a shard's index, closing the least recently used one past MAX_OPEN."""
        if len(self._open) >= self.MAX_OPEN:
            self._open.popitem(last=False)[1].close()
        self._open[shard] = samples

    def _shard(self, shard: int) -> TarShard:
        if shard not in self._open:
            self._keep(shard, TarShard(self._urls[shard]))
        self._open.move_to_end(shard)
        return self._open[shard]

    def _sample(self, index: int) -> tuple[dict[str, Any], str, str]:
        """(the sample's members by extension, its shard, its key), or BadSample."""
        shard = int(np.searchsorted(self._ends, index, side="right"))
        inner = index - (int(self._ends[shard - 1]) if shard else 0)
        url = self._urls[shard]
        try:
            samples = self._shard(shard)
            if inner >= len(samples):  # the tar changed since it was indexed, or the descriptor's count was wrong
                damage = f"; {samples.damage}" if samples.damage else ""
                raise BadSample(
                    "truncated_shard",
                    url,
                    f"#{inner}",
                    f"{len(samples)} of its {self._counts[shard]} indexed samples can be read{damage}",
                )
            sample = samples[inner]
        except BadSample:
            raise
        except Exception as e:  # noqa: BLE001 - a damaged shard: the sample is skipped and counted
            raise BadSample(
                "unreadable_shard", url, f"#{inner}", " ".join(f"{type(e).__name__}: {e}".split())
            ) from None
        sample = {k: v.getvalue() if hasattr(v, "getvalue") else v for k, v in sample.items()}  # wids gives BytesIO
        return sample, url, sample.get("__key__", f"#{inner}")

    def _negative_values(self, sample: dict[str, Any], url: str, key: str) -> list[Any]:
        """The sample's negative captions as found (`negative_key`), or BadSample missing_negatives."""
        if self.negative_key.startswith("json:"):
            try:
                value = json.loads(sample[".json"])[self.negative_key[5:]]
            except (KeyError, ValueError, TypeError):
                raise BadSample("missing_negatives", url, key, f"no {self.negative_key}") from None
            return value if isinstance(value, list) else [value]
        text = sample.get("." + self.negative_key.lstrip("."))
        if text is None:
            raise BadSample("missing_negatives", url, key, f"no member .{self.negative_key.lstrip('.')}")
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else str(text)
        return [line for line in text.splitlines() if line.strip()]

    def read(self, index: int) -> Record:
        sample, url, key = self._sample(index)
        image = next((sample[k] for k in self.image_keys if k in sample), None)
        if image is None:
            raise BadSample("missing_image", url, key, f"no member with extension {'/'.join(self.image_keys)}")
        if self.caption_key.startswith("json:"):
            try:
                text = json.loads(sample[".json"])[self.caption_key[5:]]
            except (KeyError, ValueError, TypeError):
                raise BadSample("missing_caption", url, key, f"no {self.caption_key}") from None
        else:
            text = sample.get("." + self.caption_key.lstrip("."))
        caption = caption_text(text, url, key)
        negatives = (
            negative_captions(self._negative_values(sample, url, key), self.num_negatives, url, key)
            if self.num_negatives
            else ()
        )
        return Record(image, caption, url, key, negatives)


class WeightedSources:
    """Sources joined with `::`, source i contributing round(factor_i * len_i) samples per epoch
    (`mixing.SourceMix`: windows that continue from epoch to epoch)."""

    def __init__(self, sources: Sequence[Source], factors: Sequence[float]) -> None:
        self.sources, self.epoch = list(sources), 0
        self.location = "::".join(s.location for s in self.sources)
        self.losses = [loss for s in self.sources for loss in s.losses]
        counts = {s.location: getattr(s, "num_negatives", 0) for s in self.sources}
        if len(set(counts.values())) > 1:
            shown = ", ".join(f"{where}: {k}" for where, k in counts.items())
            raise DataError(
                f"data.path={self.location}: the sources hold different numbers of negative captions ({shown}); "
                "give every source the same number"
            )
        self.num_negatives = next(iter(counts.values()))
        self.mix = SourceMix([len(s) for s in self.sources], factors)

    def __len__(self) -> int:
        return len(self.mix)

    @property
    def sizes(self) -> list[int]:
        """Samples per epoch of each source, in index order."""
        return self.mix.sizes

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def read(self, index: int) -> Record:
        i, inner = self.mix.locate(index, self.epoch)
        return self.sources[i].read(inner)
