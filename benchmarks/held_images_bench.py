"""What reading vl_pairs rows whose images are held in a Parquet file's cells costs at load (`datasets/held_images.py`):
the first load writes each image to `data.image_cache`, later loads find them there (CPU).

    python -m benchmarks.held_images_bench                                        # docs/performance.md's table
    python -m benchmarks.held_images_bench --rows 256 --repeats 1 --out /tmp/h    # smoke (seconds)

The rows are t2i pages: a query text and a page image, a JPEG of `--size` pixels of smooth random structure (what a
rendered page compresses like, not white noise), as:
- `paths`: JSON lines naming the image files (the rows as before, the baseline);
- `held_first`: a Parquet file holding each image in a Hugging Face `Image` struct, loaded with an empty cache (every
  image written);
- `held_again`: the same file loaded again with the cache filled (every image found).
Each load is `VLPairsDataset` built in this process, medians of `--repeats` interleaved runs (a fresh cache each
`held_first` run). Reported: `load_s`, and `rows_per_s` = rows / load_s. Writes held_images_bench.{json,csv,png}
under --out.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import harness

NAME = "held_images_bench"
FIELDS = ["variant", "rows", "image_kib", "load_s", "rows_per_s"]
VARIANTS = ("paths", "held_first", "held_again")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--size", type=int, nargs=2, default=[640, 480], help="page height and width")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(harness.RESULTS))
    return p.parse_args(argv)


def make(folder: Path, n: int, size: tuple[int, int]) -> float:
    """`paths.jsonl` (with the images as files under img/) and `held.parquet` of the same rows; the mean image KiB."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    draw = np.random.default_rng(0)
    (folder / "img").mkdir()
    rows, structs, total = [], [], 0
    for i in range(n):
        coarse = draw.integers(0, 256, (size[0] // 16, size[1] // 16, 3), dtype=np.uint8)
        page = Image.fromarray(coarse).resize((size[1], size[0]), Image.BICUBIC)
        buffer = io.BytesIO()
        page.save(buffer, format="JPEG", quality=90)
        data = buffer.getvalue()
        (folder / "img" / f"p{i}.jpg").write_bytes(data)
        total += len(data)
        rows.append({"query_text": f"page {i}", "doc_image": f"img/p{i}.jpg"})
        structs.append({"bytes": data, "path": f"p{i}.jpg"})
    (folder / "paths.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = pa.table({"query_text": [r["query_text"] for r in rows], "doc_image": structs})
    pq.write_table(table, folder / "held.parquet", row_group_size=100)  # as `datasets` writes image sets
    return total / n / 1024


def load(variant: str, folder: Path, cache: Path) -> float:
    """Seconds to build the dataset of `variant` (its images written to, or found in, `cache`)."""
    from titan_contrastive.datasets.vl_pairs import VLPairsDataset

    rows = folder / ("paths.jsonl" if variant == "paths" else "held.parquet")
    start = time.perf_counter()
    VLPairsDataset(split="train", path=str(rows), mode="t2i", image_cache=str(cache))
    return time.perf_counter() - start


def measure(args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    kib = make(folder, args.rows, tuple(args.size))
    filled = folder / "filled"
    load("held_first", folder, filled)  # the cache `held_again` finds, and the first import's cost out of the runs
    runs: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.repeats):
        for variant in harness.rotation(VARIANTS, r):
            fresh = folder / f"fresh-{r}"
            runs[variant].append(load(variant, folder, fresh if variant == "held_first" else filled))
            shutil.rmtree(fresh, ignore_errors=True)
    rows = []
    for variant, seconds in runs.items():
        median = statistics.median(seconds)
        row = {"variant": variant, "rows": args.rows, "image_kib": round(kib, 1), "load_s": round(median, 3)}
        rows.append(row | {"rows_per_s": round(args.rows / median)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def draw(rows: list[dict[str, Any]], meta: dict[str, Any]) -> Any:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh([r["variant"] for r in rows], [r["rows_per_s"] for r in rows])
    for i, r in enumerate(rows):
        ax.text(r["rows_per_s"], i, f" {r['rows_per_s']:,} rows/s ({r['load_s']} s)", va="center", fontsize=8)
    ax.set_xlabel(f"rows loaded per second ({rows[0]['rows']:,} pages of {rows[0]['image_kib']} KiB)")
    ax.set_xlim(right=max(r["rows_per_s"] for r in rows) * 1.5)
    fig.suptitle(f"vl_pairs rows: image paths, or images held in Parquet cells; {meta['cpu']}", fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    meta = harness.metadata("cpu")
    with tempfile.TemporaryDirectory(prefix="held_images_") as folder:
        rows = measure(args, Path(folder))
    harness.write_results(
        args.out, NAME, meta, {"args": vars(args)}, rows=rows, fields=FIELDS, figure=lambda: draw(rows, meta)
    )


if __name__ == "__main__":
    main()
