"""Embedding ahead on several processes, on CPU: `embed_images` alone and under torchrun, `embed` on one device and on
sentence-transformers' pool of two.

    python -m benchmarks.embed_ranks_bench          # about 8 minutes on 2 cores

The image teacher is the default config's debug CLIP (`train_configs/debug.toml`) after one step; it embeds the
bundled Fashion-MNIST training split (20,000 images, 50 captions): in one process (torch's threads on every core),
under `torchrun --standalone --nproc_per_node=2` (the cores split between the ranks), and in one process with
`--views 2` (each image's two flips as well: three passes over the images). The text model is the
bundled all-MiniLM-L6-v2, on the first `TEXT_ROWS` WordNet pairs: with `--device cpu`, and with `--device cpu,cpu`
(sentence-transformers' pool of two processes). Each command runs `ROUNDS` times, the variants in rotation; a row is one
launch's wall seconds, the interpreters' start included. Each variant's file is checked against the one-process file
of its kind (the same rows, the vectors equal to float32's precision) before its time counts. Writes
embed_ranks_bench.{json,csv,png} under --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from benchmarks import harness

CONFIG = "train_configs/debug.toml"
ROUNDS, TEXT_ROWS = 3, 4000
FIELDS = ["variant", "round", "wall_s", "peak_rss_mib"]


def commands(teacher: Path, pairs: Path) -> dict[str, tuple[list[str], str]]:
    """variant: (its command without --out, the variant whose file it must equal)."""
    images = ["-m", "titan_contrastive.embed_images", f"--job.config_file={CONFIG}", f"--loss.teacher_model={teacher}"]
    texts = ["-m", "titan_contrastive.embed", str(pairs), "--model="]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    return {
        "images, 1 process": ([sys.executable, *images], "images, 1 process"),
        "images, torchrun 2 processes": ([*torchrun, *images], "images, 1 process"),
        "images, 1 process, --views 2": ([sys.executable, *images, "--views=2"], "images, 1 process, --views 2"),
        "texts, --device cpu": ([sys.executable, *texts, "--device=cpu"], "texts, --device cpu"),
        "texts, --device cpu,cpu": ([sys.executable, *texts, "--device=cpu,cpu"], "texts, --device cpu"),
    }


def same_rows(got: Path, want: Path) -> None:
    a, b = pq.read_table(got), pq.read_table(want)
    if a.column("text").to_pylist() != b.column("text").to_pylist():
        raise SystemExit(f"{got}: not the rows of {want}")
    va, vb = (np.stack(t.column("embedding").to_numpy(zero_copy_only=False)) for t in (a, b))
    if not np.allclose(va, vb, rtol=1e-5, atol=1e-6):
        raise SystemExit(f"{got}: vectors differ from {want}'s by {np.abs(va - vb).max():.3g}")


def plot(rows: list[dict[str, Any]]):  # noqa: ANN201 - a matplotlib figure
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for y, name in enumerate(names):
        walls = [r["wall_s"] for r in rows if r["variant"] == name]
        ax.scatter(walls, [y] * len(walls), color="C0")
        ax.scatter([statistics.median(walls)], [y], color="C3", marker="|", s=400)
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("wall seconds of the launch (red: median)")
    ax.set_xlim(left=0)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=harness.RESULTS, help="where embed_ranks_bench.{json,csv,png} go")
    args = p.parse_args(argv)
    from titan_contrastive.datasets.wordnet import BUNDLE_DIR, load_rows

    prefix = harness.REPO / "outputs" / "embed_ranks_bench"
    shutil.rmtree(prefix, ignore_errors=True)
    dump = prefix / "teacher"
    cmd = ["./run_train.sh", f"--job.dump_folder={dump}", "--metrics.enable_tensorboard=false", "--eval.enable=false"]
    cmd += ["--training.steps=1", "--checkpoint.enable=true", "--checkpoint.interval=1"]
    result = harness.run_child(cmd, cwd=harness.REPO, env=harness.train_env(config_file=CONFIG))
    if result.returncode != 0:
        raise SystemExit(f"the teacher's run failed:\n{result.stderr[-2000:]}")
    pairs = prefix / "pairs.jsonl"
    rows_of = load_rows(BUNDLE_DIR, "train")[:TEXT_ROWS]
    pairs.write_text("".join(json.dumps({"query": q, "positive": d}) + "\n" for q, d, *_ in rows_of))
    variants = commands(dump / "checkpoint" / "step-1", pairs)
    rows: list[dict[str, Any]] = []
    for r in range(ROUNDS):
        for name in harness.rotation(list(variants), r):
            command, reference = variants[name]
            out = prefix / f"{list(variants).index(name)}_{r}.parquet"
            result = harness.run_child([*command, f"--out={out}"], cwd=harness.REPO)
            if result.returncode != 0:
                raise SystemExit(f"{name} failed:\n{result.stderr[-2000:]}")
            rows.append({"variant": name, "round": r, "wall_s": result.wall_s, "peak_rss_mib": result.peak_rss_mib})
            print(name, r, round(result.wall_s, 2), flush=True)
        for i, (_, reference) in enumerate(variants.values()):
            same_rows(prefix / f"{i}_{r}.parquet", prefix / f"{list(variants).index(reference)}_{r}.parquet")
    medians = {name: statistics.median(row["wall_s"] for row in rows if row["variant"] == name) for name in variants}
    payload = {"rounds": ROUNDS, "text_rows": TEXT_ROWS, "median_wall_s": medians}
    harness.write_results(
        args.out, "embed_ranks_bench", harness.metadata(), payload, rows=rows, fields=FIELDS, figure=lambda: plot(rows)
    )
    print(json.dumps(medians, indent=1))
    print(f"wrote {args.out}/embed_ranks_bench.json, .csv and .png")


if __name__ == "__main__":
    main()
