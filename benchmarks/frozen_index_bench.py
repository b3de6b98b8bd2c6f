"""Memory and time of a rank reading a teacher's file (`frozen.EmbeddingTable.read`) with its index mapped
(`datasets/frozen_index.py`), read whole (every key hashed, every vector checked), and by the reader before the index;
and what indexing costs the writer (`embed.write_rows`) (CPU).

    python -m benchmarks.frozen_index_bench                                           # the table of docs/performance.md
    python -m benchmarks.frozen_index_bench --rows 4096 --dim 8 --repeats 1 --out /tmp/f      # smoke (seconds)

Per size, `--rows` rows of `--dim` float32 numbers (random, seeded) keyed by 40 hex digits (a SHA-1's length) are
written to raw files (the vectors; the keys' UTF-8 bytes and int32 offsets), which each measurement maps, as
`RowSpool.rows` hands them to the writer. Each measurement is a fresh process (this file run as a script, the
variant's titan_contrastive first on PYTHONPATH):
- `write` (this tree) and `write_before` (`--baseline`, default 8a390a2, the last commit before the index, its package
  extracted by `harness.package_at`): `write_rows` of the mapped keys and vectors into an .arrow file; this tree's
  checks the rows first (as a run checks a file it reads whole) and writes the file's index. Both files hold the same
  rows (checked);
- `indexed`, `whole` (this tree, `indexed=False`) and `before` (the baseline's reader, which knows no index): an
  `EmbeddingTable.read` of this tree's file, then a lookup of `--lookups` of its keys (checked: each at its row).
Per variant and size, medians of `--repeats` interleaved runs: the read's or write's peak anonymous memory above its
start (RssAnon of /proc/self/status sampled every millisecond by a thread: the heap; the file's mapped pages are the
kernel's to share and drop) and its seconds, and the lookup's seconds. Writes frozen_index_bench.{json,csv,
png} under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness

NAME = "frozen_index_bench"
FIELDS = ["variant", "rows", "file_mib", "anon_mib", "anon_b_per_row", "seconds", "lookup_s", "index_mib"]
WRITES = ("write", "write_before")
READS = ("indexed", "whole", "before")
BASELINES = ("write_before", "before")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1 << 17, 1 << 19, 1 << 20, 1 << 21])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--lookups", type=int, default=1 << 16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline", default="8a390a2", help="the commit before the index")
    p.add_argument("--out", default=str(harness.RESULTS))
    p.add_argument("--variant", choices=WRITES + READS, help=argparse.SUPPRESS)  # a measurement (run_once)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def key(i: int) -> str:
    return f"{i:040x}"


def make(folder: Path, n: int, dim: int) -> None:
    """The raw files a measurement maps: `vectors.npy` [n, dim], the keys' bytes `keys` and their `offsets.npy`."""
    import numpy as np

    vectors = np.lib.format.open_memmap(folder / "vectors.npy", "w+", np.float32, (n, dim))
    rng = np.random.default_rng(0)
    for start in range(0, n, 1 << 16):
        vectors[start : start + (1 << 16)] = rng.standard_normal((min(1 << 16, n - start), dim), dtype=np.float32)
    vectors.flush()
    (folder / "keys").write_bytes("".join(key(i) for i in range(n)).encode())
    np.save(folder / "offsets.npy", np.arange(n + 1, dtype=np.int32) * 40)


def measure_main(args: argparse.Namespace) -> None:
    """One measurement (`--variant`): writes TARGET.json."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute  # noqa: F401 - imported before the probe starts, as a run has
    import torch

    with contextlib.suppress(ImportError):  # pyarrow's first to_numpy imports pandas: 24 MiB, once a process
        import pandas  # noqa: F401

    import titan_contrastive
    from titan_contrastive.datasets.frozen import EmbeddingTable
    from titan_contrastive.embed import write_rows

    n, folder, target = args.rows[0], Path(args.folder), Path(args.target)
    where = Path(titan_contrastive.__file__).resolve()
    assert (args.variant in BASELINES) == (where.parents[1] != harness.REPO), where  # this tree's, or the baseline's
    torch.set_num_threads(1)  # a rank's share of a machine's cores
    rng = np.random.default_rng(1)
    probe_rows = rng.choice(n, size=min(args.lookups, n), replace=False)
    probe_keys = [key(int(i)) for i in probe_rows]
    probe, start = harness.AnonPeak(), time.perf_counter()
    base = probe.peak
    lookup = 0.0
    if args.variant in WRITES:
        data = pa.memory_map(str(folder / "keys")).read_buffer()
        keys = pa.StringArray.from_buffers(n, pa.py_buffer(np.load(folder / "offsets.npy", mmap_mode="r")), data)
        write_rows(target, [("image", n)], keys, np.load(folder / "vectors.npy", mmap_mode="r"))
        seconds, table = time.perf_counter() - start, None
    else:
        flags = {} if args.variant == "before" else {"indexed": args.variant == "indexed"}
        table = EmbeddingTable.read(str(target), "bench", **flags)
        seconds = time.perf_counter() - start
    anon = probe.stop() - base  # the read's or write's; a lookup's is the same in every variant
    if args.variant in READS:
        start = time.perf_counter()
        found = table.lookup("image", probe_keys)
        lookup = time.perf_counter() - start
        assert np.array_equal(found.numpy(), probe_rows), "a key found at another row"
    Path(f"{target}.json").write_text(json.dumps({"anon_mib": anon / 1024, "seconds": seconds, "lookup_s": lookup}))


def run_once(variant: str, args: argparse.Namespace, package: Path, folder: Path, target: Path) -> dict[str, Any]:
    """One measurement in a fresh process."""
    trees = [str(package), str(harness.REPO)] if variant in BASELINES else [str(harness.REPO)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(trees), "CUDA_VISIBLE_DEVICES": ""}
    flags = [f"--rows={args.rows}", f"--dim={args.dim}", f"--lookups={args.lookups}"]
    command = [sys.executable, __file__, f"--variant={variant}", f"--folder={folder}", f"--target={target}", *flags]
    if subprocess.run(command, env=env).returncode:
        raise SystemExit(f"{variant}, {args.rows} rows: the measurement failed (its error is above)")
    made = json.loads(Path(f"{target}.json").read_text())
    Path(f"{target}.json").unlink()
    return made


def same_rows(a: Path, b: Path) -> bool:
    """The two .arrow files hold the same sides, keys and vectors, in the same order."""
    import pyarrow as pa

    tables = [pa.ipc.open_file(pa.memory_map(str(path))).read_all() for path in (a, b)]
    return all(tables[0].column(c).equals(tables[1].column(c)) for c in ("side", "text", "embedding"))


def measure(args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    (folder / "baseline").mkdir()
    package = harness.package_at(args.baseline, folder / "baseline")
    rows = []
    for n in args.rows:
        sized = argparse.Namespace(**{**vars(args), "rows": n})
        data = folder / f"rows-{n}"
        data.mkdir()
        make(data, n, args.dim)
        read = data / "read.arrow"
        run_once("write", sized, package, data, read)  # the file every read reads, with its index
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in WRITES + READS}
        for repeat in range(args.repeats):
            for variant in harness.rotation(WRITES + READS, repeat):
                target = data / f"{variant}.arrow" if variant in WRITES else read
                runs[variant].append(run_once(variant, sized, package, data, target))
            if repeat == 0 and not same_rows(data / "write.arrow", data / "write_before.arrow"):
                raise SystemExit(f"{n} rows: the files of write and write_before differ")
            for variant in WRITES:
                (data / f"{variant}.arrow").unlink()
                (data / f"{variant}.arrow.index").unlink(missing_ok=True)
        file_mib = read.stat().st_size / 2**20
        index_mib = Path(f"{read}.index").stat().st_size / 2**20
        for variant, made in runs.items():
            anon = statistics.median(m["anon_mib"] for m in made)
            rows.append(
                {
                    "variant": variant,
                    "rows": n,
                    "file_mib": round(file_mib, 1),
                    "anon_mib": round(anon, 1),
                    "anon_b_per_row": round(anon * 2**20 / n, 1),
                    "seconds": round(statistics.median(m["seconds"] for m in made), 3),
                    "lookup_s": round(statistics.median(m["lookup_s"] for m in made), 4) if variant in READS else None,
                    "index_mib": round(index_mib, 1),
                }
            )
        for path in data.iterdir():
            path.unlink()
        data.rmdir()
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.variant is not None:
        measure_main(args)
        return
    meta = harness.metadata("cpu", baseline=args.baseline, dim=args.dim, lookups=args.lookups)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="index-", dir=out) as folder:  # on the results' disk, as a run's would be
        rows = measure(args, Path(folder))

    def figure() -> Any:
        import matplotlib.pyplot as plt

        fig, (memory, seconds) = plt.subplots(1, 2, figsize=(10, 3.5))
        for variant in WRITES + READS:
            mine = [r for r in rows if r["variant"] == variant]
            style = "x--" if variant in WRITES else "o-"
            memory.plot([r["rows"] for r in mine], [max(r["anon_mib"], 0.1) for r in mine], style, label=variant)
            seconds.plot([r["rows"] for r in mine], [r["seconds"] for r in mine], style, label=variant)
        for ax, label in ((memory, "peak anonymous memory above start (MiB)"), (seconds, "seconds")):
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(plt.NullFormatter())  # the sizes' own ticks only
            ax.set_yscale("log")  # the indexed read's megabytes and milliseconds beside the whole reads'
            ax.set_xlabel("rows of the file")
            ax.set_ylabel(label)
            ax.legend(fontsize=7)
        fig.suptitle(f"a teacher file read with its index, whole, and before the index; {meta['cpu']}", fontsize=8)
        fig.tight_layout()
        return fig

    harness.write_results(out, NAME, meta, {"args": vars(args)}, rows=rows, fields=FIELDS, figure=figure)
    for r in rows:
        lookup = f", lookup {r['lookup_s'] * 1e3:.0f} ms" if r["lookup_s"] is not None else ""
        print(
            f"{r['variant']:12s} {r['rows']:>8d} rows ({r['file_mib']:.0f} MiB): +{r['anon_mib']:.1f} MiB "
            f"({r['anon_b_per_row']:.0f} B a row), {r['seconds']:.3f} s{lookup}"
        )


if __name__ == "__main__":
    main()
