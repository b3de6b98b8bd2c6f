"""What a checkpoint save costs the training loop: a synchronous save (with the SHA-256 of every file)
against the hashing alone, and what a background save blocks for (`async_mode = "async"`, and
`"async_with_pinned_mem"`, whose host copy is allocated once, refilled, and filled beside the next step).

    python -m benchmarks.checkpoint_bench [--flavor vit_b32] [--repeats 3]
    python -m benchmarks.checkpoint_bench --flavor debug --repeats 2 --out /tmp/bench   # quick
    python -m benchmarks.checkpoint_bench --device cuda --batch 256 --repeats 5   # on a GPU

Builds the clip model of `--flavor` with AdamW state (one zero-lr step), saves it through the real
`CheckpointManager` (DCP files + manifest with checksums) `--repeats` times, and times the whole
save and, separately, hashing the saved files (what `_finalize` adds, and what validation costs on
load), and a background save in each mode: the time until `save` returns, then one training step
(forward and backward of `--batch` pairs, the manager's `wait_for_staging`, the optimizer step) after it
against the same step without a save: what the save costs the loop is the difference (the pinned mode's
copy runs beside the step's forward and backward), and the time until the save is complete;
interleaved by the harness. Medians (and the peak RSS of each); writes checkpoint_bench.json under
--out (checkpoint_bench_cuda.json with `--device cuda`: the model and its step on the GPU, the pinned
mode's copy a device-to-host transfer). One process.
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
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from benchmarks import harness
from titan_contrastive.checkpoint import CheckpointManager, ModelState, OptimizerState, TrainState
from titan_contrastive.checkpoint.reader import sha256 as _sha256
from titan_contrastive.checkpoint.writer import stager_survives_reuse
from titan_contrastive.config.job_config import Checkpoint
from titan_contrastive.models import get_flavor_args, get_model_spec


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="vit_b32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=0, help="untimed save + hash rounds first")
    parser.add_argument("--batch", type=int, default=4, help="pairs in the training step after a save")
    parser.add_argument("--device", default="cpu", help="cpu or cuda: where the model, optimizer and step live")
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    model_args = get_flavor_args("clip", args.flavor)
    model = get_model_spec("clip").build_model(model_args).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    size, length = model_args.image_size, model_args.context_length
    images = torch.randn(args.batch, model_args.in_channels, size, size, device=device)
    texts = torch.randint(0, model_args.vocab_size, (args.batch, length), device=device)
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
            for mode in ("async", "async_with_pinned_mem", "pinned_copy_first")
        }
        reusable = stager_survives_reuse()

        def copy_first_stager() -> None:
            """The pinned mode as it was before its copy went beside the step (0ade5e9): copied, then
            returned; one stager kept, or a fresh one each save where torch's cannot copy twice (2.11)."""
            manager = managers["pinned_copy_first"]
            if manager._stager is None or not reusable:
                if manager._stager is not None:
                    manager._stager.close()
                manager._stager = DefaultStager(StagingOptions(cuda, False, False, False))

        manager = managers["async"]
        saved = [0]

        def train_step(wait_for_staging: Callable[[], None] = lambda: None) -> float:
            start = time.perf_counter()
            image_features, text_features, scale = model(images, texts)[:3]
            (scale * image_features @ text_features.T).logsumexp(1).sum().backward()
            wait_for_staging()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - start

        def background_save(mode: str) -> Callable[[], tuple[float, float]]:
            def timed() -> tuple[float, float]:
                """The whole save is timed; returns the time `save` blocked for and then that of save + step."""
                saved.append(saved[-1] + 1)
                if mode == "pinned_copy_first":
                    copy_first_stager()
                start = time.perf_counter()
                managers[mode].save(saved[-1], background=True)
                blocked = time.perf_counter() - start
                train_step(managers[mode].wait_for_staging)
                loop = time.perf_counter() - start
                managers[mode].wait()
                return blocked, loop

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
                "step": train_step,
                "background": background_save("async"),
                "pinned": background_save("async_with_pinned_mem"),
                "copy_first": background_save("pinned_copy_first"),
            },
            args.repeats,
            warmup=args.warmup,
            keep_values=True,
        )
    sizes = runs["hash"].values[-1]
    save_s, hash_s = runs["save"].median_s, runs["hash"].median_s
    step_s = statistics.median(runs["step"].values)
    variants = {"background": "async", "pinned": "pinned_mem", "copy_first": "pinned, copy before return"}
    blocked, loop = {}, {}  # each variant's medians: until `save` returns, and save + the step after it
    for name in variants:
        blocked[name], loop[name] = (statistics.median(v) for v in zip(*runs[name].values, strict=True))
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
        "batch": args.batch,
        "step_s_median": step_s,
        "steps_s": runs["step"].values,
        "save": runs["save"].row(),
        "hash": runs["hash"].row(),
    }
    rows = [
        {"what": "synchronous save (the loop waits)", "median_s": save_s},
        {"what": "of which: hashing the files", "median_s": hash_s},
        {"what": f"a training step ({args.batch} pairs), no save", "median_s": step_s},
    ]
    for name, label in variants.items():
        result |= {
            f"{name}_blocked_s_median": blocked[name],
            f"{name}_save_and_step_s_median": loop[name],
            f"{name}_cost_to_loop_s": loop[name] - step_s,
            f"{name}_total_s_median": runs[name].median_s,
            f"{name}_blocked_and_loop_s": runs[name].values,
            name: runs[name].row(),
        }
        rows += [
            {"what": f"{label} save: returns after", "median_s": blocked[name]},
            {"what": f"{label} save + the step: added", "median_s": loop[name] - step_s},
            {"what": f"{label} save: complete", "median_s": runs[name].median_s},
        ]
    meta = harness.metadata(args.device, repeats=args.repeats, warmup=args.warmup)

    def figure() -> Any:
        fig, ax = harness.pyplot().subplots(figsize=(7, 1 + 0.28 * len(rows)))
        ax.barh([r["what"] for r in rows][::-1], [r["median_s"] for r in rows][::-1], color="tab:blue")
        for y, r in enumerate(rows[::-1]):
            ax.annotate(f" {r['median_s']:.2f} s", (r["median_s"], y), va="center", fontsize=8)
        ax.set_xlim(0, 1.15 * max(r["median_s"] for r in rows))  # room for the labels
        ax.set_xlabel(f"seconds (median of {args.repeats})")
        ax.set_title(f"checkpoint of clip/{args.flavor} + AdamW, {sizes / 2**30:.2f} GiB, {args.device}")
        return fig

    harness.write_results(
        args.out, "checkpoint_bench_cuda" if cuda else "checkpoint_bench", meta, result, rows=rows, figure=figure
    )
    print(
        f"{args.flavor}: checkpoint {sizes / 2**30:.2f} GiB, save {save_s:.2f} s of which hashing {hash_s:.2f} s "
        f"({hash_s / save_s:.0%}, {sizes / hash_s / 1e6:.0f} MB/s); the same hashing runs once when a checkpoint "
        "is validated on load"
    )
    for name, label in variants.items():
        print(
            f"{label} save: returns after {blocked[name]:.2f} s; save + a {step_s:.2f} s step take {loop[name]:.2f} s "
            f"(the save adds {loop[name] - step_s:.2f} s, {(loop[name] - step_s) / save_s:.0%} of a synchronous "
            f"save), complete after {runs[name].median_s:.2f} s"
        )


if __name__ == "__main__":
    main()
