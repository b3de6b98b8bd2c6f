"""What a rank keeps of rows that name their documents by id in a corpus file (`data.corpus`), against the same rows
holding the texts, as the corpus grows around the documents the rows name (CPU).

    python -m benchmarks.corpus_load_bench                                              # docs/performance.md's table
    python -m benchmarks.corpus_load_bench --rows 1024 --factors 1 4 --repeats 1 --out /tmp/c   # smoke (seconds)

The rows are `pairs_load_bench`'s `flag` rows (a WordNet definition as the query, one positive and 15 negatives drawn
from a pool of as many passages as rows, six definitions joined each), trained as bge_finetune.toml trains them (7
negatives drawn per row and epoch, queries cut at 64 tokens and documents at 256):
- `texts`: FlagEmbedding's rows `{"query", "pos", "neg"}` of the passages' texts;
- `ids`: tevatron's rows `{"query_id", "query_text", "positive_document_ids", "negative_document_ids"}` of the
  passages' ids, and a corpus file of `{"docid", "text"}` rows: the pool and `factor - 1` times as many passages no row
  names, shuffled together (a corpus of which the rows use 1/factor), as JSON lines;
- `ids_before`: that, read by the package of `--ids-baseline` (default 748b4d7, the last commit that read a JSON lines
  corpus a line at a time, every row a Python object, before choosing by id), extracted by `harness.package_at`;
- `parquet`: the same rows against the same corpus as a Parquet file, read by its id column first (this tree);
- `parquet_before`: that, read by the package of `--baseline` (default f5d75db, the last commit that made every
  Parquet row Python objects before choosing by id).
Each measurement is a fresh process (this file run as a script) that builds the run's data as the trainer does
(`build_data`, no data workers). Per variant and factor, medians of `--repeats` interleaved runs of: `peak_mib`, the
process's largest resident memory while it built the data, above its resident memory before (VmHWM, reset first:
`harness.reset_peak_rss`); `kept_mib`, its anonymous memory after the build above that before; `tokens_mib`, what the
set's token ids take (equal in every variant: the same texts are tokenized); `load_s`, the build's seconds.
`rows_mib` is the variant's rows file's size, `corpus_mib` the corpus's. Writes corpus_load_bench.{json,csv,png}
under --out.
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

NAME = "corpus_load_bench"
FIELDS = ["variant", "rows", "factor", "rows_mib", "corpus_mib", "peak_mib", "kept_mib", "tokens_mib", "load_s"]
VARIANTS = ("texts", "ids", "ids_before", "parquet", "parquet_before")
NEGATIVES = 15


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1 << 13)
    p.add_argument("--factors", type=int, nargs="+", default=[1, 8, 64], help="corpus size / the passages named")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(harness.RESULTS))
    p.add_argument("--baseline", default="f5d75db", help="the commit before the Parquet corpus's Arrow filter")
    p.add_argument("--ids-baseline", default="748b4d7", help="the commit before the JSON lines corpus's Arrow filter")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # a measurement (run_once)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def make(folder: Path, n: int, factors: list[int]) -> dict[str, float]:
    """The rows of both variants and a corpus per factor (the module docstring) in `folder`; their sizes in MiB."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from titan_contrastive.datasets.wordnet import BUNDLE_DIR, load_pairs

    definitions, _ = load_pairs(BUNDLE_DIR, "train")
    draw = random.Random(0)

    def passage() -> str:
        return ". ".join(draw.choice(definitions) for _ in range(6)) + "."

    pool = [passage() for _ in range(n)]
    with (folder / "texts.jsonl").open("w") as texts, (folder / "ids.jsonl").open("w") as ids:
        for r in range(n):
            query, pos, neg = draw.choice(definitions), draw.randrange(n), draw.sample(range(n), NEGATIVES)
            texts.write(json.dumps({"query": query, "pos": [pool[pos]], "neg": [pool[j] for j in neg]}) + "\n")
            row = {"query_id": f"q{r}", "query_text": query, "positive_document_ids": [f"d{pos}"]}
            ids.write(json.dumps(row | {"negative_document_ids": [f"d{j}" for j in neg]}) + "\n")
    sizes = {f"rows_mib_{v}": (folder / f"{v}.jsonl").stat().st_size / 2**20 for v in VARIANTS[:2]}
    for factor in factors:
        docs = [(f"d{i}", t) for i, t in enumerate(pool)] + [(f"x{i}", passage()) for i in range((factor - 1) * n)]
        draw.shuffle(docs)
        corpus = folder / f"corpus-{factor}.jsonl"
        corpus.write_text("".join(json.dumps({"docid": i, "text": t}) + "\n" for i, t in docs))
        sizes[f"corpus_mib_{factor}"] = corpus.stat().st_size / 2**20
        pq.write_table(
            pa.table({"docid": [i for i, _ in docs], "text": [t for _, t in docs]}), corpus.with_suffix(".parquet")
        )
        sizes[f"corpus_mib_{factor}_parquet"] = corpus.with_suffix(".parquet").stat().st_size / 2**20
    return sizes


def flags(variant: str, folder: Path, factor: int) -> list[str]:
    """The run's settings (the module docstring)."""
    given = ["--model.name=bi_encoder", "--model.flavor=shared", "--data.dataset=pairs", "--data.negatives_per_row=7"]
    rows = folder / ("texts.jsonl" if variant == "texts" else "ids.jsonl")
    given += ["--data.context_length=64", "--data.doc_context_length=256", f"--data.path={rows}"]
    suffix = ".parquet" if variant.startswith("parquet") else ".jsonl"
    return given + ([f"--data.corpus={folder / f'corpus-{factor}{suffix}'}"] if variant != "texts" else [])


def measure_main(args: argparse.Namespace) -> None:
    """One measurement (`--variant`, one factor): writes FOLDER/measured.json."""
    import titan_contrastive
    from titan_contrastive import models
    from titan_contrastive.config.manager import parse_args
    from titan_contrastive.datasets import build_dataset
    from titan_contrastive.datasets.build import build_data

    where = Path(titan_contrastive.__file__).resolve()
    assert args.variant.endswith("_before") == (where.parents[1] != harness.REPO), where  # this tree's or not
    folder = Path(args.folder)
    cfg = parse_args(flags(args.variant, folder, args.factors[0]))
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
    measured = {"load_s": time.perf_counter() - start, "peak_mib": harness.peak_rss_mib() - rss}
    measured["kept_mib"] = (harness.status_kib("RssAnon") - base) / 1024
    train = data.train_set
    assert len(train) == args.rows, (len(train), args.rows)
    measured["tokens_mib"] = (train._queries.nbytes + train._documents.nbytes) / 2**20
    (folder / "measured.json").write_text(json.dumps(measured))


def run_once(variant: str, factor: int, n: int, package: Path | None, folder: Path) -> dict:
    """One measurement in a fresh process (a `_before` variant: with its baseline's `package` first on the path)."""
    trees = [str(package), str(harness.REPO)] if package else [str(harness.REPO)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(trees), "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, __file__, f"--variant={variant}", f"--folder={folder}", f"--rows={n}"]
    if subprocess.run(command + [f"--factors={factor}"], env=env).returncode:
        raise SystemExit(f"{variant}, factor {factor}: the measurement failed (its error is above)")
    made = json.loads((folder / "measured.json").read_text())
    (folder / "measured.json").unlink()
    return made


def measure(args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    packages: dict[str, Path | None] = dict.fromkeys(VARIANTS)
    for variant, commit in (("parquet_before", args.baseline), ("ids_before", args.ids_baseline)):
        (folder / variant).mkdir()
        packages[variant] = harness.package_at(commit, folder / variant)
    sizes = make(folder, args.rows, args.factors)
    cases = [("texts", 0)] + [(v, f) for f in args.factors for v in VARIANTS[1:]]
    runs: dict[tuple[str, int], list[dict]] = {case: [] for case in cases}
    for r in range(args.repeats):
        for variant, factor in harness.rotation(cases, r):
            runs[variant, factor].append(run_once(variant, max(factor, 1), args.rows, packages[variant], folder))
    rows = []
    for (variant, factor), made in runs.items():
        row = {
            "variant": variant,
            "rows": args.rows,
            "factor": factor,
            "rows_mib": round(sizes[f"rows_mib_{'texts' if variant == 'texts' else 'ids'}"], 1),
        }
        parquet = "_parquet" if variant.startswith("parquet") else ""
        row["corpus_mib"] = round(sizes[f"corpus_mib_{factor}{parquet}"], 1) if factor else 0.0
        row |= {f: round(statistics.median(m[f] for m in made), 3) for f in FIELDS[5:]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def draw(rows: list[dict[str, Any]], meta: dict[str, Any]) -> Any:
    """The figure of `rows`: each variant's memory and build time against the corpus's size (texts: flat lines)."""
    import matplotlib.pyplot as plt

    texts = next(r for r in rows if r["variant"] == "texts")
    factors = sorted({r["factor"] for r in rows if r["factor"]})
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, fields, label in (
        (axes[0], ("peak_mib", "kept_mib"), "MiB above the process before"),
        (axes[1], ("load_s",), "build seconds"),
    ):
        for field in fields:
            for variant in VARIANTS[1:]:
                ax.plot(factors, [r[field] for r in rows if r["variant"] == variant], "o-", label=f"{variant}: {field}")
            ax.axhline(texts[field], linestyle="--", color="gray", alpha=0.7, label=f"texts: {field}")
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_xticks(factors, [f"{f}x" for f in factors])
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.set_xlabel(f"corpus size / the {rows[0]['rows']:,} passages the rows name")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    title = (
        f"rows of document ids and their corpus (JSONL, Parquet; before: JSONL at {meta['ids_baseline']}, Parquet at "
        f"{meta['baseline']}) against texts"
    )
    fig.suptitle(f"{title}; {meta['cpu']}", fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.variant:
        measure_main(args)
        return
    meta = harness.metadata("cpu", baseline=args.baseline, ids_baseline=args.ids_baseline)
    with tempfile.TemporaryDirectory(prefix="corpus_load_") as folder:
        rows = measure(args, Path(folder))
    harness.write_results(
        args.out, NAME, meta, {"args": vars(args)}, rows=rows, fields=FIELDS, figure=lambda: draw(rows, meta)
    )


if __name__ == "__main__":
    main()
