"""The memory a rank needs while it reads a training set's rows: a CSV of image paths and captions (`csv`) and
vl_pairs rows from JSON lines (`vl_pairs`), Parquet (`parquet`) or one JSON array (`json`, with `--kinds json`), each
row packed as it is read (this tree) against the rows read whole and then packed (`--baseline`) (CPU).

    python -m benchmarks.load_memory_bench                                         # docs/performance.md's table
    python -m benchmarks.load_memory_bench --rows 4096 --repeats 1 --out /tmp/l   # smoke (half a minute)
    python -m benchmarks.load_memory_bench --kinds json --baseline 5549dd4 --out benchmarks/results/json_array

The files are worker_memory_bench's (`make`: per row an image path and a caption of about 60 characters; a query of
about 60 characters, a document of about 150 and two hard negatives like it), the Parquet file the JSON lines' rows
written by pyarrow in row groups of 64K, the JSON array the same rows between `[` and `]`, a row a line. Each
measurement is a fresh process (this file run as a script, the variant's titan_contrastive first on PYTHONPATH) that
builds the run's data as the trainer does (`build_data`, as worker_memory_bench does, no data workers) and draws
nothing. Per variant, medians of `--repeats` interleaved runs of:
- `peak_mib`: the process's largest resident memory while it built the data, above its resident memory before
  (VmHWM of /proc/self/status, reset to the current RSS first: `harness.reset_peak_rss`);
- `kept_mib`: its anonymous memory after the build, above that before (RssAnon): the rows kept, the processor;
- `load_s`: the build's seconds.
`file_mib` is the training file's size. `this` is this tree; `before` the baseline's package (default c71de30, the
last commit before rows were packed as read; for `json`, 5549dd4, the last before a JSON array was read a row at a
time), extracted by `harness.package_at`.
Writes load_memory_bench.{json,csv,png} under --out.
"""

from __future__ import annotations

import argparse
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
from benchmarks.worker_memory_bench import flags, make

NAME = "load_memory_bench"
FIELDS = ["kind", "variant", "rows", "file_mib", "peak_mib", "kept_mib", "load_s"]
KINDS = ("csv", "vl_pairs", "parquet", "json")
DEFAULT_KINDS = KINDS[:3]
VARIANTS = ("this", "before")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1 << 18, 1 << 20])
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(DEFAULT_KINDS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline", default="c71de30", help="the commit before rows were packed as read")
    p.add_argument("--out", default=str(harness.RESULTS))
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # a measurement (run_once)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def data_file(folder: Path, kind: str) -> Path:
    return folder / {"csv": "rows.csv", "vl_pairs": "rows.jsonl", "parquet": "rows.parquet", "json": "rows.json"}[kind]


def make_kind(folder: Path, kind: str, n: int) -> Path:
    """The training file of `n` rows (and the model folder, for vl_pairs rows)."""
    made = make(folder, "csv" if kind == "csv" else "vl_pairs", n, images=64)
    if kind == "parquet":
        import pyarrow.json
        import pyarrow.parquet as pq

        pq.write_table(pyarrow.json.read_json(made), data_file(folder, kind), row_group_size=1 << 16)
        made.unlink()
    if kind == "json":
        with made.open() as lines, data_file(folder, kind).open("w") as out:
            out.write("[\n" + ",\n".join(line.rstrip("\n") for line in lines) + "\n]\n")
        made.unlink()
    return data_file(folder, kind)


def measure_main(args: argparse.Namespace) -> None:
    """One measurement (`--variant`, one kind and size): writes FOLDER/measured.json."""
    import pandas  # noqa: F401 - before pyarrow, as the trainer's imports have it
    import pyarrow.parquet  # noqa: F401 - its import is no part of the rows' cost

    import titan_contrastive
    from titan_contrastive import models
    from titan_contrastive.config.manager import parse_args
    from titan_contrastive.datasets import build_dataset
    from titan_contrastive.datasets.build import build_data

    folder, kind = Path(args.folder), args.kinds[0]
    where = Path(titan_contrastive.__file__).resolve()
    assert (args.variant == "before") == (where.parents[1] != harness.REPO), where  # this tree's, or the baseline's
    given = flags("csv" if kind == "csv" else "vl_pairs", folder, argparse.Namespace(workers=0, batch=256))
    cfg = parse_args(
        [f for f in given if not f.startswith("--data.path=")] + [f"--data.path={data_file(folder, kind)}"]
    )
    spec = models.get_model_spec(cfg.model.name)
    model_args, _ = models.resolve_model_args(cfg.model.name, cfg.model.flavor, cfg.model.init_from)
    model_args = models.configured(model_args, cfg, spec)
    if kind != "csv":  # the processor's first load (its imports) is no part of the rows' cost
        from titan_contrastive.models.qwen_vl.processor import VLProcessor

        VLProcessor(str(folder / "model"), 0, 0, 64)
    base, rss = harness.status_kib("RssAnon"), harness.rss_mib()
    assert harness.reset_peak_rss(), "the peak RSS cannot be reset here (/proc/self/clear_refs)"
    start = time.perf_counter()
    data = build_data(
        cfg,
        family_tokenizer=lambda: spec.build_tokenizer(model_args) if spec.build_tokenizer else None,
        prepare=lambda ds: spec.layout.prepare(ds, model_args, cfg.data.image_sizes, cfg.model.name),
        build_bundled=build_dataset,
        dp_rank=0,
        dp_degree=1,
        pin_memory=False,
    )
    load = time.perf_counter() - start
    measured = {"load_s": load, "peak_mib": harness.peak_rss_mib() - rss}
    measured["kept_mib"] = (harness.status_kib("RssAnon") - base) / 1024
    assert len(data.train_set) == args.rows[0], (len(data.train_set), args.rows)
    (folder / "measured.json").write_text(json.dumps(measured))


def run_once(variant: str, kind: str, n: int, package: Path, folder: Path) -> dict:
    """One measurement in a fresh process."""
    trees = [str(package), str(harness.REPO)] if variant == "before" else [str(harness.REPO)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(trees), "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, __file__, f"--variant={variant}", f"--folder={folder}", f"--rows={n}", f"--kinds={kind}"]
    if subprocess.run(command, env=env).returncode:
        raise SystemExit(f"{variant}, {kind}, {n} rows: the measurement failed (its error is above)")
    made = json.loads((folder / "measured.json").read_text())
    (folder / "measured.json").unlink()
    return made


def measure(args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    (folder / "baseline").mkdir()
    package = harness.package_at(args.baseline, folder / "baseline")
    rows = []
    for kind in args.kinds:
        for n in args.rows:
            data = folder / f"{kind}-{n}"
            data.mkdir()
            size = make_kind(data, kind, n).stat().st_size / 2**20
            runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
            for r in range(args.repeats):
                for variant in harness.rotation(VARIANTS, r):
                    runs[variant].append(run_once(variant, kind, n, package, data))
            for variant, made in runs.items():
                row = {"kind": kind, "variant": variant, "rows": n, "file_mib": round(size, 1)}
                row |= {f: round(statistics.median(m[f] for m in made), 3) for f in ("peak_mib", "kept_mib", "load_s")}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def draw(rows: list[dict[str, Any]], meta: dict[str, Any]) -> Any:
    """The figure of `rows` (per kind, each variant's peak and kept memory against the rows)."""
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.5 * len(kinds), 3.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for variant, style in zip(VARIANTS, ("o-", "x--")):
            mine = [r for r in rows if r["kind"] == kind and r["variant"] == variant]
            sizes = [r["rows"] for r in mine]
            ax.plot(sizes, [r["peak_mib"] for r in mine], style, label=f"{variant}: peak while reading")
            ax.plot(sizes, [r["kept_mib"] for r in mine], style, alpha=0.4, label=f"{variant}: kept")
        sizes = sorted({r["rows"] for r in rows if r["kind"] == kind})
        ax.set_xscale("log")
        ax.set_xticks(sizes, [f"{n:,}" for n in sizes])
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.set_xlabel("rows of the file")
        ax.set_ylabel("MiB above the process before")
        ax.set_title(kind, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"a rank's memory while it reads its rows, packed as read and before; {meta['cpu']}", fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.variant:
        measure_main(args)
        return
    meta = harness.metadata("cpu", baseline=args.baseline)
    with tempfile.TemporaryDirectory(prefix="load_memory_") as folder:
        rows = measure(args, Path(folder))
    harness.write_results(
        args.out, NAME, meta, {"args": vars(args)}, rows=rows, fields=FIELDS, figure=lambda: draw(rows, meta)
    )


if __name__ == "__main__":
    main()
