"""What the forked DataLoader workers of one rank copy of a training set's rows over an epoch: a CSV of image paths
and captions (`data.dataset = "csv"`) and vl_pairs rows (qwen_vl), rows packed (`datasets/packed_rows.py`, this tree)
against rows held as Python objects (`--baseline`) (CPU).

    python -m benchmarks.worker_memory_bench                                              # docs/performance.md's table
    python -m benchmarks.worker_memory_bench --rows 2000 --repeats 1 --out /tmp/w         # smoke (a minute)
    python -m benchmarks.worker_memory_bench --rows 131072 --variants this before --baseline REV  # a change vs REV

Per kind and size, the file holds `--rows` rows: the CSV an image path (`img/N.png`, `--images` small PNGs cycled)
and a caption of about 60 characters; the vl_pairs JSONL (retrieval mode t2t) a query of about 60 characters, a
document of about 150 and two hard negatives like it. Each measurement is a fresh process (this file run as a script,
the variant's titan_contrastive first on PYTHONPATH) that builds the run's data as the trainer does (`build_data`
from `train_configs/own_data_clip.toml` or `qwen_vl_embedder_lora.toml` over a tiny random Qwen2-VL folder, with
`--workers` data workers) and draws one epoch of local batches of `--batch` from its loader. Per variant, medians of
`--repeats` interleaved runs of:
- `load_s`, `build_mib`: the seconds and the anonymous memory (RssAnon of /proc/self/status) of building the data
  (the rows, and the tokenizer or the processor);
- `copied_mib`: the parent's memory each worker ended the epoch holding a copy of, the mean over the workers: pages of
  the parent's heap and anonymous mappings present in both processes at different physical frames (/proc/PID/pagemap,
  sampled every 0.2 s by a thread; frame numbers need CAP_SYS_ADMIN, else None). Pages the parent itself wrote during
  the epoch count too (a few MiB, the same in every variant);
- `worker_mib`: each worker's largest private dirty memory (Private_Dirty of /proc/PID/smaps_rollup), the mean over
  the workers: the copies and the worker's own heap (decoded images, batches before they move to shared memory),
  which varies from run to run by a hundred MiB or more;
- `epoch_s`: the epoch's seconds.
`this` is this tree; `unfrozen` this tree with `gc.freeze` made a no-op (the packed rows alone); `before` the
baseline's package (default cd47137, the last commit before the packed rows), extracted by `harness.package_at`.
Writes worker_memory_bench.{json,csv,png} under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import harness

NAME = "worker_memory_bench"
FIELDS = ["kind", "variant", "rows", "load_s", "build_mib", "copied_mib", "worker_mib", "epoch_s", "batches"]
KINDS = ("csv", "vl_pairs")
VARIANTS = ("this", "unfrozen", "before")
WORDS = "a photo of the red house by the river near an old stone bridge in early morning light with fog".split()


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1 << 17, 1 << 19])
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline", default="cd47137", help="the commit before the packed rows")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="those to measure")
    p.add_argument("--out", default=str(harness.RESULTS))
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # a measurement (run_once)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def text(i: int, words: int) -> str:
    """A text of `words` words that differs per `i`."""
    return " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(words)) + f" {i}"


def make(folder: Path, kind: str, n: int, images: int) -> Path:
    """The training file of `n` rows (the CSV's images beside it), and for vl_pairs the model folder."""
    if kind == "csv":
        from PIL import Image

        (folder / "img").mkdir()
        for i in range(images):
            Image.new("RGB", (8, 8), (i * 4 % 256, 90, 200)).save(folder / "img" / f"{i}.png")
        lines = ["filepath\ttitle"] + [f"img/{i % images}.png\t{text(i, 11)}" for i in range(n)]
        (folder / "rows.csv").write_text("\n".join(lines) + "\n")
        return folder / "rows.csv"
    from titan_contrastive.models.qwen_vl.random_folder import write_random_folder

    write_random_folder(folder / "model", words=WORDS)
    rows = (
        {"query_text": text(i, 11), "doc_text": text(i + 1, 28), "doc_negatives": [text(i + 2, 28), text(i + 3, 28)]}
        for i in range(n)
    )
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder / "rows.jsonl"


def flags(kind: str, folder: Path, args: argparse.Namespace) -> list[str]:
    common = [f"--data.num_workers={args.workers}", f"--training.local_batch_size={args.batch}", "--data.val_path="]
    if kind == "csv":
        config, own = "own_data_clip.toml", ["--data.dataset=csv", "--eval.zero_shot_path="]
    else:
        config, own = (
            "qwen_vl_embedder_lora.toml",
            [f"--model.path={folder / 'model'}", "--data.retrieval_mode=t2t", "--model.doc_prompt={text}"],
        )
    config_file = harness.REPO / "train_configs" / config
    return [f"--job.config_file={config_file}", f"--data.path={folder / f'rows.{kind_suffix(kind)}'}", *own, *common]


def kind_suffix(kind: str) -> str:
    return "csv" if kind == "csv" else "jsonl"


def private_dirty_kib(pid: int) -> int:
    """Private_Dirty of process `pid` (0 once it has gone)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


PAGE = os.sysconf("SC_PAGE_SIZE")
PFN = (1 << 55) - 1
PRESENT = 1 << 63


def anonymous_ranges(pid: int) -> list[tuple[int, int]]:
    """The writable private memory of process `pid` that no file backs (its heap and anonymous mappings)."""
    ranges = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split()
        if fields[1].startswith("rw") and fields[1][3] == "p" and (len(fields) < 6 or fields[5] == "[heap]"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def frames(pid: int, ranges: list[tuple[int, int]]) -> Any:
    """Each page's physical frame number in `ranges` of process `pid` (/proc/PID/pagemap), -1 where none is."""
    import numpy as np

    parts = []
    with open(f"/proc/{pid}/pagemap", "rb") as f:
        for start, end in ranges:
            raw = np.frombuffer(os.pread(f.fileno(), 8 * ((end - start) // PAGE), 8 * (start // PAGE)), np.uint64)
            parts.append(np.where(raw & np.uint64(PRESENT), raw & np.uint64(PFN), np.uint64(PFN + 1)).astype(np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def copied_pages(parent: int, worker: int) -> int | None:
    """How many pages of the parent's anonymous memory `worker` holds a page of its own for (both present, another
    frame: a copy); None where frame numbers read as 0 (they need CAP_SYS_ADMIN) or the worker has gone."""
    try:
        ranges = anonymous_ranges(parent)
        mine, theirs = frames(parent, ranges), frames(worker, ranges)
    except OSError:
        return None
    both = (mine <= PFN) & (theirs <= PFN)
    if both.any() and not mine[both].any():
        return None
    return int((both & (mine != theirs)).sum())


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


class WorkerPeaks:
    """Each child process's largest Private_Dirty and count of the parent's pages it copied, sampled every 0.2 s by a
    thread."""

    def __init__(self) -> None:
        self.private: dict[int, int] = {}
        self.copied: dict[int, int] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self) -> None:
        me = os.getpid()
        while not self.done.wait(0.2):
            for pid in children(me):
                self.private[pid] = max(self.private.get(pid, 0), private_dirty_kib(pid))
                copied = copied_pages(me, pid)
                if copied is not None:
                    self.copied[pid] = max(self.copied.get(pid, 0), copied)

    def stop(self) -> tuple[list[int], list[int]]:
        """(each worker's largest Private_Dirty in KiB, each one's copied pages)."""
        self.done.set()
        self.thread.join()
        return [kib for kib in self.private.values() if kib], list(self.copied.values())


def measure_main(args: argparse.Namespace) -> None:
    """One measurement (`--variant`, one kind and size): writes FOLDER/measured.json."""
    import gc

    import torch

    import titan_contrastive
    from titan_contrastive import models
    from titan_contrastive.config.manager import parse_args
    from titan_contrastive.datasets import build_dataset
    from titan_contrastive.datasets.build import build_data

    folder, kind = Path(args.folder), args.kinds[0]
    where = Path(titan_contrastive.__file__).resolve()
    assert (args.variant == "before") == (where.parents[1] != harness.REPO), where  # this tree's, or the baseline's
    torch.set_num_threads(1)
    if args.variant == "unfrozen":  # this tree's packed rows, its workers forked without gc.freeze
        gc.freeze = gc.unfreeze = lambda: None
    cfg = parse_args(flags(kind, folder, args))
    spec = models.get_model_spec(cfg.model.name)
    model_args, _ = models.resolve_model_args(cfg.model.name, cfg.model.flavor, cfg.model.init_from)
    model_args = models.configured(model_args, cfg, spec)
    base, start = harness.status_kib("RssAnon"), time.perf_counter()
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
    built = harness.status_kib("RssAnon") - base
    assert len(data.train_set) == args.rows[0], (len(data.train_set), args.rows)
    batches = data.loader.steps_per_epoch
    peaks, start = WorkerPeaks(), time.perf_counter()
    loader = iter(data.loader)
    for _ in range(batches):
        next(loader)
    epoch = time.perf_counter() - start
    private, copied = peaks.stop()
    assert len(private) >= args.workers, private  # every worker sampled
    measured = {"load_s": load, "build_mib": built / 1024, "worker_mib": statistics.mean(private) / 1024}
    measured["copied_mib"] = statistics.mean(copied) * PAGE / 2**20 if copied else None
    (folder / "measured.json").write_text(json.dumps({**measured, "epoch_s": epoch, "batches": batches}))


def run_once(variant: str, kind: str, n: int, args: argparse.Namespace, package: Path, folder: Path) -> dict:
    """One measurement in a fresh process."""
    trees = [str(package), str(harness.REPO)] if variant == "before" else [str(harness.REPO)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(trees), "CUDA_VISIBLE_DEVICES": ""}
    own = [f"--rows={n}", f"--kinds={kind}", f"--workers={args.workers}", f"--batch={args.batch}"]
    command = [sys.executable, __file__, f"--variant={variant}", f"--folder={folder}", *own]
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
            make(data, kind, n, args.images)
            runs: dict[str, list[dict]] = {v: [] for v in args.variants}
            for r in range(args.repeats):
                for variant in harness.rotation(args.variants, r):
                    runs[variant].append(run_once(variant, kind, n, args, package, data))
            for variant, made in runs.items():
                row = {"kind": kind, "variant": variant, "rows": n, "batches": made[0]["batches"]}
                for field in ("load_s", "build_mib", "copied_mib", "worker_mib", "epoch_s"):
                    values = [m[field] for m in made if m[field] is not None]
                    row[field] = round(statistics.median(values), 3) if values else None
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def draw(rows: list[dict[str, Any]], meta: dict[str, Any]) -> Any:
    """The figure of `rows` (per kind, each variant's copies per worker and its data built, against the rows)."""
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 3.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for variant, style in zip(VARIANTS, ("o-", "s:", "x--")):
            mine = [r for r in rows if r["kind"] == kind and r["variant"] == variant]
            if not mine:
                continue
            sizes = [r["rows"] for r in mine]
            ax.plot(sizes, [r["copied_mib"] for r in mine], style, label=f"{variant}: copied by each worker")
            ax.plot(sizes, [r["build_mib"] for r in mine], style, alpha=0.4, label=f"{variant}: the data built")
            private = [r["worker_mib"] for r in mine]
            ax.plot(sizes, private, style, linewidth=3, alpha=0.6, label=f"{variant}: each worker's private memory")
        sizes = sorted({r["rows"] for r in rows if r["kind"] == kind})
        ax.set_xscale("log")
        ax.set_xticks(sizes, [f"{n:,}" for n in sizes])
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.set_xlabel("rows of the file")
        ax.set_ylabel("MiB")
        ax.set_title(f"{kind}: {meta['workers']} workers, one epoch", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"what forked data workers copy of their rank, and hold in all; {meta['cpu']}", fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.variant:
        measure_main(args)
        return
    meta = harness.metadata("cpu", baseline=args.baseline, workers=args.workers, batch=args.batch)
    with tempfile.TemporaryDirectory(prefix="worker_memory_") as folder:
        rows = measure(args, Path(folder))
    payload = {"args": vars(args)}
    harness.write_results(args.out, NAME, meta, payload, rows=rows, fields=FIELDS, figure=lambda: draw(rows, meta))


if __name__ == "__main__":
    main()
