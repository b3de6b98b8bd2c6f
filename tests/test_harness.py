"""benchmarks/harness.py, the one harness every benchmark uses: round-robin order, out-of-memory and failures,
statistics, memory probes, metadata, result files. The benchmarks themselves: `tests/test_benchmarks.py`."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import harness


def test_round_robin_rotates_the_order_and_times_only_after_warmup() -> None:
    calls: list[str] = []
    variants = {name: (lambda name=name: calls.append(name) or name) for name in "abc"}
    runs = harness.round_robin(variants, repeats=3, warmup=1, keep_values=True)
    assert calls == [*"abc", *"bca", *"cab", *"abc"]  # warm-up round, then each round one variant later
    assert harness.rotation(list("abc"), 4) == list("bca")
    for name, m in runs.items():
        assert m.status == "ok" and len(m.times_s) == len(m.cpu_times_s) == 3 and m.values == [name] * 3
        assert all(t >= 0 for t in m.times_s)
        assert m.peak_rss_mib is None or m.peak_rss_mib > 0


def test_out_of_memory_and_failures_leave_the_rotation() -> None:
    calls: list[str] = []

    def oom() -> None:
        calls.append("oom")
        if calls.count("oom") == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 TiB")

    def broken() -> None:
        calls.append("broken")
        raise RuntimeError("no such kernel\nsecond line")

    runs = harness.round_robin(
        {"ok": lambda: calls.append("ok"), "oom": oom, "broken": broken},
        repeats=2,
        warmup=1,
        tolerate={"broken"},
        rss=False,
    )
    assert calls == ["ok", "oom", "broken", "oom", "ok", "ok"]
    assert runs["ok"].ok and len(runs["ok"].times_s) == 2
    assert runs["oom"].status == "OOM" and runs["oom"].row()["status"] == "OOM"
    assert runs["broken"].status == "skipped" and runs["broken"].reason == "RuntimeError: no such kernel"
    with pytest.raises(RuntimeError, match="no such kernel"):
        harness.round_robin({"broken": broken}, repeats=1)


def test_summary_and_row_statistics() -> None:
    assert harness.summary([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "n": 4}
    assert harness.summary([]) == {"n": 0}
    m = harness.Measurement("x", times_s=[0.3, 0.1, 0.2], cpu_times_s=[0.2, 0.1, 0.1], peak_rss_mib=12.5)
    row = m.row()
    assert (row["median_s"], row["min_s"], row["max_s"], row["median_cpu_s"]) == (0.2, 0.1, 0.3, 0.1)
    assert row["peak_rss_mib"] == 12.5 and "cuda_peak_bytes" not in row


def test_peak_rss_of_a_block_and_of_a_child() -> None:
    import mmap

    with harness.PeakRSS() as probe:
        # fresh anonymous pages (a bytearray could reuse pages a long test process already holds), all touched
        block = mmap.mmap(-1, 64 * 2**20)
        for offset in range(0, len(block), 4096):
            block[offset] = 1
    block.close()
    assert probe.peak_mib >= probe.start_mib
    if probe.reset:  # Linux >= 4.0: the peak is this block's
        assert probe.growth_mib > 48
    child = harness.run_child(
        [sys.executable, "-c", "b = bytearray(96 * 2**20); b[::4096] = b'1' * len(b[::4096]); print('done')"]
    )
    assert child.returncode == 0 and child.stdout == "done\n" and child.wall_s > 0
    # the child's own peak, not this process's (which ru_maxrss would hand down to it at spawn)
    assert child.peak_rss_mib is not None and 96 < child.peak_rss_mib < 96 + 64
    with pytest.raises(subprocess.CalledProcessError):
        harness.run_child([sys.executable, "-c", "raise SystemExit(3)"], check=True)
    with pytest.raises(subprocess.TimeoutExpired):
        harness.run_child([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5)


def test_metadata_names_the_machine_and_the_code() -> None:
    meta = harness.metadata("cpu", extra_key=1)
    for key in (
        "date",
        "device",
        "cpu",
        "cores",
        "cores_usable",
        "torch",
        "cuda",
        "torch_threads",
        "python",
        "platform",
        "commit",
        "commit_dirty",
        "command",
        "loadavg_1_5_15min",
        "env",
    ):
        assert key in meta, key
    assert meta["device"] == "CPU" and meta["torch"] == torch.__version__ and meta["extra_key"] == 1
    assert meta["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", meta["commit"])
    assert "torch" in harness.stamp(meta)


def test_result_files_carry_the_metadata(tmp_path: Path) -> None:
    meta = {**harness.metadata("cpu"), "commit": "0123456789abcdef"}
    rows = [{"impl": "a", "median_s": 0.5, "times_s": [0.4, 0.5]}, {"impl": "b", "median_s": 1.0, "extra": "x"}]

    def figure():  # noqa: ANN202
        fig, ax = harness.pyplot().subplots(figsize=(2, 2))
        ax.plot([1, 2], [1, 2])
        return fig

    paths = harness.write_results(
        tmp_path / "out", "bench", meta, {"config": {"n": 3, "out": tmp_path}}, rows=rows, figure=figure
    )
    assert [p.name for p in paths] == ["bench.json", "bench.csv", "bench.png"]
    saved = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert saved["meta"]["commit"] == "0123456789abcdef" and saved["rows"] == rows
    assert saved["config"] == {"n": 3, "out": str(tmp_path)}  # paths and the like as text
    table = list(csv.DictReader(open(tmp_path / "out" / "bench.csv")))
    assert [r["impl"] for r in table] == ["a", "b"] and json.loads(table[0]["times_s"]) == [0.4, 0.5]
    assert table[1]["extra"] == "x" and table[0]["meta_commit"] == "0123456789abcdef"
    assert {f"meta_{k}" for k in harness.META_COLUMNS} <= set(table[0])
    assert (tmp_path / "out" / "bench.png").read_bytes()[:4] == b"\x89PNG"
