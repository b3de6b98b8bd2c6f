"""What a checkpoint save costs the training loop: a synchronous save (with the SHA-256 of every file)
against the hashing alone, and what a background save blocks for (`async_mode = "async"`, and
`"async_with_pinned_mem"`, whose host copy is allocated once and refilled).

    python -m benchmarks.checkpoint_bench [--flavor vit_b32] [--repeats 3]
    python -m benchmarks.checkpoint_bench --flavor debug --repeats 2 --out /tmp/bench   # quick

Builds the clip model of `--flavor` with AdamW state (one zero-lr step), saves it through the real
`CheckpointManager` (DCP files + manifest with checksums) `--repeats` times, and times the whole
save and, separately, hashing the saved files (what `_finalize` adds, and what validation costs on
load), and a background save in each mode: the time until `save` returns (the host copy of the
state: what the loop waits for) and until the save is complete, interleaved by the harness. Medians
(and the peak RSS of each); writes checkpoint_bench.json under --out. CPU, one process.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from titan_contrastive.checkpoint import CheckpointManager, ModelState, OptimizerState, TrainState
from titan_contrastive.checkpoint.reader import sha256 as _sha256
from titan_contrastive.config.job_config import Checkpoint
from titan_contrastive.models import get_flavor_args, get_model_spec


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="vit_b32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=0, help="untimed save + hash rounds first")
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    model = get_model_spec("clip").build_model(get_flavor_args("clip", args.flavor))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    with tempfile.TemporaryDirectory() as tmp:
        states = {
            "model": ModelState(model),
            "optimizer": OptimizerState(model, optimizer),
            "train_state": TrainState(),
        }
        managers = {
            mode: CheckpointManager(
                Checkpoint(enable=True, folder="ckpt", interval=1, keep_latest_k=2, async_mode=mode),
                dump_folder=tmp,
                states=states,
                per_rank_states={},
                rank=0,
                dp_rank=0,
                dp_degree=1,
            )
            for mode in ("async", "async_with_pinned_mem")
        }
        manager = managers["async"]
        saved = [0]

        def background_save(mode: str) -> Callable[[], float]:
            def timed() -> float:
                """The whole save is timed; returns the part `save` blocked for."""
                saved.append(saved[-1] + 1)
                start = time.perf_counter()
                managers[mode].save(saved[-1], background=True)
                blocked = time.perf_counter() - start
                managers[mode].wait()
                return blocked

            return timed

        def save() -> None:
            saved.append(saved[-1] + 1)
            manager.save(saved[-1])

        def hash_files() -> int:
            files = [
                p for p in (Path(tmp) / "ckpt" / f"step-{max(manager.available_steps())}").rglob("*") if p.is_file()
            ]
            for p in files:
                _sha256(p)
            return sum(p.stat().st_size for p in files)

        runs = harness.round_robin(
            {
                "save": save,
                "hash": hash_files,
                "background": background_save("async"),
                "pinned": background_save("async_with_pinned_mem"),
            },
            args.repeats,
            warmup=args.warmup,
            keep_values=True,
        )
    sizes = runs["hash"].values[-1]
    save_s, hash_s = runs["save"].median_s, runs["hash"].median_s
    blocked_s = statistics.median(runs["background"].values)
    pinned_s = statistics.median(runs["pinned"].values)
    result = {
        "flavor": args.flavor,
        "threads": torch.get_num_threads(),
        "checkpoint_bytes": sizes,
        "save_s_median": save_s,
        "hash_s_median": hash_s,
        "hash_share_of_save": hash_s / save_s,
        "hash_mb_per_s": sizes / hash_s / 1e6,
        "saves_s": runs["save"].times_s,
        "hashes_s": runs["hash"].times_s,
        "background_blocked_s_median": blocked_s,
        "background_total_s_median": runs["background"].median_s,
        "background_blocked_s": runs["background"].values,
        "save": runs["save"].row(),
        "hash": runs["hash"].row(),
        "background": runs["background"].row(),
        "pinned_blocked_s_median": pinned_s,
        "pinned_total_s_median": runs["pinned"].median_s,
        "pinned_blocked_s": runs["pinned"].values,
        "pinned": runs["pinned"].row(),
    }
    meta = harness.metadata("cpu", repeats=args.repeats, warmup=args.warmup)
    rows = [
        {"what": "synchronous save (the loop waits)", "median_s": save_s},
        {"what": "of which: hashing the files", "median_s": hash_s},
        {"what": "background save: the loop waits", "median_s": blocked_s},
        {"what": "background save: complete", "median_s": runs["background"].median_s},
        {"what": "pinned_mem save: the loop waits", "median_s": pinned_s},
        {"what": "pinned_mem save: complete", "median_s": runs["pinned"].median_s},
    ]

    def figure() -> Any:
        fig, ax = harness.pyplot().subplots(figsize=(7, 3))
        ax.barh([r["what"] for r in rows][::-1], [r["median_s"] for r in rows][::-1], color="tab:blue")
        for y, r in enumerate(rows[::-1]):
            ax.annotate(f" {r['median_s']:.2f} s", (r["median_s"], y), va="center", fontsize=8)
        ax.set_xlim(0, 1.15 * max(r["median_s"] for r in rows))  # room for the labels
        ax.set_xlabel(f"seconds (median of {args.repeats})")
        ax.set_title(f"checkpoint of clip/{args.flavor} + AdamW, {sizes / 2**30:.2f} GiB, CPU")
        return fig

    harness.write_results(args.out, "checkpoint_bench", meta, result, rows=rows, figure=figure)
    print(
        f"{args.flavor}: checkpoint {sizes / 2**30:.2f} GiB, save {save_s:.2f} s of which hashing {hash_s:.2f} s "
        f"({hash_s / save_s:.0%}, {sizes / hash_s / 1e6:.0f} MB/s); the same hashing runs once when a checkpoint "
        "is validated on load"
    )
    print(
        f"background save: blocks the loop {blocked_s:.2f} s ({blocked_s / save_s:.0%} of a synchronous save), "
        f"complete after {runs['background'].median_s:.2f} s"
    )
    print(
        f"async_with_pinned_mem: blocks the loop {pinned_s:.2f} s ({pinned_s / blocked_s:.2f}x the async mode's), "
        f"complete after {runs['pinned'].median_s:.2f} s"
    )


if __name__ == "__main__":
    main()
