"""What a rank keeps of a text-pairs file and how long it takes to build, each distinct text tokenized once and kept
unpadded (this tree) against every served text tokenized and padded at load (`--baseline`), and what drawing a batch
costs in each (CPU).

    python -m benchmarks.pairs_load_bench                                         # docs/performance.md's table
    python -m benchmarks.pairs_load_bench --rows 2048 --repeats 1 --out /tmp/p   # smoke (half a minute)

The files are JSON lines of English text (the bundled WordNet definitions: a query is one, a passage six joined):
- `flag`: FlagEmbedding's rows `{"query", "pos": [1 passage], "neg": [15 passages]}`, the passages drawn from a
  corpus of as many passages as rows, trained as `train_configs/bge_finetune.toml` trains them (7 negatives drawn
  per row and epoch);
- `triplets`: `{"query", "positive", "negative"}` rows, every text its own (no text repeats).
The model is the default bi_encoder (all-MiniLM-L6-v2's tokenizer), queries cut at 64 tokens and documents at 256,
as bge_finetune.toml has them. Each measurement is a fresh process (this file run as a script, the variant's
titan_contrastive first on PYTHONPATH) that builds the run's data as the trainer does (`build_data`, no data
workers), then draws batches of `--batch` rows. Per variant, medians of `--repeats` interleaved runs of:
- `peak_mib`: the process's largest resident memory while it built the data, above its resident memory before
  (VmHWM, reset first: `harness.reset_peak_rss`); `kept_mib`: its anonymous memory after the build above that before
  (what the allocators kept of the rows read, too); `tokens_mib`: what the set's token ids take (`nbytes`);
- `load_s`: the build's seconds; `batch_ms`: the median of 20 batches' `__getitems__`.
`file_mib` is the file's size. `this` is this tree; `before` the baseline's package (default 4c6e351, the last commit
before the token table), extracted by `harness.package_at`. Writes pairs_load_bench.{json,csv,png} (`--name`: another
stem) under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness

NAME = "pairs_load_bench"
FIELDS = ["kind", "variant", "rows", "file_mib", "peak_mib", "kept_mib", "tokens_mib", "load_s", "batch_ms"]
KINDS = ("flag", "triplets")
VARIANTS = ("this", "before")
NEGATIVES = 15


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1 << 13, 1 << 15])
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline", default="4c6e351", help="the commit before the token table")
    p.add_argument("--out", default=str(harness.RESULTS))
    p.add_argument("--name", default=NAME, help="the results' file stem (another baseline's comparison beside)")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # a measurement (run_once)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def make(file: Path, kind: str, n: int) -> Path:
    """`n` rows of `kind` (the module docstring) as JSON lines in `file`."""
    from titan_contrastive.datasets.wordnet import BUNDLE_DIR, load_pairs

    definitions, _ = load_pairs(BUNDLE_DIR, "train")
    draw = random.Random(0)

    def passage() -> str:
        return ". ".join(draw.choice(definitions) for _ in range(6)) + "."

    corpus = [passage() for _ in range(n)] if kind == "flag" else []
    with file.open("w", encoding="utf-8") as f:
        for _ in range(n):
            query = draw.choice(definitions)
            if kind == "flag":
                row = {"query": query, "pos": [draw.choice(corpus)], "neg": draw.sample(corpus, NEGATIVES)}
            else:
                row = {"query": query, "positive": passage(), "negative": passage()}
            f.write(json.dumps(row) + "\n")
    return file


def flags(kind: str, file: Path) -> list[str]:
    """The run's settings (the module docstring)."""
    given = ["--model.name=bi_encoder", "--model.flavor=shared", "--data.dataset=pairs", f"--data.path={file}"]
    given += ["--data.context_length=64", "--data.doc_context_length=256"]
    return given + (["--data.negatives_per_row=7"] if kind == "flag" else [])


def measure_main(args: argparse.Namespace) -> None:
    """One measurement (`--variant`, one kind and size): writes FOLDER/measured.json."""
    import titan_contrastive
    from titan_contrastive import models
    from titan_contrastive.config.manager import parse_args
    from titan_contrastive.datasets import build_dataset
    from titan_contrastive.datasets.build import build_data

    folder, kind = Path(args.folder), args.kinds[0]
    where = Path(titan_contrastive.__file__).resolve()
    assert (args.variant == "before") == (where.parents[1] != harness.REPO), where  # this tree's, or the baseline's
    cfg = parse_args(flags(kind, folder / "rows.jsonl"))
    spec = models.get_model_spec(cfg.model.name)
    model_args, _ = models.resolve_model_args(cfg.model.name, cfg.model.flavor, cfg.model.init_from)
    model_args = models.configured(model_args, cfg, spec)
    spec.build_tokenizer(model_args).encode(["the tokenizer's first call"], 8)  # its load is no part of the rows'
    base, rss = harness.status_kib("RssAnon"), harness.rss_mib()
    assert harness.reset_peak_rss(), "the peak RSS cannot be reset here (/proc/self/clear_refs)"
    start = time.perf_counter()
    data = build_data(
        cfg,
        family_tokenizer=lambda: spec.build_tokenizer(model_args),
        prepare=lambda ds: spec.layout.prepare(ds, model_args, cfg.data.image_sizes, cfg.model.name),
        build_bundled=build_dataset,
        dp_rank=0,
        dp_degree=1,
        pin_memory=False,
    )
    load = time.perf_counter() - start
    measured = {"load_s": load, "peak_mib": harness.peak_rss_mib() - rss}
    measured["kept_mib"] = (harness.status_kib("RssAnon") - base) / 1024
    train = data.train_set
    assert len(train) == args.rows[0], (len(train), args.rows)
    measured["tokens_mib"] = (train._queries.nbytes + train._documents.nbytes) / 2**20
    times = []
    for b in range(20):
        at = [(b * args.batch + i) % len(train) for i in range(args.batch)]
        start = time.perf_counter()
        train.__getitems__(at)
        times.append(time.perf_counter() - start)
    measured["batch_ms"] = statistics.median(times) * 1e3
    (folder / "measured.json").write_text(json.dumps(measured))


def run_once(variant: str, kind: str, n: int, batch: int, package: Path, folder: Path) -> dict:
    """One measurement in a fresh process."""
    trees = [str(package), str(harness.REPO)] if variant == "before" else [str(harness.REPO)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(trees), "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, __file__, f"--variant={variant}", f"--folder={folder}", f"--rows={n}", f"--kinds={kind}"]
    if subprocess.run(command + [f"--batch={batch}"], env=env).returncode:
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
            size = make(data / "rows.jsonl", kind, n).stat().st_size / 2**20
            runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
            for r in range(args.repeats):
                for variant in harness.rotation(VARIANTS, r):
                    runs[variant].append(run_once(variant, kind, n, args.batch, package, data))
            for variant, made in runs.items():
                row = {"kind": kind, "variant": variant, "rows": n, "file_mib": round(size, 1)}
                fields = ("peak_mib", "kept_mib", "tokens_mib", "load_s", "batch_ms")
                row |= {f: round(statistics.median(m[f] for m in made), 3) for f in fields}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def draw(rows: list[dict[str, Any]], meta: dict[str, Any]) -> Any:
    """The figure of `rows` (per kind, each variant's kept memory and build time against the rows)."""
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    fig, axes = plt.subplots(2, len(kinds), figsize=(4.5 * len(kinds), 6), squeeze=False)
    for column, kind in enumerate(kinds):
        for variant, style in zip(VARIANTS, ("o-", "x--")):
            mine = [r for r in rows if r["kind"] == kind and r["variant"] == variant]
            sizes = [r["rows"] for r in mine]
            axes[0][column].plot(sizes, [r["kept_mib"] for r in mine], style, label=f"{variant}: kept")
            axes[0][column].plot(sizes, [r["peak_mib"] for r in mine], style, alpha=0.4, label=f"{variant}: peak")
            axes[1][column].plot(sizes, [r["load_s"] for r in mine], style, label=variant)
        sizes = sorted({r["rows"] for r in rows if r["kind"] == kind})
        for ax, label in zip((axes[0][column], axes[1][column]), ("MiB above the process before", "build seconds")):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xticks(sizes, [f"{n:,}" for n in sizes])
            ax.xaxis.set_minor_formatter(plt.NullFormatter())
            ax.set_xlabel("rows of the file")
            ax.set_ylabel(label)
            ax.set_title(kind, fontsize=9)
            ax.legend(fontsize=7)
    fig.suptitle(f"a text-pairs set's memory and build, this tree and {meta['baseline']}; {meta['cpu']}", fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.variant:
        measure_main(args)
        return
    meta = harness.metadata("cpu", baseline=args.baseline)
    with tempfile.TemporaryDirectory(prefix="pairs_load_") as folder:
        rows = measure(args, Path(folder))
    harness.write_results(
        args.out, args.name, meta, {"args": vars(args)}, rows=rows, fields=FIELDS, figure=lambda: draw(rows, meta)
    )


if __name__ == "__main__":
    main()
