"""`write_atomically`: a reader sees the old file or the whole new one, never a temporary or a half."""

from __future__ import annotations

import os
import stat

import pytest

from titan_contrastive.atomic_write import write_atomically, write_text_atomically


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_writes_whole_file_with_plain_permissions(tmp_path, umask_022):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")  # what `open` gives under the umask: 0644, where mkstemp alone gives 0600
    seen = []

    def write(tmp):
        seen.append(tmp)
        assert not (tmp_path / "out.png").exists()  # nothing at the target while writing
        tmp.write_bytes(b"\x89PNG whole")

    assert write_atomically(tmp_path / "out.png", write) == tmp_path / "out.png"
    (tmp,) = seen
    assert tmp.parent == tmp_path and tmp.name.startswith(".out.png.tmp-") and tmp.suffix == ".png"
    assert (tmp_path / "out.png").read_bytes() == b"\x89PNG whole"
    assert _mode(tmp_path / "out.png") == _mode(plain) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.png", "plain.txt"]


def test_replaces_an_existing_file(tmp_path):
    target = tmp_path / "best.json"
    target.write_text("old")
    write_text_atomically(target, "néw\n")
    assert target.read_text(encoding="utf-8") == "néw\n" and os.listdir(tmp_path) == ["best.json"]


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()])
def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, error):
    target = tmp_path / "rows.jsonl"
    target.write_text("old\n")

    def write(tmp):
        tmp.write_text("half")
        raise error

    with pytest.raises(type(error)):
        write_atomically(target, write)
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["rows.jsonl"]


def test_a_missing_folder_is_an_error_before_any_write(tmp_path):
    calls = []
    with pytest.raises(FileNotFoundError):
        write_atomically(tmp_path / "absent" / "f.txt", calls.append)
    assert calls == [] and os.listdir(tmp_path) == []
