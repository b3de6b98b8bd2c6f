"""make_shards: CSV and folder inputs -> img2dataset-layout webdataset shards, read back with wids."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image
from wids.wids import IndexedTarSamples

from titan_contrastive.datasets.make_shards import main, write_shards

N = 25


def _make_images(folder: Path, n: int = N) -> list[tuple[str, str, tuple[int, int]]]:
    """n small PNG/JPEG files under folder (some in a subfolder); (relative path, caption, (w, h)) each."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        w, h = 8 + i % 5, 6 + i % 3
        ext = ["png", "jpg", "jpeg"][i % 3]
        rel = f"{'sub/' if i % 4 == 0 else ''}img_{i:02d}.{ext}"
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / rel)
        out.append((rel, f"caption {i}", (w, h)))
    return out


def _check_shards(out: Path, expected: list[tuple[str, str, tuple[int, int]]], root: Path, sizes=(10, 10, 5)) -> None:
    """Every shard read back with wids: keys, bytes, captions, json, stats and shards.json."""
    index = json.loads((out / "shards.json").read_text())
    assert index["__kind__"] == "wids-shard-index-v1" and index["wids_version"] == 1
    assert index["name"] == out.name
    assert [s["url"] for s in index["shardlist"]] == [f"{i:05d}.tar" for i in range(len(sizes))]
    assert [s["nsamples"] for s in index["shardlist"]] == list(sizes)
    got = []
    for shard_id, entry in enumerate(index["shardlist"]):
        path = out / entry["url"]
        assert entry["filesize"] == path.stat().st_size
        ds = IndexedTarSamples(path=str(path))
        assert len(ds) == entry["nsamples"]
        for i in range(len(ds)):
            sample = {k: v if k == "__key__" else v.getvalue() for k, v in ds[i].items()}  # values are BytesIO
            assert sample["__key__"] == f"{shard_id:05d}{i:04d}"
            got.append(sample)
        ds.close()
        stats = json.loads((out / f"{shard_id:05d}_stats.json").read_text())
        assert stats["successes"] == entry["nsamples"]
        assert stats["count"] == stats["successes"] + stats["failed_to_read"]
    assert len(got) == len(expected)
    for sample, (rel, caption, (w, h)) in zip(got, expected):
        ext = rel.rsplit(".", 1)[1].replace("jpeg", "jpg")
        assert set(sample) == {"__key__", f".{ext}", ".txt", ".json"}
        assert sample[f".{ext}"] == (root / rel).read_bytes()
        assert sample[".txt"].decode() == caption
        meta = json.loads(sample[".json"])
        assert meta == {"key": sample["__key__"], "caption": caption, "filepath": rel, "width": w, "height": h}
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp-*"))


def _error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    return err


def test_csv_tab_default(tmp_path, capsys):
    imgs = _make_images(tmp_path / "data")
    rows = list(reversed(imgs))  # CSV order, not path order, decides sample order
    (tmp_path / "data" / "train.csv").write_text(
        "filepath\ttitle\n" + "".join(f"{rel}\t{cap}\n" for rel, cap, _ in rows), encoding="utf-8"
    )
    out = tmp_path / "shards"
    assert main([str(tmp_path / "data" / "train.csv"), "--out", str(out), "--samples-per-shard", "10"]) == 0
    assert "25 samples in 3 shards" in capsys.readouterr().out
    _check_shards(out, rows, tmp_path / "data")


def test_csv_comma_custom_keys(tmp_path, capsys):
    imgs = _make_images(tmp_path)
    (tmp_path / "pairs.csv").write_text(
        "id,image,text\n" + "".join(f"{i},{rel},{cap}\n" for i, (rel, cap, _) in enumerate(imgs)), encoding="utf-8"
    )
    out = tmp_path / "out"
    argv = [
        str(tmp_path / "pairs.csv"),
        "--out",
        str(out),
        "--samples-per-shard",
        "10",
        "--csv-separator",
        ",",
        "--csv-img-key",
        "image",
        "--csv-caption-key",
        "text",
    ]
    assert main(argv) == 0
    _check_shards(out, imgs, tmp_path)


def test_folder_mode_sorted(tmp_path, capsys):
    imgs = _make_images(tmp_path / "imgs")
    for rel, cap, _ in imgs:
        (tmp_path / "imgs" / rel).with_suffix(".txt").write_text(f"  {cap}\n", encoding="utf-8")
    out = tmp_path / "imgs" / "shards"  # out inside SRC is not scanned
    assert main([str(tmp_path / "imgs"), "--out", str(out), "--samples-per-shard", "10"]) == 0
    _check_shards(out, sorted(imgs, key=lambda r: r[0]), tmp_path / "imgs")
    # --overwrite replaces the shards (and a killed run's temporaries: a tar's, an index's), keeps other files;
    # a second folder scan must not pick up the output
    leftovers = ["00009.tar.tmp", ".shards.json.tmp-k1ll3d.json", ".00009_stats.json.tmp-a_b.json"]
    for name in [*leftovers, "notes.txt"]:
        (out / name).write_text("x")
    assert main([str(tmp_path / "imgs"), "--out", str(out), "--samples-per-shard", "10", "--overwrite"]) == 0
    _check_shards(out, sorted(imgs, key=lambda r: r[0]), tmp_path / "imgs")
    assert not any((out / name).exists() for name in leftovers) and (out / "notes.txt").read_text() == "x"


def test_wide_keys_and_write_shards_api(tmp_path):
    imgs = _make_images(tmp_path, 3)
    res = write_shards([(rel, cap) for rel, cap, _ in imgs], tmp_path / "o", 10000, root=tmp_path)
    assert res["samples"] == 3 and res["shards"] == 1
    ds = IndexedTarSamples(path=str(tmp_path / "o" / "00000.tar"))
    assert [ds[i]["__key__"] for i in range(len(ds))] == ["000000000", "000000001", "000000002"]
    write_shards([(rel, cap) for rel, cap, _ in imgs], tmp_path / "p", 10001, root=tmp_path)
    assert IndexedTarSamples(path=str(tmp_path / "p" / "00000.tar"))[2]["__key__"] == "0000000002"


def test_missing_column(tmp_path, capsys):
    (tmp_path / "data.csv").write_text("a\tb\nx\ty\n", encoding="utf-8")
    err = _error(capsys, [str(tmp_path / "data.csv"), "--out", str(tmp_path / "o")])
    assert "data.csv" in err and "'filepath'" in err and "a, b" in err and "--csv-img-key" in err


def test_missing_image_file(tmp_path, capsys):
    _make_images(tmp_path, 2)
    (tmp_path / "data.csv").write_text("filepath\ttitle\nimg_01.jpg\tok\nnope.jpg\tgone\n", encoding="utf-8")
    err = _error(capsys, [str(tmp_path / "data.csv"), "--out", str(tmp_path / "o")])
    assert "nope.jpg" in err and "--skip-bad" in err
    assert not list((tmp_path / "o").glob("*.tmp")) and not (tmp_path / "o" / "shards.json").exists()


def test_image_without_caption(tmp_path, capsys):
    imgs = _make_images(tmp_path / "imgs", 4)
    for rel, cap, _ in imgs[1:]:
        (tmp_path / "imgs" / rel).with_suffix(".txt").write_text(cap, encoding="utf-8")
    err = _error(capsys, [str(tmp_path / "imgs"), "--out", str(tmp_path / "o")])
    assert imgs[0][0] in err and "--skip-missing" in err
    assert main([str(tmp_path / "imgs"), "--out", str(tmp_path / "o"), "--skip-missing"]) == 0
    assert "3 samples in 1 shards" in capsys.readouterr().out


def test_non_empty_out(tmp_path, capsys):
    _make_images(tmp_path, 1)
    (tmp_path / "data.csv").write_text("filepath\ttitle\nimg_00.png\tc\n", encoding="utf-8")
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep.txt").write_text("x")
    err = _error(capsys, [str(tmp_path / "data.csv"), "--out", str(tmp_path / "o")])
    assert str(tmp_path / "o") in err and "--overwrite" in err


def test_skip_bad_counts_corrupt_image(tmp_path, capsys):
    imgs = _make_images(tmp_path, 12)
    (tmp_path / "bad.jpg").write_bytes(np.random.default_rng(1).integers(0, 256, 500, dtype=np.uint8).tobytes())
    rows = [(r, c) for r, c, _ in imgs[:5]] + [("bad.jpg", "broken")] + [(r, c) for r, c, _ in imgs[5:]]
    (tmp_path / "d.csv").write_text("filepath\ttitle\n" + "".join(f"{r}\t{c}\n" for r, c in rows), encoding="utf-8")
    argv = [str(tmp_path / "d.csv"), "--out", str(tmp_path / "o"), "--samples-per-shard", "10"]
    err = _error(capsys, argv)
    assert "bad.jpg" in err
    assert main(argv + ["--overwrite", "--skip-bad"]) == 0
    stdout = capsys.readouterr().out
    assert "12 samples in 2 shards" in stdout and "1 unreadable" in stdout
    _check_shards(tmp_path / "o", imgs, tmp_path, sizes=(10, 2))
    assert json.loads((tmp_path / "o" / "00000_stats.json").read_text()) == {
        "count": 11,
        "successes": 10,
        "failed_to_read": 1,
    }


def test_trailing_bad_image_makes_no_empty_shard(tmp_path):
    imgs = _make_images(tmp_path, 2)
    (tmp_path / "bad.png").write_bytes(b"not an image")
    res = write_shards(
        [(r, c) for r, c, _ in imgs] + [("bad.png", "x")], tmp_path / "o", 2, root=tmp_path, skip_bad=True
    )
    assert (res["samples"], res["shards"], res["skipped_bad"]) == (2, 1, 1)
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["00000.tar", "00000_stats.json", "shards.json"]
    assert json.loads((tmp_path / "o" / "00000_stats.json").read_text()) == {
        "count": 3,
        "successes": 2,
        "failed_to_read": 1,
    }
