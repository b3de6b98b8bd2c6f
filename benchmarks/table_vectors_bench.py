"""What the ranks of one machine pay in memory to hold a frozen model's vectors (`[loss] teacher_embeddings`,
`datasets/frozen.py`): a .parquet file, read into each rank's memory, against an .arrow file, which each rank maps.

    python -m benchmarks.table_vectors_bench                      # 500K texts x 512 float32 (977 MiB), 4 ranks
    python -m benchmarks.table_vectors_bench --rows 20000 --dim 64 --ranks 2

One table of `--rows` texts and random `--dim`-wide float32 vectors is written three ways: .parquet and .arrow by
`titan_contrastive.embed.write` (the .arrow file one record batch), and .arrow by pyarrow's Feather writer at its
default 64K rows per record batch (what a user's own file often is). Per file, `--ranks` processes are spawned, as
torchrun starts ranks: once all have started, each reads the file as a run does (`EmbeddingTable.read`, which
checks every vector), then serves `--lookups` batches of `--batch` random rows. With every rank still holding its
table, each reads its /proc/self/smaps_rollup; the rows give, per file, the medians over ranks of what reading added:
private memory (pages no other process shares) and proportional set size (PSS: shared pages divided among the
processes that map them), the machine's sum of PSS, the read time and the time per row served. Linux only. Writes
table_vectors_bench.{json,csv,png}.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness

NAME = "table_vectors_bench"
FIELDS = ["file", "ranks", "private_mib", "pss_mib", "machine_pss_mib", "read_s", "us_per_row"]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=500_000)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--lookups", type=int, default=200)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--out", default=str(harness.RESULTS))
    return p.parse_args(argv)


def _memory_mib() -> dict[str, float]:
    """This process's private and proportional memory (MiB), from /proc/self/smaps_rollup."""
    fields = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if rest.strip().endswith("kB"):
                fields[name] = int(rest.split()[0]) / 1024
    return {"private": fields["Private_Clean"] + fields["Private_Dirty"], "pss": fields["Pss"]}


def _rank(rank: int, file: str, lookups: int, batch: int, barrier: Any, out: Any) -> None:
    """One rank: read the table, serve random rows, report what reading added while every rank holds its table."""
    import torch

    from titan_contrastive.datasets.frozen import EmbeddingTable

    torch.set_num_threads(1)
    barrier.wait()  # every rank started: what follows is the table's
    before = _memory_mib()
    start = time.perf_counter()
    table = EmbeddingTable.read(file, "loss.teacher_embeddings")
    read_s = time.perf_counter() - start
    g = torch.Generator().manual_seed(rank)
    start = time.perf_counter()
    for _ in range(lookups):
        table.vectors[torch.randint(0, len(table.vectors), (batch,), generator=g)]
    us = 1e6 * (time.perf_counter() - start) / (lookups * batch)
    barrier.wait()  # every rank holds its table
    after = _memory_mib()
    barrier.wait()
    added = {k: after[k] - before[k] for k in after}
    out.put(dict(rank=rank, read_s=read_s, us_per_row=us, private_mib=added["private"], pss_mib=added["pss"]))


def _ranks(file: Path, args: argparse.Namespace) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(args.ranks), ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, str(file), args.lookups, args.batch, barrier, out))
        for r in range(args.ranks)
    ]
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"a rank reading {file.name} exited with {p.exitcode}")
    median = {k: statistics.median(r[k] for r in results) for k in ("private_mib", "pss_mib", "read_s", "us_per_row")}
    return median | {"machine_pss_mib": sum(r["pss_mib"] for r in results)}


def _write_files(folder: Path, rows: int, dim: int) -> dict[str, Path]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.feather as feather

    from titan_contrastive.embed import write

    texts = [f"document {i}" for i in range(rows)]
    vectors = np.random.default_rng(0).standard_normal((rows, dim), dtype=np.float32)
    files = {}
    for label, suffix in ((".parquet", ".parquet"), (".arrow (embed: one record batch)", ".arrow")):
        files[label] = write_to = folder / f"table{suffix}"
        write(write_to, [("document", texts, vectors)])
    table = pa.table(
        {"text": texts, "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), dim)}
    )
    files[".arrow (Feather, 64K-row batches)"] = feather_file = folder / "feather.arrow"
    feather.write_feather(table, feather_file, compression="uncompressed")
    return files


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    meta = harness.metadata("cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, file in _write_files(Path(tmp), args.rows, args.dim).items():
            rows.append(dict(file=label, ranks=args.ranks, **_ranks(file, args)))
    vectors_mib = args.rows * args.dim * 4 / 2**20

    def figure() -> Any:
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        labels = [r["file"].replace(" (", "\n(") for r in rows]
        axes[0].bar(labels, [r["machine_pss_mib"] for r in rows])
        axes[0].axhline(vectors_mib, color="gray", linestyle="--", label="the vectors once")
        axes[0].set_ylabel(f"MiB on the machine ({args.ranks} ranks, PSS)")
        axes[0].legend(fontsize=8)
        axes[1].bar(labels, [r["us_per_row"] for r in rows])
        axes[1].set_ylabel("µs per row served")
        for ax in axes:
            ax.tick_params(axis="x", labelsize=7)
        fig.suptitle(f"{args.rows:,} x {args.dim} float32 vectors, {meta['cpu']}", fontsize=9)
        fig.tight_layout()
        return fig

    payload = {"config": vars(args), "vectors_mib": vectors_mib}
    harness.write_results(args.out, NAME, meta, payload, rows=rows, fields=FIELDS, figure=figure)


if __name__ == "__main__":
    main()
