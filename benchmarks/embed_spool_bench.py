"""Memory of the ranks while `embed_images` hands a teacher's rows to rank 0 and writes the file: the rows spooled to
rank 0's disk as they come (`row_spool`), its keys as digests, against the same spool with its keys as Python strs and
the gather of whole shards before it (CPU, gloo).

    python -m benchmarks.embed_spool_bench                                          # the table of docs/performance.md
    python -m benchmarks.embed_spool_bench --rows 8192 16384 --repeats 1 --out /tmp/s        # smoke (seconds)

The embedding itself is left out (the same in all). `--world` gloo processes (this file run as a script, fresh ones
for each measurement) make chunks of `--chunk` rows of `--dim` float32 vectors (random, seeded by the chunk) keyed by
40 hex digits (a SHA-1's length), `--rows` in all, and hand them on as `embed_images` does:
- `spool` (this tree): rank r makes chunks r, r + W, ... (`row_spool.shard`) and sends each as it is made
  (`RowSpool.send`); rank 0 appends them to files beside the output, holding each key's digest, then `write_rows`
  writes the mapped keys and vectors;
- `spool_strs` (`--spool-strs`, default 1ba5c20, the spool before its keys left the heap): the same, rank 0 holding
  every key as a str in a set and a list, which the writer makes an Arrow column;
- `gather` (`--baseline`, default 4d35b99, the last commit before the spool, its package extracted by
  `harness.package_at` and put first on the ranks' PYTHONPATH, as `spool_strs`'s is): rank r makes its contiguous
  shard of the chunks and keeps them; `side_rows` gathers the shards onto rank 0 in pieces of 65,536 rows per rank,
  which keeps each key's first row and `write`s them.
All write an .arrow file of the same rows (checked: the same keys, each with the same vector). Per variant and size,
medians of `--repeats` interleaved runs: each rank's peak anonymous memory above its start (RssAnon of
/proc/self/status, sampled every millisecond by a thread: the heap; a file mapped and read counts in RSS but is the
kernel's to drop, so VmHWM is recorded beside it), and rank 0's wall time from the first chunk to the file renamed.
Writes embed_spool_bench.{json,csv,png} under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness

NAME = "embed_spool_bench"
FIELDS = ["variant", "rows", "table_mib", "rank0_anon_mib", "rank1_anon_mib", "rank0_hwm_mib", "seconds", "to_table"]
VARIANTS = ("spool", "spool_strs", "gather")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1 << 17, 1 << 19, 1 << 20])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline", default="4d35b99", help="the gather's commit")
    p.add_argument("--spool-strs", default="1ba5c20", help="the commit of the spool of keys as strs")
    p.add_argument("--out", default=str(harness.RESULTS))
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # a measurement's rank (run_once)
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def make(chunk: int, args: argparse.Namespace) -> tuple[list[str], Any]:
    """Chunk `chunk`'s keys and vectors."""
    import torch

    start, stop = chunk * args.chunk, min((chunk + 1) * args.chunk, args.rows)
    vectors = torch.randn(stop - start, args.dim, generator=torch.Generator().manual_seed(chunk))
    return [f"{i:040x}" for i in range(start, stop)], vectors


def rank_main(args: argparse.Namespace) -> None:
    """One rank of one measurement (`--rank`): this file run as a script with the variant's titan_contrastive first on
    PYTHONPATH; writes TARGET.RANK.json."""
    import numpy as np
    import torch
    import torch.distributed as dist

    import titan_contrastive

    rank, world, cpu, target = args.rank, args.world, torch.device("cpu"), Path(args.target)
    where = Path(titan_contrastive.__file__).resolve()
    assert (args.variant == "spool") == (where.parents[1] == harness.REPO), where  # this tree's, or a baseline's
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{args.port}")
    chunks = -(-args.rows // args.chunk)
    dist.barrier()
    start, probe = time.perf_counter(), harness.AnonPeak()
    base = probe.peak
    if args.variant != "gather":
        from titan_contrastive.embed import write_rows
        from titan_contrastive.row_spool import RowSpool, shard

        rounds = shard(args.rows, args.chunk, rank, world)[1]
        with RowSpool(["image"], None if rank else target.parent, world, cpu) as spool:
            for t in range(rounds):
                c = t * world + rank
                spool.send(0, *(make(c, args) if c < chunks else ([], None)))
            if rank == 0:
                write_rows(target, *spool.rows())
    else:
        from titan_contrastive.embed import write
        from titan_contrastive.embed_images import side_rows

        keys, rows = [], []
        for c in np.array_split(np.arange(chunks), world)[rank].tolist():
            named, vectors = make(c, args)
            keys += named
            rows.append(vectors)
        got = side_rows(keys, rows, torch.float32, cpu, world)
        if rank == 0:
            write(target, [("image", *got)])
    seconds = time.perf_counter() - start
    anon = probe.stop() - base
    Path(f"{target}.{rank}.json").write_text(
        json.dumps({"anon_mib": anon / 1024, "hwm_mib": harness.status_kib("VmHWM") / 1024, "seconds": seconds})
    )
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # past gloo's threads' teardown at exit, which now and then aborted a rank that had finished


def run_once(variant: str, args: argparse.Namespace, packages: dict[str, Path], folder: Path) -> dict[str, Any]:
    """One measurement in fresh processes: each rank's peak anonymous memory and rank 0's time; the file's rows."""
    target = folder / f"{variant}.arrow"
    trees = [str(packages[variant]), str(harness.REPO)] if variant in packages else [str(harness.REPO)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(trees), "CUDA_VISIBLE_DEVICES": ""}
    flags = [f"--{name}={getattr(args, name)}" for name in ("rows", "dim", "chunk", "world")]
    with socket.socket() as free:  # rank 0's store listens here
        free.bind(("127.0.0.1", 0))
        flags.append(f"--port={free.getsockname()[1]}")
    ranks = [
        subprocess.Popen(
            [sys.executable, __file__, f"--rank={r}", f"--variant={variant}", f"--target={target}", *flags], env=env
        )
        for r in range(args.world)
    ]
    if any(rank.wait() for rank in ranks):
        raise SystemExit(f"{variant}, {args.rows} rows: a rank failed (its error is above)")
    return {"ranks": [json.loads(Path(f"{target}.{r}.json").read_text()) for r in range(args.world)], "file": target}


def same_rows(a: Path, b: Path) -> bool:
    """The two .arrow files hold the same keys, each with the same vector (in any order)."""
    import numpy as np
    import pyarrow as pa

    def rows(path: Path) -> tuple[list[str], np.ndarray]:
        table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
        keys = table.column("text").to_pylist()
        vectors = table.column("embedding").combine_chunks().flatten().to_numpy().reshape(len(keys), -1)
        order = np.argsort(keys)
        return [keys[i] for i in order], vectors[order]

    (ka, va), (kb, vb) = rows(a), rows(b)
    return ka == kb and np.array_equal(va, vb)


def measure(args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    packages = {}
    for variant, commit in (("spool_strs", args.spool_strs), ("gather", args.baseline)):
        (folder / variant).mkdir()
        packages[variant] = harness.package_at(commit, folder / variant)
    rows = []
    for n in args.rows:
        sized = argparse.Namespace(**{**vars(args), "rows": n})
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
        for repeat in range(args.repeats):
            for variant in harness.rotation(VARIANTS, repeat):
                runs[variant].append(run_once(variant, sized, packages, folder))
            for other in VARIANTS[1:]:
                if repeat == 0 and not same_rows(runs["spool"][0]["file"], runs[other][0]["file"]):
                    raise SystemExit(f"{n} rows: the files of spool and {other} differ")
            for made in runs.values():
                made[-1]["file"].unlink()
        table = n * args.dim * 4 / 2**20
        for variant, made in runs.items():

            def median(rank: int, field: str, made: list = made) -> float:
                return statistics.median(m["ranks"][rank][field] for m in made)

            rows.append(
                {
                    "variant": variant,
                    "rows": n,
                    "table_mib": round(table, 1),
                    "rank0_anon_mib": round(median(0, "anon_mib"), 1),
                    "rank1_anon_mib": round(median(1, "anon_mib"), 1),
                    "rank0_hwm_mib": round(median(0, "hwm_mib"), 1),
                    "seconds": round(median(0, "seconds"), 3),
                    "to_table": round(median(0, "anon_mib") / table, 3),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.rank is not None:
        rank_main(argparse.Namespace(**{**vars(args), "rows": args.rows[0]}))  # one size
        return
    if args.world < 2:
        raise SystemExit(f"--world={args.world}: the gather is between ranks; give 2 or more")
    meta = harness.metadata(
        "cpu", baseline=args.baseline, spool_strs=args.spool_strs, dim=args.dim, chunk=args.chunk, world=args.world
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="spool-", dir=out) as folder:  # on the results' disk, as a run's would be
        rows = measure(args, Path(folder))

    def figure() -> Any:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for variant in VARIANTS:
            mine = [r for r in rows if r["variant"] == variant]
            ax.plot(
                [r["table_mib"] for r in mine], [r["rank0_anon_mib"] for r in mine], "o-", label=f"{variant} rank 0"
            )
            ax.plot(
                [r["table_mib"] for r in mine], [r["rank1_anon_mib"] for r in mine], "x--", label=f"{variant} rank 1"
            )
        ax.set_xlabel("the table's vectors (MiB)")
        ax.set_yscale("log")  # the gather's gigabytes beside the spools' megabytes
        ax.set_ylabel("peak anonymous memory above start (MiB)")
        ax.set_title(f"embed_images' hand-off to rank 0, {args.world} gloo ranks, {meta['cpu']}", fontsize=8)
        ax.legend(fontsize=7)
        fig.tight_layout()
        return fig

    harness.write_results(out, NAME, meta, {"args": vars(args)}, rows=rows, fields=FIELDS, figure=figure)
    for r in rows:
        print(
            f"{r['variant']:10s} {r['rows']:>8d} rows ({r['table_mib']:.0f} MiB): "
            f"rank 0 +{r['rank0_anon_mib']:.0f} MiB "
            f"({r['to_table']:.2f} tables), rank 1 +{r['rank1_anon_mib']:.0f} MiB, {r['seconds']:.2f} s"
        )


if __name__ == "__main__":
    main()
