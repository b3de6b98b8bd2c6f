"""Model soups on CPU: two MiniLM fine-tunes on WordNet merged by `python -m titan_contrastive.merge`.

    pip install -e '.[hf]'
    python -m benchmarks.merge_bench            # three runs, four merges, eight evaluations (about 15 min on 2 cores)

`train_configs/wordnet_minilm.toml` (the bundled all-MiniLM-L6-v2, shared towers, WordNet definition -> lemma with
sibling negatives) cut to `STEPS` steps of `BATCH`, launched with `run_train.sh` as `RUNS` says: seeds 1 and 2 at lr
3e-5 (other data orders and dropout draws from the same pretrained start, one recipe) and seed 3 at lr 1e-4 (another
recipe). Their last step folders are merged as `MERGES` says: the two of one recipe by the uniform average and by
slerp at t 0.5, the two recipes' seeds 1 and 3 by the average, and all three. Every model, the untrained MiniLM too,
is evaluated by `python -m titan_contrastive.evaluate` on the bundled BEIR set (2,000 held-out definitions against
5,000 lemmas). Writes merge_bench.{json,csv,png} under --out: per variant nDCG@10, MRR@10, recall@1/@10 and the
wall seconds of what made it (the run, or the merge).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from benchmarks import harness

STEPS, BATCH = 200, 32
RUNS = {"seed 1": (1, 3e-5), "seed 2": (2, 3e-5), "seed 3, lr 1e-4": (3, 1e-4)}
"""name -> (training.seed, optimizer.lr)."""
MERGES = {
    "soup 1+2": (("seed 1", "seed 2"), ()),
    "slerp 1+2, t 0.5": (("seed 1", "seed 2"), ("--method", "slerp", "--t", "0.5")),
    "soup 1+3 (two lrs)": (("seed 1", "seed 3, lr 1e-4"), ()),
    "soup 1+2+3": (tuple(RUNS), ()),
}
"""name -> (the runs merged, merge's options)."""
CONFIG = "train_configs/wordnet_minilm.toml"
FIELDS = ["variant", "ndcg@10", "mrr@10", "recall@1", "recall@10", "made_s", "eval_s"]


def train(prefix: Path, seed: int, lr: float, steps: int = STEPS, batch: int = BATCH) -> tuple[Path, float]:
    """One fine-tune; (its last step folder, the launch's wall seconds)."""
    dump = Path(f"{prefix}_seed{seed}")
    flags = harness.train_flags(dump, steps=steps, batch=batch, lr=lr, warmup=steps // 10, log_freq=steps // 5)
    flags += [f"--training.seed={seed}", "--eval.enable=false", "--checkpoint.enable=true"]
    flags += [f"--checkpoint.interval={steps}"]
    result = harness.run_child(flags, cwd=harness.REPO, env=harness.train_env(config_file=CONFIG))
    if result.returncode != 0:
        raise SystemExit(f"seed {seed} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return dump / "checkpoint" / f"step-{steps}", result.wall_s


def merge(out: Path, sources: list[Path], *extra: str) -> float:
    cmd = [sys.executable, "-m", "titan_contrastive.merge", *map(str, sources), "--out", str(out), *extra]
    result = harness.run_child(cmd, cwd=harness.REPO)
    if result.returncode != 0:
        raise SystemExit(f"merge failed:\n{result.stderr[-2000:]}")
    return result.wall_s


def evaluate(model: Path | str, out: Path) -> tuple[dict[str, Any], float]:
    cmd = [sys.executable, "-m", "titan_contrastive.evaluate", str(model), "--out", str(out)]
    result = harness.run_child(cmd, cwd=harness.REPO)
    if result.returncode != 0:
        raise SystemExit(f"evaluating {model} failed:\n{result.stderr[-2000:]}")
    return json.loads(out.read_text()), result.wall_s


def plot(rows: list[dict[str, Any]]):  # noqa: ANN201 - a matplotlib figure
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, key in zip(axes, ("ndcg@10", "recall@1")):
        bars = ax.bar([r["variant"] for r in rows], [r[key] for r in rows])
        ax.tick_params(axis="x", labelrotation=60, labelsize=7)
        ax.bar_label(bars, fmt="%.4f", fontsize=8)
        ax.set_ylabel(f"{key}, bundled WordNet BEIR set")
        low = min(r[key] for r in rows)
        ax.set_ylim(low * 0.95, max(r[key] for r in rows) * 1.02)
    fig.suptitle(f"MiniLM on WordNet, {STEPS} steps of {BATCH}: runs and their merges")
    return fig


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=harness.RESULTS, help="where merge_bench.{json,csv,png} go")
    args = p.parse_args(argv)
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    prefix = harness.REPO / "outputs" / "merge_bench" / "mb"
    shutil.rmtree(prefix.parent, ignore_errors=True)  # a run left from before would resume, a merge be refused
    models: dict[str, Path | str] = {"MiniLM (no training)": bundled_minilm()}
    made: dict[str, float] = {}
    for name, (seed, lr) in RUNS.items():
        models[name], made[name] = train(prefix, seed, lr)
    for i, (name, (runs, extra)) in enumerate(MERGES.items()):
        models[name] = Path(f"{prefix}_merged{i}")
        made[name] = merge(Path(models[name]), [Path(models[run]) for run in runs], *extra)
    rows = []
    for i, (name, model) in enumerate(models.items()):
        metrics, wall = evaluate(model, Path(f"{prefix}_eval{i}.json"))
        rows.append({"variant": name, **{k: metrics[k] for k in FIELDS[1:5]}, "made_s": made.get(name), "eval_s": wall})
        print(name, {k: round(metrics[k], 4) for k in FIELDS[1:5]}, flush=True)
    payload = {"steps": STEPS, "batch": BATCH, "runs": RUNS, "merges": {k: v[0] for k, v in MERGES.items()}}
    harness.write_results(
        args.out, "merge_bench", harness.metadata(), payload, rows=rows, fields=FIELDS, figure=lambda: plot(rows)
    )
    print(f"wrote {args.out}/merge_bench.json, .csv and .png")


if __name__ == "__main__":
    main()
