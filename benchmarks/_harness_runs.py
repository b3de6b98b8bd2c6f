"""The harness's subprocesses and launched runs (re-exported by `benchmarks.harness`, the one module a
benchmark imports): `run_child` with the peak RSS of its process tree, the environment of a
`./run_train.sh` launch, and the variant runs the WordNet benchmarks make (flags, records, rows, and
`recall_benchmark`, the whole of a retrieval benchmark's launch-and-write)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks._harness_results import REPO, RESULTS, metadata, pyplot, write_results

_WRAPPER = """\
import json, resource, subprocess, sys
rc = subprocess.call(sys.argv[2:])
with open(sys.argv[1], "w") as f:
    json.dump({"rc": rc, "maxrss_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}, f)
sys.exit(rc if rc >= 0 else 128 - rc)
"""


def train_env(nproc: int = 1, config_file: str | None = None) -> dict[str, str]:
    """The environment of a `./run_train.sh` launch from a benchmark: this interpreter, `nproc`
    ranks, rank 0's log only, and `config_file` as CONFIG_FILE when given."""
    env = {**os.environ, "NGPU": str(nproc), "PYTHON": sys.executable, "LOG_RANK": "0"}
    return env | ({"CONFIG_FILE": config_file} if config_file else {})


@dataclasses.dataclass
class Child:
    """A finished `run_child`: exit code, captured output, wall time, peak RSS of its largest process."""

    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    peak_rss_mib: float | None


def run_child(
    cmd: Sequence[str | os.PathLike],
    *,
    cwd: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    check: bool = False,
) -> Child:
    """Run `cmd` with its output captured (text), like subprocess.run, and measure the peak RSS of the
    largest process in its tree (ru_maxrss of the reaped descendants of a small wrapper interpreter).
    The tree gets its own session: on a timeout (subprocess.TimeoutExpired) or an interrupt the whole
    tree is killed. `check`: a non-zero exit raises subprocess.CalledProcessError."""
    with tempfile.TemporaryDirectory(prefix="bench_child_") as tmp:
        report = Path(tmp) / "rusage.json"
        wrapped = [sys.executable, "-I", "-S", "-c", _WRAPPER, str(report), *map(str, cmd)]
        start = time.perf_counter()
        proc = subprocess.Popen(
            wrapped,
            cwd=cwd,
            env=None if env is None else dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException as exc:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            if isinstance(exc, subprocess.TimeoutExpired):
                raise subprocess.TimeoutExpired(list(map(str, cmd)), timeout or 0.0, out, err) from None
            raise
        wall = time.perf_counter() - start
        usage = json.loads(report.read_text()) if report.is_file() else {}
    rc = usage.get("rc", proc.returncode)
    maxrss = usage.get("maxrss_kib")  # ru_maxrss: KiB on Linux, bytes on macOS
    peak = None if maxrss is None else maxrss / (2**20 if sys.platform == "darwin" else 1024)
    child = Child(rc, out, err, wall, peak)
    if check and rc != 0:
        raise subprocess.CalledProcessError(rc, list(map(str, cmd)), out, err)
    return child


def variants_parser(description: str, variants: Sequence[str]) -> argparse.ArgumentParser:
    """The options of a benchmark made of `launch_variants` runs: --out, --collect, --variants, --device."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--collect", type=Path, default=None, help="read PREFIX_{variant} dumps instead of running")
    parser.add_argument("--variants", nargs="+", default=list(variants), choices=list(variants))
    parser.add_argument("--device", default="2-core CPU", help="named in the JSON")
    return parser


def train_flags(
    dump: Path, *, steps: int, batch: int, lr: float, warmup: int, log_freq: int, chunk: int = 0
) -> list[str]:
    """`./run_train.sh` and the flags every variant run sets: its dump folder (no TensorBoard), steps,
    local batch, lr, warm-up steps, log frequency, and GradCache chunks of `chunk` when > 0."""
    return [
        "./run_train.sh",
        f"--job.dump_folder={dump}",
        "--metrics.enable_tensorboard=false",
        f"--training.steps={steps}",
        f"--training.local_batch_size={batch}",
        f"--optimizer.lr={lr}",
        f"--lr_scheduler.warmup_steps={warmup}",
        f"--metrics.log_freq={log_freq}",
        *(["--gradcache.enabled=true", f"--gradcache.chunk_sizes={chunk}"] if chunk else []),
    ]


def step_flags(dump: Path, batch: int, cuda: bool) -> list[str]:
    """The flags of a `Trainer` whose `train_step` is timed on one synthetic batch: `batch` generated samples
    (JPEGs decoded and cropped as files are) with 77-token captions, one local batch of them, no gradient
    clipping, no warm-up, bf16 autocast on CUDA, no evaluation or TensorBoard, its dump folder."""
    return [
        "--data.dataset=synthetic",
        f"--data.synthetic_samples={batch}",
        "--data.context_length=77",
        f"--training.local_batch_size={batch}",
        "--training.max_norm=0",
        "--lr_scheduler.warmup_steps=0",
        *(["--training.mixed_precision_param=bfloat16"] if cuda else []),
        "--eval.enable=false",
        "--metrics.enable_tensorboard=false",
        f"--job.dump_folder={dump}",
    ]


def run_records(name: str, dump: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the last eval record, the train records) of variant `name`'s finished run in `dump`; a run
    without an eval record stops the benchmark."""
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    if not evals:
        raise SystemExit(f"{dump}/metrics.jsonl has no eval record: did the {name} run finish?")
    return evals[-1], [r for r in records if r["kind"] == "train"]


def recall_stderr(r: float, n: int) -> float:
    """The standard error of a recall r over n queries (the sampling of the queries, not of training runs)."""
    return (r * (1 - r) / n) ** 0.5


def pairs_data_flags(train: str | Path, test: str | Path, context: int) -> list[str]:
    """The flags of a run on text-pair files: `train` (a path, or paths joined with `::`), `test`
    held out, both sides cut at `context` tokens."""
    return [
        "--data.dataset=pairs",
        f"--data.path={train}",
        f"--data.val_path={test}",
        f"--data.context_length={context}",
        f"--data.doc_context_length={context}",
    ]


def recall_row(name: str, dump: Path, *, n_test: int, batch: int) -> dict[str, Any]:
    """Variant `name`'s finished run in `dump` as a row: steps, eval loss, query-to-document
    recall@1/@10 with their standard errors over `n_test` queries, BEIR nDCG@10 when evaluated,
    the logged samples/s and the training loss by samples seen (`batch` per step)."""
    last, train = run_records(name, dump)
    row: dict[str, Any] = {"variant": name, "steps": last["step"], "eval_loss": last["loss"]}
    for k in (1, 10):
        r = last[f"query_to_doc_r@{k}"]
        row[f"r@{k}"], row[f"se_r@{k}"] = r, recall_stderr(r, n_test)
    row["beir_ndcg@10"] = last.get("beir/ndcg@10")
    row["samples_per_s"] = [r["samples_per_s"] for r in train]
    row["train_loss"] = [(r["step"] * batch, r["loss"]) for r in train]
    return row


def wordnet_rows(split: str) -> list[list[str]]:
    """The bundled WordNet pairs of `split` ("train": definition, lemma, sibling negative; "test":
    definition, lemma), as the bundle stores them."""
    import csv
    import gzip

    with gzip.open(REPO / "titan_contrastive/assets/wordnet" / f"pairs_{split}.tsv.gz", "rt", encoding="utf-8") as f:
        return list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))


def launch_variants(
    names: Sequence[str],
    command: Callable[[str, Path], list[str]],
    read: Callable[[str, Path], dict[str, Any]],
    *,
    prefix: Path,
    collect: bool,
    config_file: str,
) -> Iterator[dict[str, Any]]:
    """One real `run_train.sh` launch of `config_file` per variant (`command(name, dump)`, the dump
    folder `{prefix}_{name}`), each row `read(name, dump)` plus the launch's wall time and peak RSS;
    with `collect`, the finished dumps are re-read instead (wall time and RSS are then unknown: they
    are not in metrics.jsonl). A failed launch stops the benchmark with its output's tail."""
    for name in names:
        dump = Path(f"{prefix}_{name}")
        wall = peak_rss = None
        if not collect:
            result = run_child(command(name, dump), cwd=REPO, env=train_env(config_file=config_file))
            if result.returncode != 0:
                raise SystemExit(f"variant {name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
            wall, peak_rss = result.wall_s, result.peak_rss_mib
        yield {**read(name, dump), "wall_s": wall, "peak_rss_mib": peak_rss}


RECALL_FIELDS = [
    "variant",
    "steps",
    "eval_loss",
    "r@1",
    "se_r@1",
    "r@10",
    "se_r@10",
    "beir_ndcg@10",
    "wall_s",
    "peak_rss_mib",
]


def recall_benchmark(
    args: argparse.Namespace,
    name: str,
    command: Callable[[str, Path], list[str]],
    read: Callable[[str, Path], dict[str, Any]],
    *,
    prefix: Path,
    config_file: str,
    payload: Mapping[str, Any],
    figure: Callable[[list[dict[str, Any]]], Any],
) -> list[dict[str, Any]]:
    """A retrieval benchmark's variants (`variants_parser`'s `args`) launched or collected with
    `launch_variants`, each row's recall printed as it lands, then NAME.{json,csv,png} under
    args.out (`payload` beside the rows, `figure(rows)` the plot). Returns the rows."""
    rows = []
    for row in launch_variants(
        args.variants, command, read, prefix=prefix, collect=args.collect is not None, config_file=config_file
    ):
        rows.append(row)
        print(
            row["variant"], f"R@1 {row['r@1']:.4f}  R@10 {row['r@10']:.4f}  nDCG@10 {row['beir_ndcg@10']}", flush=True
        )
    write_results(
        args.out,
        name,
        metadata(),
        {"device": args.device, **payload},
        rows=rows,
        fields=RECALL_FIELDS,
        dpi=110,
        figure=lambda: figure(rows),
    )
    print(f"wrote {args.out}/{name}.json, .csv and .png")
    return rows


def recall_bars(rows: list[dict[str, Any]], title: str, rotation: float = 0):  # noqa: ANN201 - a matplotlib figure
    """recall@1, recall@10 (± 1 s.e.) and BEIR nDCG@10 per variant, three panels of bars."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (("r@1", "recall@1"), ("r@10", "recall@10"), ("beir_ndcg@10", "BEIR nDCG@10 (5,000 lemmas)"))
    for ax, (key, label) in zip(axes, panels):
        bars = ax.bar(
            [r["variant"] for r in rows], [r[key] or 0 for r in rows], yerr=[r.get(f"se_{key}", 0) for r in rows]
        )
        ax.bar_label(bars, fmt="%.3f", fontsize=8)
        ax.tick_params(axis="x", labelrotation=rotation)
        ax.set_ylabel(label if key.startswith("beir") else f"{label}, 2,000 held-out definitions (± 1 s.e.)")
    fig.suptitle(title)
    return fig
