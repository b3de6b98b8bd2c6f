"""Hard negatives drawn per epoch from a pool (`data.negatives_per_row`) against one fixed negative, WordNet.

    pip install -e '.[hf,data]'                              # transformers, sentence-transformers, offline MiniLM
    python -m benchmarks.wordnet_pools                        # one mining + four runs (about 45 min on 2 CPU cores)
    python -m benchmarks.wordnet_pools --collect /tmp/wp      # re-read finished dumps {/tmp/wp_inbatch, ...}

A random 8,192 of the bundled WordNet training pairs (definition, lemma) get 8 negatives each, mined by the
pretrained all-MiniLM-L6-v2 the runs start from (`python -m titan_contrastive.mine --negatives 8`: its default
TopK-PercPos filter, 95 % of the positive; a row with fewer than 8 candidates left is left out). Every run trains
on the same kept rows, for the same samples (16,384: several epochs of them), batch (256 in GradCache chunks of
32), lr and seed; only the negative each query sees changes:

- inbatch: none (`data.hard_negatives=false`);
- top1: the first mined negative of each row, every epoch (what `--negatives 1` mines);
- fixed_random: one of the 8 picked once per row at random, every epoch (as hard as a draw, never another);
- drawn: one of the 8 per epoch (`data.negatives_per_row=1`): each epoch another, in tevatron's order.

fixed_random separates the draw's two changes against top1: a negative further down the ranking, and another
one each epoch. All report recall@1/@10 of the 2,000 held-out definitions against the 2,000 test lemmas and the
bundled BEIR set's nDCG@10. One run each; the standard error of a recall r over 2,000 queries is
sqrt(r (1 - r) / 2000). Writes wordnet_pools.{json,csv,png} under --out.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

from benchmarks import harness

SAMPLES, BATCH, CHUNK, LR, WARMUP, CONTEXT = 16_384, 256, 32, 1.1e-4, 6, 32
ROWS, POOL, SEED = 8_192, 8, 0
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "inbatch": ("mined", ["--data.hard_negatives=false"]),
    "top1": ("top1", []),
    "fixed_random": ("fixed_random", []),
    "drawn": ("mined", ["--data.negatives_per_row=1"]),
}
"""Per variant, the file it trains on and its flags."""
N_TEST = 2000
CONFIG = "train_configs/wordnet_minilm.toml"


def files(folder: Path) -> dict[str, Path]:
    names = ("subset", "test")
    jsonl = ("mined", "top1", "fixed_random")
    return {n: folder / f"{n}.tsv" for n in names} | {n: folder / f"{n}.jsonl" for n in jsonl}


def prepare(folder: Path) -> dict[str, Any]:
    """subset.tsv (ROWS random training pairs, no header), test.tsv, the mined file (kept when `mining.json` records
    the same command), top1.jsonl (each row's first mined negative) and fixed_random.jsonl (one of each row's mined
    negatives, by SEED); what the mining took."""
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    folder.mkdir(parents=True, exist_ok=True)
    paths = files(folder)
    train = harness.wordnet_rows("train")
    subset = random.Random(SEED).sample(train, ROWS)
    paths["subset"].write_text("".join(f"{row[0]}\t{row[1]}\n" for row in subset), encoding="utf-8")
    paths["test"].write_text("".join("\t".join(r) + "\n" for r in harness.wordnet_rows("test")), encoding="utf-8")
    record, flags = folder / "mining.json", [f"--negatives={POOL}", "--batch-size=256"]
    shown = " ".join(["python -m titan_contrastive.mine subset.tsv --model=<MiniLM>", *flags])
    report = json.loads(record.read_text()) if record.is_file() else {}
    if not paths["mined"].is_file() or report.get("command") != shown:
        cmd = [sys.executable, "-m", "titan_contrastive.mine", paths["subset"], f"--model={bundled_minilm()}"]
        result = harness.run_child([*cmd, f"--out={paths['mined']}", "--overwrite", *flags], cwd=harness.REPO)
        if result.returncode != 0:
            raise SystemExit(f"mining failed:\n{result.stderr[-2000:]}")
        kept = sum(1 for _ in paths["mined"].open(encoding="utf-8"))
        report = {"command": shown, "wall_s": result.wall_s, "rows": kept, "of": ROWS}
        record.write_text(json.dumps(report, indent=1))
    pick = random.Random(SEED)
    mined = [json.loads(line) for line in paths["mined"].read_text(encoding="utf-8").splitlines()]
    for name, place in (("top1", lambda: 1), ("fixed_random", lambda: pick.randrange(POOL) + 1)):
        rows = [{"anchor": r["anchor"], "positive": r["positive"], "negative": r[f"negative_{place()}"]} for r in mined]
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return report


def command(name: str, dump: Path) -> list[str]:
    steps = SAMPLES // BATCH
    paths = files(dump.parent / "data")
    source, extra = VARIANTS[name]
    flags = dict(steps=steps, batch=BATCH, lr=LR, warmup=WARMUP, log_freq=max(1, steps // 8), chunk=CHUNK)
    return [
        *harness.train_flags(dump, **flags),
        *harness.pairs_data_flags(paths[source], paths["test"], CONTEXT),
        *extra,
    ]


def read(name: str, dump: Path) -> dict[str, Any]:
    row = harness.recall_row(name, dump, n_test=N_TEST, batch=BATCH)
    return row | {"command": " ".join(command(name, Path(f"<dump>_{name}")))}


def plot(rows: list[dict[str, Any]]):  # noqa: ANN201 - a matplotlib figure
    return harness.recall_bars(
        rows, f"bi_encoder/minilm_l6 on {ROWS} WordNet pairs, {SAMPLES} samples: which of {POOL} mined negatives"
    )


def main(argv: list[str] | None = None) -> None:
    args = harness.variants_parser(__doc__.splitlines()[0], list(VARIANTS)).parse_args(argv)
    prefix = args.collect or (harness.REPO / "outputs" / "wordnet_pools_runs" / "wp")
    data = prefix.parent / "data"
    mining = json.loads((data / "mining.json").read_text()) if args.collect else prepare(data)
    print(f"mining: {mining['rows']} of {mining['of']} rows kept, in {mining['wall_s']:.0f} s", flush=True)
    harness.recall_benchmark(
        args,
        "wordnet_pools",
        command,
        read,
        prefix=prefix,
        config_file=CONFIG,
        payload={"samples_seen": SAMPLES, "batch": BATCH, "gradcache_chunk": CHUNK, "lr": LR, "mining": mining},
        figure=plot,
    )


if __name__ == "__main__":
    main()
