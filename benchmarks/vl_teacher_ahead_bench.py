"""A Qwen-VL teacher written ahead against one running in the steps, on vl_pairs rows (CPU).

    python -m benchmarks.vl_teacher_ahead_bench                                 # the table of docs/performance.md
    python -m benchmarks.vl_teacher_ahead_bench --rows 16 --batch 4 --steps 2 --out /tmp/v      # smoke (seconds)

A random-init Qwen2-VL student (`models.qwen_vl.random_folder` size `small`: 4 vision blocks and 4 decoder layers, 128
wide) taught by a random-init Qwen2-VL teacher (`--teacher-size`, default `base`: 6 and 6, 384 wide) of the same
tokenizer and image processor, on `--rows` m2i vl_pairs rows written here: a random image of 56 to 112 px and a text
as the query, an image document, and `--negatives` hard negatives per row that are other rows' documents (as mined
negatives are documents of the corpus). KL distillation beside the contrastive loss (`loss.distill = "kl"`,
`distill_weight = 1`), float32, local batch `--batch`, through the project's own `Trainer.train_step` in this process.

Variants, interleaved (`harness.round_robin`: one warm-up round, then `--steps` timed rounds, each call the next batch
of the epoch, made before it is timed):
- `alone`: the student's contrastive loss, no teacher (the floor);
- `running`: `loss.teacher_model`: the teacher embeds every query and document of the batch in every step;
- `ahead`: `loss.teacher_embeddings`: the file `python -m titan_contrastive.embed_images` wrote once, its vectors
  carried by the batches.
Per variant: the median step, its median ratio to `alone`'s step of the same round (each round every variant steps
on the epoch's next batch, the same one), and the median time to make a batch (`__getitems__`, which the data workers
do beside the steps: decoding, the processor, and for `ahead` the lookups). Also: `embed_images`' wall time for the
whole file (one process, the same threads), the items it embedded against those the running teacher embeds in an
epoch, and the first step's loss of `running` and `ahead` from the same weights (equal to float32's precision: the file
holds what the running teacher computes).
Writes vl_teacher_ahead_bench.{json,csv,png} under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness

NAME = "vl_teacher_ahead_bench"
FIELDS = ["variant", "step_s", "to_alone", "batch_s", "samples_per_s", "teacher_items_per_epoch"]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--negatives", type=int, default=2)
    p.add_argument("--steps", type=int, default=15, help="timed rounds (each variant one step a round)")
    p.add_argument("--teacher-size", default="base")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default=str(harness.RESULTS))
    return p.parse_args(argv)


def write_rows(root: Path, rows: int, negatives: int, words: list[str]) -> Path:
    """`rows` m2i rows under `root`: random PNGs of 56 to 112 px, texts of the tokenizer's words."""
    import numpy as np
    from PIL import Image

    g = np.random.default_rng(0)
    (root / "img").mkdir(parents=True)
    lines = []
    for i in range(rows):
        for name in (f"q{i}", f"d{i}"):
            h, w = g.integers(56, 113, 2)
            Image.fromarray(g.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / "img" / f"{name}.png")
        others = [(i + 1 + 7 * j) % rows for j in range(negatives)]
        lines.append(
            {
                "query_image": f"img/q{i}.png",
                "query_text": " ".join(g.choice(words, 6)),
                "doc_image": f"img/d{i}.png",
                "doc_negatives": [f"img/d{j}.png" for j in others],
            }
        )
    (root / "rows.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return root / "rows.jsonl"


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    meta = harness.metadata("cpu")
    with tempfile.TemporaryDirectory(prefix="vl-ahead-") as folder:
        rows, payload = measure(args, Path(folder))

    def figure() -> Any:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        names = [r["variant"] for r in rows]
        ax.bar(names, [r["step_s"] for r in rows], label="step")
        ax.bar(names, [r["batch_s"] for r in rows], bottom=[r["step_s"] for r in rows], label="making the batch")
        ax.set_ylabel(f"seconds per batch of {args.batch} (median)")
        once = payload["embed_images_s"]
        ax.set_title(f"Qwen-VL teacher running vs written ahead ({once:.0f} s once), {meta['cpu']}", fontsize=8)
        ax.legend()
        fig.tight_layout()
        return fig

    harness.write_results(args.out, NAME, meta, payload, rows=rows, fields=FIELDS, figure=figure)
    for row in rows:
        print(f"{row['variant']:8s} step {row['step_s']:.3f} s ({row['to_alone']:.3f}x)  batch {row['batch_s']:.3f} s")
    once, items, diff = payload["embed_images_s"], payload["file_items"], payload["first_loss_rel_diff"]
    print(f"embed_images {once:.1f} s for {items} items; first-step loss rel diff {diff:.2e}")


def measure(args: argparse.Namespace, tmp: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(a row per variant, the rest of the result) of the run in the folder `tmp`."""
    import torch

    from benchmarks._qwen_vl_trainer import build_folder, build_trainer, caption_words
    from titan_contrastive import embed_images

    student, teacher = build_folder(tmp / "student", "small"), build_folder(tmp / "teacher", args.teacher_size, 1)
    data = write_rows(tmp / "data", args.rows, args.negatives, caption_words())
    run = [
        "--model.name=qwen_vl",
        "--model.flavor=default",
        f"--model.path={student}",
        "--data.dataset=vl_pairs",
        f"--data.path={data}",
        "--data.retrieval_mode=m2i",
        "--data.context_length=16",
        "--training.dtype=float32",
        "--eval.enable=false",
    ]
    file = tmp / "teacher.arrow"
    start = time.perf_counter()
    code = embed_images.main(["--out", str(file), "--batch-size=32", f"--loss.teacher_model={teacher}", *run])
    embed_s = time.perf_counter() - start
    assert code == 0, "embed_images failed"
    import pyarrow as pa

    items = pa.ipc.open_file(pa.memory_map(str(file))).read_all().num_rows
    taught = ["--loss.distill=kl", "--loss.distill_temperature=0.1", "--loss.distill_weight=1"]
    sources = {"alone": [], "running": [*taught, f"--loss.teacher_model={teacher}"]}
    sources["ahead"] = [*taught, f"--loss.teacher_embeddings={file}"]
    trainers, init = {}, None
    for name, extra in sources.items():
        trainers[name] = build_trainer(
            [
                *run,
                f"--job.dump_folder={tmp / name}",
                f"--training.local_batch_size={args.batch}",
                "--training.steps=1000000",
                "--lr_scheduler.warmup_steps=0",
                "--checkpoint.enable=false",
                "--metrics.enable_tensorboard=false",
                *extra,
            ]
        )
        init = init or {k: v.clone() for k, v in trainers[name].model.state_dict().items()}
        trainers[name].model.load_state_dict(init)  # one student for every variant
    batch_s: dict[str, list[float]] = {name: [] for name in trainers}
    calls = dict.fromkeys(trainers, 0)
    first_loss: dict[str, float] = {}

    def step(name: str) -> Any:
        trainer, j = trainers[name], calls[name]
        calls[name] += 1
        at = [(j * args.batch + i) % args.rows for i in range(args.batch)]
        start = time.perf_counter()
        batch = trainer.train_set.__getitems__(at)
        batch_s[name].append(time.perf_counter() - start)
        torch.manual_seed(j)
        out = trainer.train_step([batch])
        first_loss.setdefault(name, float(out["loss"]))
        return None

    variants = {name: (lambda name=name: step(name)) for name in trainers}
    measured = harness.round_robin(variants, args.steps, device="cpu", rss=False)
    per_epoch = {"alone": 0, "running": args.rows * (2 + args.negatives), "ahead": 0}
    rows = [
        {
            "variant": name,
            "step_s": result.median_s,
            "to_alone": statistics.median(t / a for t, a in zip(result.times_s, measured["alone"].times_s)),
            "batch_s": sorted(batch_s[name][1:])[len(batch_s[name][1:]) // 2],
            "samples_per_s": args.batch / result.median_s,
            "teacher_items_per_epoch": per_epoch[name],
            "times_s": result.times_s,
        }
        for name, result in measured.items()
    ]
    payload = {
        "config": vars(args),
        "embed_images_s": embed_s,
        "file_items": items,
        "first_loss": first_loss,
        "first_loss_rel_diff": abs(first_loss["running"] - first_loss["ahead"]) / abs(first_loss["running"]),
        "parameters": {name: sum(p.numel() for p in t.model.parameters()) for name, t in trainers.items()},
        "teacher_parameters": sum(p.numel() for p in trainers["running"].step_context.guide.parameters()),
    }
    for trainer in trainers.values():
        trainer.metrics.close()
    return rows, payload


if __name__ == "__main__":
    main()
