"""WiSE-FT on CPU: a MiniLM fine-tune on WordNet interpolated with the model it started from, `merge --with-start`.

    pip install -e '.[hf]'
    python -m benchmarks.wise_ft_bench          # one run, four merges, seven evaluations (about 10 min on 2 cores)

`train_configs/wordnet_minilm.toml` (the bundled all-MiniLM-L6-v2) cut to `STEPS` steps of `BATCH` at lr `LR`,
launched with `run_train.sh`; its last step folder merged with its start (the MiniLM folder) by
`python -m titan_contrastive.merge STEP --with-start`, the weighted average at each fraction in `ALPHAS` of the way
to the fine-tune (weights 1 - a, a) and slerp at t 0.5. The start, the fine-tune and every merge are evaluated by
`python -m titan_contrastive.evaluate` on the bundled BEIR set (2,000 held-out definitions against 5,000 lemmas).
Writes wise_ft_bench.{json,csv,png} under --out: per variant the fraction, nDCG@10, MRR@10, recall@1/@10 and the
wall seconds of what made it.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.merge_bench import evaluate, merge, train

STEPS, BATCH, LR, SEED = 400, 32, 1e-4, 3
ALPHAS = (0.25, 0.5, 0.75)
"""The fractions of the way from the start to the fine-tune merged by the weighted average."""
FIELDS = ["variant", "alpha", "ndcg@10", "mrr@10", "recall@1", "recall@10", "made_s", "eval_s"]


def plot(rows: list[dict[str, Any]]):  # noqa: ANN201 - a matplotlib figure
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    curve = sorted((r for r in rows if not r["variant"].startswith("slerp")), key=lambda r: r["alpha"])
    for ax, key in zip(axes, ("ndcg@10", "recall@1")):
        ax.plot([r["alpha"] for r in curve], [r[key] for r in curve], "o-", label="weighted average")
        for r in rows:
            if r["variant"].startswith("slerp"):
                ax.plot([r["alpha"]], [r[key]], "s", label=r["variant"])
        ax.set_xlabel("fraction of the way from the start (0) to the fine-tune (1)")
        ax.set_ylabel(f"{key}, bundled WordNet BEIR set")
        ax.legend()
    fig.suptitle(f"WiSE-FT: MiniLM fine-tuned {STEPS} steps of {BATCH} at lr {LR:g} on WordNet, merged with its start")
    return fig


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=harness.RESULTS, help="where wise_ft_bench.{json,csv,png} go")
    args = p.parse_args(argv)
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    prefix = harness.REPO / "outputs" / "wise_ft_bench" / "wf"
    shutil.rmtree(prefix.parent, ignore_errors=True)  # a run left from before would resume, a merge be refused
    step, trained_s = train(prefix, SEED, LR, steps=STEPS, batch=BATCH)
    variants: list[tuple[str, float, Path | str, float | None]] = [
        ("start (MiniLM)", 0.0, bundled_minilm(), None),
        ("fine-tune", 1.0, step, trained_s),
    ]
    for i, alpha in enumerate(ALPHAS):
        out = Path(f"{prefix}_mean{i}")
        variants.append(
            (f"mean, a {alpha}", alpha, out, merge(out, [step], "--with-start", "--weights", f"{1 - alpha},{alpha}"))
        )
    out = Path(f"{prefix}_slerp")
    variants.append(("slerp, t 0.5", 0.5, out, merge(out, [step], "--with-start", "--method", "slerp")))
    rows = []
    for i, (name, alpha, model, made) in enumerate(variants):
        metrics, wall = evaluate(model, Path(f"{prefix}_eval{i}.json"))
        rows.append(
            {"variant": name, "alpha": alpha, **{k: metrics[k] for k in FIELDS[2:6]}, "made_s": made, "eval_s": wall}
        )
        print(name, {k: round(metrics[k], 4) for k in FIELDS[2:6]}, flush=True)
    payload = {"steps": STEPS, "batch": BATCH, "lr": LR, "seed": SEED, "alphas": ALPHAS}
    harness.write_results(
        args.out, "wise_ft_bench", harness.metadata(), payload, rows=rows, fields=FIELDS, figure=lambda: plot(rows)
    )
    print(f"wrote {args.out}/wise_ft_bench.json, .csv and .png")


if __name__ == "__main__":
    main()
