"""A CLIP taught by a CLIP on CPU: `[loss] teacher_model` on the clip family, as open_clip's `--distill-model`.

    python -m benchmarks.clip_distill_bench          # one teacher, 32 students (about 27 min on 2 cores)
    python -m benchmarks.clip_distill_bench --variants alone "taught both ways, ahead" \
        "taught both ways, ahead, 2 views" --name clip_distill_views   # those variants alone, to another file

The default config (`train_configs/debug.toml`: the debug CLIP on the bundled Fashion-MNIST pairs) trains a teacher
for its full `TEACHER_STEPS`; students of the same flavor then train `STUDENT_STEPS` steps from scratch under each
seed in `SEEDS`: alone (and alone for 200 steps, about the taught runs' wall time), taught one way (each image's
softmax over the captions, `distill = "kl"`), and both ways (`distill_symmetric`, open_clip's DistillClipLoss), by the
teacher running in the steps or by its embeddings written ahead once (`embed_images`, `teacher_embeddings`: each
image's unflipped view; or with `--views 2` both flips, each sample served one with its own embedding); and a smaller
student (`_tiny_clip`: one block of width 32 per tower, a sixth of the
parameters) alone (and for 400 steps) and taught both ways (by both teachers), under each seed in `TINY_SEEDS` (its
runs vary more). The targets are at the teacher's own temperature 1/exp(logit_scale), the term's weight 1 beside the
contrastive loss (open_clip's). Every run ends with the config's zero-shot evaluation on the 10,000 test images.
Writes clip_distill_bench.{json,csv,png} under --out: per run its variant, seed, steps, zero-shot top-1 (with its
standard error over the test images), the eval loss, the median logged samples/s and the launch's wall seconds; and
the wall seconds of writing the teacher's embeddings ahead, once. The runs go seed by seed, the variants interleaved.
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks import harness

CONFIG = "train_configs/debug.toml"
TEACHER_STEPS, STUDENT_STEPS, SEEDS, TINY_SEEDS = 600, 150, (1, 2), (1, 2, 3, 4)
TINY = ["--job.custom_import=benchmarks._tiny_clip", "--model.name=clip_tiny", "--model.flavor=tiny"]
BOTH_WAYS = ["--loss.distill=kl", "--loss.distill_symmetric=true"]
VARIANTS = {  # name: (steps, flags, teacher: "" none, "model" running in the steps, "file" written ahead, seeds)
    "alone": (STUDENT_STEPS, [], "", SEEDS),
    "alone, 200 steps": (200, [], "", SEEDS),  # about the taught runs' wall time: the teacher costs half a step
    "taught one way": (STUDENT_STEPS, ["--loss.distill=kl"], "model", SEEDS),
    "taught both ways": (STUDENT_STEPS, BOTH_WAYS, "model", SEEDS),
    "taught both ways, ahead": (STUDENT_STEPS, BOTH_WAYS, "file", SEEDS),
    "taught both ways, ahead, 2 views": (STUDENT_STEPS, BOTH_WAYS, "views", SEEDS),
    "tiny alone": (STUDENT_STEPS, TINY, "", TINY_SEEDS),
    "tiny alone, 400 steps": (400, TINY, "", TINY_SEEDS),  # about the taught tiny runs' wall time
    "tiny taught both ways": (STUDENT_STEPS, [*TINY, *BOTH_WAYS], "model", TINY_SEEDS),
    "tiny taught both ways, ahead": (STUDENT_STEPS, [*TINY, *BOTH_WAYS], "file", TINY_SEEDS),
    "tiny taught both ways, ahead, 2 views": (STUDENT_STEPS, [*TINY, *BOTH_WAYS], "views", TINY_SEEDS),
}
FIELDS = ["variant", "seed", "steps", "zero_shot_top1", "se_top1", "eval_loss", "samples_per_s", "wall_s"]
TEST_IMAGES = 10_000


def launch(dump: Path, steps: int, seed: int, *flags: str) -> dict[str, Any]:
    """One `run_train.sh` of the default config; its row (without the variant)."""
    cmd = ["./run_train.sh", f"--job.dump_folder={dump}", "--metrics.enable_tensorboard=false"]
    cmd += [f"--training.steps={steps}", f"--training.seed={seed}", *flags]
    result = harness.run_child(cmd, cwd=harness.REPO, env=harness.train_env(config_file=CONFIG))
    if result.returncode != 0:
        raise SystemExit(f"{dump} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    last, train = harness.run_records(dump.name, dump)
    top1 = last["zero_shot_top1"]
    return {
        "seed": seed,
        "steps": steps,
        "zero_shot_top1": top1,
        "se_top1": math.sqrt(top1 * (1 - top1) / TEST_IMAGES),
        "eval_loss": last["loss"],
        "samples_per_s": statistics.median(r["samples_per_s"] for r in train[1:] or train),
        "wall_s": result.wall_s,
    }


def plot(rows: list[dict[str, Any]]):  # noqa: ANN201 - a matplotlib figure
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(12, 5))
    names = list(dict.fromkeys(r["variant"] for r in rows if "zero_shot_top1" in r))
    runs = {name: [r["zero_shot_top1"] for r in rows if r["variant"] == name] for name in names}
    bars = ax.bar(names, [statistics.mean(v) for v in runs.values()], alpha=0.6, label="mean over seeds")
    ax.bar_label(bars, fmt="%.3f", fontsize=8)
    for x, values in enumerate(runs.values()):
        ax.plot([x] * len(values), values, "k.", label="one seed" if x == 0 else None)
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    ax.set_ylabel("zero-shot top-1, 10,000 Fashion-MNIST test images")
    ax.legend()
    fig.suptitle(f"debug CLIP: a teacher of {TEACHER_STEPS} steps; students alone or taught by it")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=harness.RESULTS, help="where NAME.{json,csv,png} go")
    p.add_argument("--name", default="clip_distill_bench", help="the result files' name (default: clip_distill_bench)")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), help="the students to run")
    args = p.parse_args(argv)
    from titan_contrastive.models.clip import load_clip

    prefix = harness.REPO / "outputs" / "clip_distill_bench"
    shutil.rmtree(prefix, ignore_errors=True)  # a run left from before would resume
    teacher_dump = prefix / "teacher"
    saves = ["--checkpoint.enable=true", f"--checkpoint.interval={TEACHER_STEPS}"]
    rows = [{"variant": "teacher", **launch(teacher_dump, TEACHER_STEPS, 0, *saves)}]
    teacher = teacher_dump / "checkpoint" / f"step-{TEACHER_STEPS}"
    tau = math.exp(-load_clip(teacher).logit_scale.item())
    print(f"teacher: zero-shot top-1 {rows[0]['zero_shot_top1']:.4f}, temperature {tau:.4g}", flush=True)
    sources = {"model": f"--loss.teacher_model={teacher}"}
    for kind, views in (("file", 0), ("views", 2)):  # each file the chosen variants read, written once
        if any(VARIANTS[name][2] == kind for name in args.variants):
            embeddings = prefix / f"teacher_{kind}.parquet"
            cmd = [sys.executable, "-m", "titan_contrastive.embed_images", f"--out={embeddings}", f"--views={views}"]
            cmd += [f"--job.config_file={CONFIG}", f"--loss.teacher_model={teacher}", "--loss.distill=kl"]
            result = harness.run_child(cmd, cwd=harness.REPO)
            if result.returncode != 0:
                raise SystemExit(f"embed_images failed:\n{result.stderr[-2000:]}")
            rows.append({"variant": f"embed ahead (once, {views} views)", "wall_s": result.wall_s})
            sources[kind] = f"--loss.teacher_embeddings={embeddings}"
    runs = [
        (seed, i, name) for i, (name, spec) in enumerate(VARIANTS.items()) for seed in spec[3] if name in args.variants
    ]
    for seed, i, name in sorted(runs):  # the variants interleaved, so a slow stretch of the machine falls on all alike
        steps, flags, teaches, _ = VARIANTS[name]
        extra = [*flags, sources[teaches], f"--loss.distill_temperature={tau!r}"] if teaches else flags
        row = {"variant": name, **launch(prefix / f"student{i}_seed{seed}", steps, seed, *extra)}
        rows.append(row)
        print(name, seed, {k: round(row[k], 4) for k in ("zero_shot_top1", "eval_loss", "wall_s")}, flush=True)
    written = sum(1 for r in rows if r["variant"].startswith(("teacher", "embed ahead")))
    rows[written:] = sorted(rows[written:], key=lambda r: (list(VARIANTS).index(r["variant"]), r["seed"]))
    payload = {"teacher_steps": TEACHER_STEPS, "student_steps": STUDENT_STEPS, "temperature": tau}
    harness.write_results(
        args.out,
        args.name,
        harness.metadata(),
        payload,
        rows=rows,
        fields=FIELDS,
        figure=lambda: plot(rows),
    )
    print(f"wrote {args.out}/{args.name}.json, .csv and .png")


if __name__ == "__main__":
    main()
