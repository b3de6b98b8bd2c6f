"""How long each rank of a run takes to build its text pairs when the ranks share the tokenization (each tokenizes
every world-th chunk of the distinct texts and sends the others its ids) against each rank tokenizing every text
alone, under torchrun on CPU.

    python -m benchmarks.shared_tokens_bench                                      # docs/performance.md's table
    python -m benchmarks.shared_tokens_bench --rows 4096 --worlds 2 --repeats 1 --out /tmp/s   # smoke

The files are `benchmarks/pairs_load_bench.py`'s (`flag`: FlagEmbedding rows over a corpus of as many passages as
rows, 7 negatives drawn per row and epoch; `triplets`: no text repeated), trained as bge_finetune.toml's lengths have
them (queries 64 tokens, documents 256). Each measurement is one `torchrun --standalone --nproc_per_node=W` launch of
this file: every rank joins the gloo group (the trainer's `init_distributed`: the cores split between the local
ranks), builds the run's data as the trainer does (`build_data`) with the ranks' `host_group` (`shared`) or none
(`alone`), and checks that its tables hold the ids a build alone gives (the shared launch builds them alone again
after it is timed). `load_s` is the slowest rank's build; `tokenized` is what share of the distinct texts the most
loaded rank tokenized. Medians of `--repeats` interleaved launches. Writes shared_tokens_bench.{json,csv,png} under
--out.
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
from benchmarks.pairs_load_bench import flags, make

NAME = "shared_tokens_bench"
FIELDS = ["kind", "rows", "world", "variant", "load_s", "tokenized", "distinct"]
VARIANTS = ("shared", "alone")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1 << 15)
    p.add_argument("--kinds", nargs="+", choices=("flag", "triplets"), default=["triplets", "flag"])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(harness.RESULTS))
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # a measurement, on each rank
    p.add_argument("--folder", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def measure_main(args: argparse.Namespace) -> None:
    """One rank of a launch: builds the data, and rank 0 writes FOLDER/measured.json."""
    import torch
    import torch.distributed as dist

    from titan_contrastive import models
    from titan_contrastive.config.manager import parse_args
    from titan_contrastive.datasets import build_dataset
    from titan_contrastive.datasets.build import build_data
    from titan_contrastive.datasets.tokenizer import PairTokenizer
    from titan_contrastive.parallelisms import host_group, init_distributed

    folder, kind = Path(args.folder), args.kinds[0]
    info = init_distributed("cpu")
    cfg = parse_args(flags(kind, folder / "rows.jsonl"))
    spec = models.get_model_spec(cfg.model.name)
    model_args, _ = models.resolve_model_args(cfg.model.name, cfg.model.flavor, cfg.model.init_from)
    model_args = models.configured(model_args, cfg, spec)
    spec.build_tokenizer(model_args).encode(["the tokenizer's first call"], 8)  # its load is no part of the rows'
    own, tokenized = PairTokenizer.token_rows, []

    def counted(self: PairTokenizer, texts: list[str], length: int) -> list[list[int]]:
        tokenized.append(len(texts))
        return own(self, texts, length)

    def built(group: Any) -> Any:
        return build_data(
            cfg,
            family_tokenizer=lambda: spec.build_tokenizer(model_args),
            prepare=lambda ds: spec.layout.prepare(ds, model_args, cfg.data.image_sizes, cfg.model.name),
            build_bundled=build_dataset,
            dp_rank=info.rank,
            dp_degree=info.world_size,
            pin_memory=False,
            host_group=group,
        ).train_set

    group = host_group if args.variant == "shared" else None
    dist.barrier()
    PairTokenizer.token_rows = counted
    start = time.perf_counter()
    train = built(group)
    load = torch.tensor([time.perf_counter() - start, sum(tokenized)], dtype=torch.float64)
    PairTokenizer.token_rows = own
    dist.all_reduce(load, op=dist.ReduceOp.MAX)
    if args.variant == "shared":  # the ids every rank holds are those it would tokenize alone
        alone = built(None)
        for table in ("_queries", "_documents"):
            a, b = getattr(train, table), getattr(alone, table)
            assert all(
                torch.equal(x, y) for x, y in zip((a._ids, a._lengths, a._places), (b._ids, b._lengths, b._places))
            )
    distinct = train._queries.distinct + train._documents.distinct
    if info.rank == 0:
        made = {"load_s": load[0].item(), "tokenized": load[1].item() / distinct, "distinct": distinct}
        (folder / "measured.json").write_text(json.dumps(made))
    dist.barrier()
    dist.destroy_process_group()


def run_once(variant: str, kind: str, world: int, folder: Path) -> dict:
    """One launch of `world` ranks."""
    env = {**os.environ, "PYTHONPATH": str(harness.REPO), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    command = [*torchrun, __file__, f"--variant={variant}", f"--folder={folder}", f"--kinds={kind}"]
    if subprocess.run(command, env=env).returncode:
        raise SystemExit(f"{variant}, {kind}, {world} ranks: the launch failed (its error is above)")
    made = json.loads((folder / "measured.json").read_text())
    (folder / "measured.json").unlink()
    return made


def measure(args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    rows = []
    for kind in args.kinds:
        data = folder / kind
        data.mkdir()
        make(data / "rows.jsonl", kind, args.rows)
        for world in args.worlds:
            runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
            for r in range(args.repeats):
                for variant in harness.rotation(VARIANTS, r):
                    runs[variant].append(run_once(variant, kind, world, data))
            for variant, made in runs.items():
                row = {"kind": kind, "rows": args.rows, "world": world, "variant": variant}
                row |= {f: round(statistics.median(m[f] for m in made), 3) for f in ("load_s", "tokenized")}
                row["distinct"] = made[0]["distinct"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def draw(rows: list[dict[str, Any]], meta: dict[str, Any]) -> Any:
    """Per kind, each variant's build seconds against the ranks."""
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.5 * len(kinds), 3.4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for variant, style in zip(VARIANTS, ("o-", "x--")):
            mine = [r for r in rows if r["kind"] == kind and r["variant"] == variant]
            ax.plot([r["world"] for r in mine], [r["load_s"] for r in mine], style, label=variant)
        worlds = sorted({r["world"] for r in rows})
        ax.set_xticks(worlds)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("ranks (torchrun, one machine)")
        ax.set_ylabel("slowest rank's build, seconds")
        ax.set_title(f"{kind}, {rows[0]['rows']:,} rows", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"text pairs built by ranks sharing the tokenization or each alone; {meta['cpu']}", fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.variant:
        measure_main(args)
        return
    meta = harness.metadata("cpu")
    with tempfile.TemporaryDirectory(prefix="shared_tokens_") as folder:
        rows = measure(args, Path(folder))
    harness.write_results(
        args.out, NAME, meta, {"args": vars(args)}, rows=rows, fields=FIELDS, figure=lambda: draw(rows, meta)
    )


if __name__ == "__main__":
    main()
