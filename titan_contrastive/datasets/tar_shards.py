"""One webdataset tar shard indexed for random access, with its damage found rather than hidden.

wids' `IndexedTarSamples` reads a sample at its offset through mmap, which is how this project
reads shards. Its own scan of the tar headers (`MMIndexedTar`) fails on a tar cut inside a header
(a struct error: every sample of the shard is lost) and indexes a member cut short as if it were
whole (a tar cut mid-member gives its first samples plus a partial one, and says nothing).
`TarShard` keeps wids' reader and scan, and checks the scan's result; a tar that fails the check
is scanned again by Python's `tarfile` (header checksums, pax and GNU long names), which stops at
the first member that is damaged or runs past the end of the file: the samples before it are
kept, the sample at the cut is left out (it may lack members), and `damage` says where and why,
for the caller to log and count.

`open_regular` opens only regular files: a FIFO named like an image or shard would block the
reading process forever, a folder or a device would mislead.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
import tarfile
import uuid
from typing import BinaryIO

import numpy as np
from wids.wids import IndexedTarSamples, group_by_key, splitname
from wids.wids_mmtar import MMIndexedTar

_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)
_CUT_SHORT = ("unexpected end of data", "truncated header", "empty header")
"""tarfile's messages for a file that ends inside a header or a member (the others mean bad bytes)."""
_END_BLOCKS = 2 * tarfile.BLOCKSIZE
"""The zero blocks every tar writer puts after the last member: a file without them was cut."""


class NotRegularFile(OSError):
    """A path that exists but is not a regular file (`str` says what it is)."""


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """`open(path, "rb")` for a regular file; NotRegularFile for anything else, without blocking
    (the open is non-blocking, so a FIFO without a writer returns at once and is refused)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a file")
            raise NotRegularFile(f"not a regular file ({kind})")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return open(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike) -> bytes:
    """The bytes of a regular file (see `open_regular`)."""
    with open_regular(path) as f:
        return f.read()


def _is_header(block: bytes) -> bool:
    try:
        tarfile.TarInfo.frombuf(block, tarfile.ENCODING, "surrogateescape")
    except (tarfile.HeaderError, ValueError):
        return False
    return True


def looks_like_tar(path: str | os.PathLike) -> bool:
    """Whether the file starts with a valid tar header (one 512-byte read: a cheap check of a
    shard that a descriptor's sample count spares from a full scan)."""
    try:
        with open_regular(path) as f:
            return _is_header(f.read(tarfile.BLOCKSIZE))
    except OSError:
        return False


class _CompleteMembers(MMIndexedTar):
    """wids' mmap reader over the members found whole; `damage` ("" for a whole tar), `cut_short`
    (the file ends inside a member or header, rather than holding bad bytes) and `cut_member`.

    Two scans: wids' own (fast: a struct per header), accepted when its result shows a whole tar,
    i.e. every member lies inside the file, only zeros follow the last one (at least the two
    end-of-archive blocks), and no name reaches the 100 characters of a ustar header (a longer
    name lives in a pax header, which wids does not read); otherwise `tarfile`'s (much slower,
    but it checks every header and stops at the first one that is bad or cut)."""

    def _build_index(self) -> None:  # called by MMIndexedTar.__init__ once the file is mapped
        self.damage, self.cut_short, self.cut_member = "", False, ""
        if not self._wids_index():
            self._tarfile_index()

    def _set_index(self, entries: list[tuple[str, int, int]]) -> None:
        self.by_index = entries  # (name, data offset, size): wids' tuple with the data's offset instead of the header's
        self.by_name = {name: i for i, (name, _, _) in enumerate(entries)}

    def _zeros_from(self, offset: int) -> bool:
        size = len(self.mmapped_file)
        return offset >= size or not np.frombuffer(self.mmapped_file, dtype=np.uint8, offset=offset).any()

    def _wids_index(self) -> bool:
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # wids prints a header whose size it cannot parse
                super()._build_index()
        except Exception:  # noqa: BLE001 - any failure of the fast scan: tarfile's scan finds out what is wrong
            return False
        size = len(self.mmapped_file)
        entries = [(name, offset + tarfile.BLOCKSIZE, length) for name, offset, length in self.by_index]
        if any(start + length > size or len(name) >= 99 for name, start, length in entries):
            return False
        end = max(
            (start + -(-length // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE for _, start, length in entries), default=0
        )
        if not self._zeros_from(end) or (entries and size - end < _END_BLOCKS):
            return False
        self._set_index(entries)
        return True

    def _tarfile_index(self) -> None:
        size = len(self.mmapped_file)
        entries: list[tuple[str, int, int]] = []
        end = 0
        self.stream.seek(0)
        try:
            with tarfile.open(fileobj=self.stream, mode="r:") as tar:
                for member in tar:
                    if member.offset_data + member.size > size:
                        self.cut_member, self.cut_short = member.name, True
                        self.damage = (
                            f"cut inside member {member.name} ({size - member.offset_data} of its {member.size} bytes, "
                            f"file ends at byte {size})"
                        )
                        break
                    if member.isreg():
                        entries.append((member.name, member.offset_data, member.size))
                    end = tar.offset
                else:
                    end = tar.offset  # where tarfile stopped: the end-of-archive blocks, or a header it could not read
                    # tarfile ends silently at a cut header
                    if size - end < tarfile.BLOCKSIZE and not self._zeros_from(end):
                        self.cut_short = True
                        self.damage = f"cut inside the header at byte {end} (file ends at byte {size})"
                    elif not self._zeros_from(end):  # ... and at a bad header past the first
                        self.damage = f"unreadable header at byte {end} of {size}"
                    elif entries and size - end < _END_BLOCKS:  # a cut that fell between two members
                        self.cut_short = True
                        self.damage = f"cut at byte {size}, where a member ends: no end-of-archive blocks"
        except (tarfile.TarError, EOFError, ValueError, UnicodeError) as e:
            if not entries and not _is_header(bytes(self.mmapped_file[: tarfile.BLOCKSIZE])):
                raise  # not a tar at all
            self.cut_short = str(e) in _CUT_SHORT
            self.damage = (
                f"{'cut' if self.cut_short else 'unreadable'} after byte {end} of {size} ({type(e).__name__}: {e})"
            )
        self._set_index(entries)

    def names(self) -> list[str]:
        return [name for name, _, _ in self.by_index]

    def get_at_index(self, index: int) -> tuple[str, bytes]:
        name, start, size = self.by_index[index]
        return name, self.mmapped_file[start : start + size]

    def get_by_name(self, name: str) -> tuple[str, bytes]:
        return self.get_at_index(self.by_name[name])


class TarShard(IndexedTarSamples):
    """wids' samples of one tar (`shard[i]` -> {"__key__", ".ext": BytesIO, ...}), its index
    checked for damage (see the module docstring). `damage`: "" for a whole tar, else where it breaks off;
    `cut_short`: it ends early (truncated) rather than holding bad bytes; `lost_key`: the key of
    the sample at the cut that was left out ("" if none or unknown). Raises OSError (or
    tarfile.ReadError) for a file that is not a tar."""

    def __init__(self, path: str) -> None:  # IndexedTarSamples.__init__, with this module's reader
        self.path = path
        self.stream = open_regular(path)
        try:
            if os.fstat(self.stream.fileno()).st_size == 0:
                raise tarfile.ReadError("empty file (0 bytes)")  # mmap refuses an empty file with a less clear message
            self.reader = _CompleteMembers(self.stream)
        except BaseException:
            self.stream.close()
            raise
        self.damage, self.cut_short, self.lost_key = self.reader.damage, self.reader.cut_short, ""
        names = self.reader.names()
        self.samples = group_by_key(names)
        if self.damage and self.samples:
            last = self.samples[-1]
            key = splitname(names[last[0]])[0]
            cut_key = splitname(self.reader.cut_member)[0] if "." in self.reader.cut_member else ""
            # the last sample is incomplete if the cut member is its own, or (cut member unknown) if it has
            # fewer members than the first sample
            if cut_key == key or (not cut_key and len(self.samples) > 1 and len(last) < len(self.samples[0])):
                self.samples.pop()
                self.lost_key = key
            else:
                self.lost_key = cut_key
        self.uuid = str(uuid.uuid4())
