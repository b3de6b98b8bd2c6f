"""A random-init Qwen3-like decoder embedder with LoRA: the largest contrastive batch GradCache fits against plain.

    python -m benchmarks.decoder_lora_bench --size 0.6b --time-budget 500 --repeats 2 --out DIR   # one H100
    python -m benchmarks.decoder_lora_bench --size tiny --seq-len 16 --start-batch 4 --chunk 2 --max-batch 8 \
        --repeats 1 --out /tmp/bench                                                          # CPU smoke

The model: a Qwen3Model with random weights saved with `save_pretrained` (bfloat16) and a word-level
tokenizer (4,096 words, `<|endoftext|>` appended and used as the left pad, as Qwen3-Embedding's
tokenizer does) in one temporary folder; nothing is downloaded. `--size 0.6b` has Qwen3-0.6B's layers
(hidden 1024, 28 layers, 16 heads, 8 KV heads, head_dim 128, intermediate 3072; 440 M parameters in
the layers) but the tokenizer's 4,096-word vocabulary instead of 151,936: the embedding is a lookup,
so this changes the frozen parameters by 151 M (0.6 GB in float32) and not the step's compute.
`--size tiny` (2 layers, hidden 64) is for CPU smoke tests.

The trainer: the project's `Trainer` in this process, one per mode (the model is built once per mode),
as `[model] name = "bi_encoder"`, `path` = that folder, last_token pooling, `[lora] enable` (rank
`--lora-rank` on peft's Qwen default q_proj / v_proj, alpha 2 r), bfloat16 mixed precision on CUDA
(float32 on CPU), the default data-parallel layout, eval and checkpoints off. Each measured step is
`Trainer.train_step` on one batch of `--seq-len` random token ids per query and per document (the
last one `<|endoftext|>`, no padding), so every batch size reuses the mode's trainer. The layout is
in the JSON (`layout`): on one process it is `single` (FSDP2 needs a shard degree above 1, i.e.
several ranks); `--train-arg` passes further trainer overrides (e.g. activation checkpointing).

Modes, in `--modes` order (default plain first: its search ends at its first out-of-memory error
within seconds and leaves the rest of the budget to GradCache): `plain` (one forward and backward of
the whole batch) and `gradcache` (GradCache in chunks of `--chunk` samples). Each doubles the batch
from `--start-batch` until a CUDA out-of-memory error, `--max-batch` or the time budget; a start that
does not fit is halved until one does, and a mode starts at the largest batch of the mode before it
when that is smaller, so both have a row there. Per batch size: one warm-up step and `--repeats` timed
steps (`harness.round_robin`), median samples/s, peak CUDA memory (peak RSS on CPU). `--time-budget`
seconds (from start) ends a mode's search before a batch whose predicted time (its warm-up and timed
steps, scaled from the previous size's step time) would pass the mode's share of what is left: the
remaining time split evenly over the remaining modes.

Writes decoder_lora_bench.{json,csv} after every measured batch (a killed run keeps its rows) and
the .png at the end; the summary: largest batch per mode, samples/s of GradCache at its largest
batch against plain at its largest, and both at plain's largest batch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks import harness

NAME = "decoder_lora_bench"
EOS, UNK = "<|endoftext|>", "[UNK]"
VOCAB = 4096
SIZES: dict[str, dict[str, int]] = {
    "0.6b": {  # Qwen3-0.6B's layers
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 3072,
    },
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
    },
}
MODES = ("plain", "gradcache")
FIELDS = [
    "mode",
    "batch",
    "chunk",
    "status",
    "samples_per_s",
    "tokens_per_s",
    "median_s",
    "min_s",
    "max_s",
    "cuda_peak_gib",
    "peak_rss_mib",
    "loss",
    "reason",
]


# ---------------------------------------------------------------- the model folder


def build_folder(folder: Path, size: str, seq_len: int, seed: int = 0) -> Path:
    """A random-init Qwen3-like decoder (`SIZES[size]`, bfloat16 weights) and its tokenizer saved in `folder`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3Model

    words = [EOS, UNK, *(f"w{i}" for i in range(VOCAB - 2))]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, vocab[EOS])])
    length = max(512, seq_len)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=UNK, eos_token=EOS, pad_token=EOS, padding_side="left", model_max_length=length
    )
    config = Qwen3Config(
        vocab_size=VOCAB,
        max_position_embeddings=length,
        pad_token_id=vocab[EOS],
        eos_token_id=vocab[EOS],
        bos_token_id=None,
        **SIZES[size],
    )
    torch.manual_seed(seed)
    Qwen3Model(config).to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_pairs(path: Path, rows: int, words: int = 8) -> Path:
    """A small pairs file for the trainer's data set (its batches are not used: the steps get random ids)."""
    g = random.Random(0)

    def text() -> str:
        return " ".join(f"w{g.randrange(VOCAB - 2)}" for _ in range(words))

    path.write_text("".join(json.dumps({"query": text(), "positive": text()}) + "\n" for _ in range(rows)))
    return path


def random_batch(batch: int, seq_len: int, pin: bool, seed: int) -> dict[str, Any]:
    """{"query", "doc"}: [batch, seq_len] random word ids, each row ending with <|endoftext|> (id 0)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for key in ("query", "doc"):
        ids = torch.randint(2, VOCAB, (batch, seq_len), generator=g)
        ids[:, -1] = 0
        out[key] = ids.pin_memory() if pin else ids
    return out


# ---------------------------------------------------------------- one mode


def trainer_args(args: argparse.Namespace, mode: str, folder: Path, pairs: Path, dump: Path, cuda: bool) -> list[str]:
    overrides = [
        f"--job.dump_folder={dump}",
        "--model.name=bi_encoder",
        "--model.flavor=shared",
        f"--model.path={folder}",
        "--model.pooling=last_token",
        "--lora.enable=true",
        f"--lora.rank={args.lora_rank}",
        f"--lora.alpha={2 * args.lora_rank}",
        "--data.dataset=pairs",
        f"--data.path={pairs}",
        f"--data.context_length={args.seq_len}",
        f"--data.doc_context_length={args.seq_len}",
        f"--training.local_batch_size={args.start_batch}",
        "--training.steps=1000000",
        f"--training.device={'cuda' if cuda else 'cpu'}",
        f"--training.mixed_precision_param={args.precision or ('bfloat16' if cuda else 'float32')}",
        "--lr_scheduler.warmup_steps=0",
        "--eval.enable=false",
        "--checkpoint.enable=false",
        "--metrics.enable_tensorboard=false",
    ]
    if mode == "gradcache":
        overrides += ["--gradcache.enabled=true", f"--gradcache.chunk_sizes={args.chunk}"]
    return overrides + list(args.train_arg)


def train_step(trainer: Any, batch: dict[str, Any]) -> Any:
    """`trainer.train_step([batch])`; an error other than running out of memory prints its traceback
    (the harness keeps only its first line) before it ends the mode."""
    import torch

    try:
        return trainer.train_step([batch])
    except torch.OutOfMemoryError:
        raise
    except Exception:
        traceback.print_exc()
        raise


def search(
    args: argparse.Namespace,
    mode: str,
    trainer: Any,
    start: int,
    deadline: float | None,
    record: Any,
) -> dict[str, Any]:
    """Double the batch from `start` (halving first while the start does not fit; `harness.doubling_search`);
    each measured batch goes to `record(row)`. Returns how the search ended: {"stop": reason}."""
    device, seq_len = trainer.device, args.seq_len
    cuda = device.type == "cuda"

    def measure(batch: int) -> dict[str, Any]:
        data = random_batch(batch, seq_len, pin=cuda, seed=batch)
        m = harness.round_robin(
            {mode: lambda data=data: train_step(trainer, data)},
            args.repeats,
            warmup=args.warmup,
            device=device,
            rss=not cuda,
            tolerate=True,
            keep_values=True,
        )[mode]
        del data
        row: dict[str, Any] = {"mode": mode, "batch": batch, "chunk": args.chunk if mode == "gradcache" else None}
        if m.ok:
            row |= {
                "status": "ok",
                "samples_per_s": batch / m.median_s,
                "tokens_per_s": 2 * seq_len * batch / m.median_s,
                "median_s": m.median_s,
                "min_s": min(m.times_s),
                "max_s": max(m.times_s),
                "times_s": m.times_s,
                "cuda_peak_gib": None if m.cuda_peak_bytes is None else m.cuda_peak_bytes / 2**30,
                "peak_rss_mib": m.peak_rss_mib,
                "loss": float(m.values[-1]["loss"]),
            }
            m.values.clear()
        else:
            row |= {"status": "OOM" if harness.is_oom(m) else "error", "reason": m.reason}
        record(row)
        return row

    def seconds_for(previous: dict[str, Any], batch: int) -> float:
        return 1.15 * previous["median_s"] * batch / previous["batch"] * (args.warmup + args.repeats)

    return harness.doubling_search(
        start,
        measure,
        smallest=1,
        largest=args.max_batch,
        deadline=deadline,
        seconds_for=seconds_for,
        device=device,
    )


# ---------------------------------------------------------------- summary, figure


def summarize(rows: list[dict[str, Any]], ends: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ok = {mode: [r for r in rows if r["mode"] == mode and r["status"] == "ok"] for mode in MODES}
    largest = {mode: max(rs, key=lambda r: r["batch"]) if rs else None for mode, rs in ok.items()}
    out: dict[str, Any] = {
        "largest_batch": {m: r["batch"] if r else None for m, r in largest.items()},
        "samples_per_s_at_largest": {m: r["samples_per_s"] if r else None for m, r in largest.items()},
        "peak_gib_at_largest": {m: r.get("cuda_peak_gib") if r else None for m, r in largest.items()},
        "stop": {m: e["stop"] for m, e in ends.items()},
        "gradcache_vs_plain_samples_per_s": None,
        "gradcache_vs_plain_batch": None,
        "at_plain_largest_batch": None,
    }
    g, p = largest["gradcache"], largest["plain"]
    if g and p:
        out["gradcache_vs_plain_samples_per_s"] = g["samples_per_s"] / p["samples_per_s"]
        out["gradcache_vs_plain_batch"] = g["batch"] / p["batch"]
        same = next((r for r in ok["gradcache"] if r["batch"] == p["batch"]), None)
        if same:
            out["at_plain_largest_batch"] = {
                "batch": p["batch"],
                "gradcache_samples_per_s": same["samples_per_s"],
                "plain_samples_per_s": p["samples_per_s"],
                "ratio": same["samples_per_s"] / p["samples_per_s"],
            }
    return out


def summary_lines(summary: dict[str, Any]) -> list[str]:
    lines = []
    for mode in MODES:
        batch, rate = summary["largest_batch"].get(mode), summary["samples_per_s_at_largest"].get(mode)
        peak = summary["peak_gib_at_largest"].get(mode)
        stop = summary["stop"].get(mode, "not run")
        if batch is None:
            lines.append(f"{mode}: no batch fits ({stop})")
            continue
        memory = f", peak {peak:.1f} GiB" if peak is not None else ""
        lines.append(f"{mode}: largest batch {batch}, {rate:.1f} samples/s{memory} (stopped: {stop})")
    if summary["gradcache_vs_plain_samples_per_s"] is not None:
        lines.append(
            f"GradCache at its largest batch against plain at its largest: {summary['gradcache_vs_plain_batch']:g}x "
            f"the batch, {summary['gradcache_vs_plain_samples_per_s']:.3f}x the samples/s"
        )
    same = summary["at_plain_largest_batch"]
    if same:
        lines.append(f"at batch {same['batch']}: GradCache {same['ratio']:.3f}x plain's samples/s")
    return lines


# ---------------------------------------------------------------- main


def describe(trainer: Any) -> dict[str, Any]:
    """The run's layout and parameter counts, from a built trainer."""
    params = list(trainer.model.parameters())
    return {
        "layout": trainer.dims.mode,
        "params": sum(p.numel() for p in params),
        "trainable_params": sum(p.numel() for p in params if p.requires_grad),
        "lora_targets": list(trainer.model_args.lora_targets),
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=list(SIZES), default="0.6b")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per query and per document")
    parser.add_argument("--chunk", type=int, default=64, help="GradCache chunk (samples)")
    parser.add_argument("--start-batch", type=int, default=256)
    parser.add_argument("--max-batch", type=int, default=1 << 20)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="measured in this order")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per batch size")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per batch size")
    parser.add_argument("--time-budget", type=float, default=0.0, help="seconds from start; 0 = none")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--precision", choices=["bfloat16", "float32"], default=None, help="default: bf16 on CUDA")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--train-arg", action="append", default=[], help="a further trainer override (repeatable)")
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    start = time.monotonic()
    import torch

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("decoder_lora_bench runs as one process (an out-of-memory rank would leave its peers waiting)")
    logging.basicConfig(
        level=logging.INFO, format="[titan_contrastive] %(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout
    )
    from titan_contrastive.config import parse_args
    from titan_contrastive.train import Trainer

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    capacity = torch.cuda.get_device_properties(device).total_memory / 2**30 if cuda else None
    meta = harness.metadata(device, pytorch_cuda_alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    title = (
        f"Qwen3-like {args.size} decoder (random init), LoRA r{args.lora_rank}, seq {args.seq_len}+{args.seq_len}, "
        f"GradCache chunk {args.chunk}, {harness.device_name(device)}"
    )
    model = {"size": args.size, "vocab": VOCAB, **SIZES[args.size]}
    setup = {"config": vars(args), "model": model, "device": harness.device_name(device), "capacity_gib": capacity}
    log = harness.SearchLog(args.out, NAME, meta, FIELDS, args.modes, title, summarize, setup)

    with tempfile.TemporaryDirectory(prefix="decoder_lora_") as tmp:
        folder = build_folder(Path(tmp) / f"qwen3-{args.size}", args.size, args.seq_len)
        pairs = write_pairs(Path(tmp) / "pairs.jsonl", args.start_batch)
        print(f"built {folder.name} in {time.monotonic() - start:.1f} s", flush=True)

        def build(mode: str) -> Any:
            trainer = Trainer(parse_args(trainer_args(args, mode, folder, pairs, Path(tmp) / f"run-{mode}", cuda)))
            log.setup.update(describe(trainer))
            return trainer

        harness.search_each_mode(
            log,
            build=build,
            search=lambda mode, trainer, first, deadline: search(args, mode, trainer, first, deadline, log.record),
            start_batch=args.start_batch,
            device=device,
            start=start,
            time_budget=args.time_budget,
        )
    harness.finish_modes(log, summary_lines, start)


if __name__ == "__main__":
    main()
