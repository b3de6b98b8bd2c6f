"""What a data worker pays in memory to look an image-text teacher's keys up (`datasets/frozen.py`'s table), with
the table's key index as a Python dict (the former design) and as `datasets/text_index.py`'s numpy arrays.

    python -m benchmarks.table_memory_bench                       # 1M images and 1M captions
    python -m benchmarks.table_memory_bench --images 200000 --workers 2

A .parquet file of `--images` image rows (keyed by a SHA-1, as `embed_images` keys them) and as many caption rows,
`--dim`-wide vectors (small, so that the keys dominate), is read as a run reads it (`EmbeddingTable.read`). Then, per
design, `--workers` processes are forked from the reader, as a DataLoader forks its workers. Each looks every key of
the file up once, in batches of 256, as the datasets do per batch; the keys are made anew in the worker, as a
worker reads them from its samples. Rows, per design: the index's size in the reader (its arrays; the dict's
objects by `sys.getsizeof`), the memory each worker has written privately after the pass (`Private_Dirty` of
/proc/self/smaps_rollup: pages copied from the reader), and the lookup time per key. Linux only.
Writes table_memory_bench.{json,csv,png}.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness

NAME = "table_memory_bench"
FIELDS = ["design", "keys", "index_mib", "worker_private_mib", "us_per_key"]
BATCH = 256


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", default=str(harness.RESULTS))
    return p.parse_args(argv)


def _key(side: str, i: int) -> str:
    return hashlib.sha1(str(i).encode()).hexdigest() if side == "image" else f"a photo of item {i}"


def _private_mib() -> float:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Private_Dirty:")) / 1024


def _worker(find: Any, images: int, out: Any) -> None:
    """Look every key up once in batches, from keys made here; the private memory written and the seconds."""
    before, start = _private_mib(), time.perf_counter()
    for side in ("image", "caption"):
        for s in range(0, images, BATCH):
            find(side, [_key(side, i) for i in range(s, min(s + BATCH, images))])
    out.put((_private_mib() - before, time.perf_counter() - start))


def _in_workers(find: Any, images: int, workers: int) -> tuple[float, float]:
    """(the workers' median private MiB, their median seconds) of `_worker` in `workers` forked processes."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(find, images, out)) for _ in range(workers)]
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    mib, seconds = zip(*results)
    return sorted(mib)[len(mib) // 2], sorted(seconds)[len(seconds) // 2]


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from titan_contrastive.datasets.frozen import EmbeddingTable

    meta = harness.metadata("cpu")
    n = args.images
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "teacher.parquet"
        sides = ["image"] * n + ["caption"] * n
        texts = [_key("image", i) for i in range(n)] + [_key("caption", i) for i in range(n)]
        vectors = np.random.default_rng(0).standard_normal((2 * n, args.dim)).astype(np.float32)
        embedding = pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), args.dim)
        pq.write_table(pa.table({"side": sides, "text": texts, "embedding": embedding}), file)
        del sides, texts, vectors, embedding
        table = EmbeddingTable.read(str(file), "loss.teacher_embeddings")
    index = table.index
    arrays_mib = sum(a.nbytes for a in (index.high, index.low, index.rows)) / 2**20
    rows = [dict(design="numpy arrays (TextIndex)", find=table.lookup, index_mib=arrays_mib)]
    keyed = {(side, _key(side, i)): i + (side == "caption") * n for side in ("image", "caption") for i in range(n)}
    sizes = sys.getsizeof(keyed) + sum(
        sys.getsizeof(k) + sys.getsizeof(k[1]) + sys.getsizeof(v) for k, v in keyed.items()
    )

    def dict_find(side: str, keys: list[str]) -> list[int]:  # the former EmbeddingTable.lookup's loop
        return [keyed.get((side, key.strip()), -1) for key in keys]

    rows.append(dict(design="Python dict (former)", find=dict_find, index_mib=sizes / 2**20))
    for row in rows:
        mib, seconds = _in_workers(row.pop("find"), n, args.workers)
        row |= dict(keys=2 * n, worker_private_mib=mib, us_per_key=1e6 * seconds / (2 * n))

    def figure() -> Any:
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        labels = [r["design"] for r in rows]
        axes[0].bar(labels, [r["worker_private_mib"] for r in rows])
        axes[0].set_ylabel("MiB a worker copies (median)")
        axes[1].bar(labels, [r["us_per_key"] for r in rows])
        axes[1].set_ylabel("µs per key looked up")
        fig.suptitle(f"{2 * n:,} keys, {args.workers} forked workers, {meta['cpu']}", fontsize=9)
        fig.tight_layout()
        return fig

    harness.write_results(args.out, NAME, meta, {"config": vars(args)}, rows=rows, fields=FIELDS, figure=figure)


if __name__ == "__main__":
    main()
