"""The model and trainer both modes of `benchmarks.qwen_vl_chunks` run: a random-init Qwen2-VL folder
with the emoji captions' words as its tokenizer, and the trainer's overrides for one variant."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def caption_words() -> list[str]:
    """The words of the bundled emoji's names and caption templates (the tokenizer's vocabulary)."""
    from titan_contrastive.datasets.emoji import BUNDLE_FILE, TEMPLATES, load_emoji

    _, names = load_emoji(BUNDLE_FILE)
    words = [w for t in TEMPLATES for w in t.replace("{}", " ").split()]
    return list(dict.fromkeys([*words, *(w for n in names for w in n.split())]))


def build_folder(folder: Path, size: str, seed: int = 0) -> Path:
    """A random-init Qwen2-VL of `size` with the emoji words' tokenizer and the PIL image processor."""
    import torch

    from titan_contrastive.models.qwen_vl.random_folder import write_random_folder

    torch.manual_seed(seed)
    return write_random_folder(folder, "qwen2_vl", size, words=caption_words())


def trainer_args(
    args: argparse.Namespace, folder: Path, dump: Path, *, cuda: bool, chunk_size: int = 0, chunk_tokens: int = 0
) -> list[str]:
    """The overrides of one variant's trainer (chunk_size and chunk_tokens 0: the plain step)."""
    overrides = [
        f"--job.dump_folder={dump}",
        "--model.name=qwen_vl",
        "--model.flavor=default",
        f"--model.path={folder}",
        "--data.dataset=emoji",
        "--data.retrieval_mode=t2i",
        "--data.image_sizes",
        *map(str, args.image_sizes),
        f"--data.max_pixels={max(args.image_sizes) ** 2}",
        f"--data.context_length={args.context_length}",
        f"--training.local_batch_size={args.batch if not args.gpu else max(2, args.start_batch)}",
        "--training.steps=1000000",
        f"--training.device={'cuda' if cuda else 'cpu'}",
        "--training.dtype=float32",
        "--lr_scheduler.warmup_steps=0",
        "--eval.enable=false",
        "--checkpoint.enable=false",
        "--metrics.enable_tensorboard=false",
    ]
    if args.gpu:
        precision = args.precision or ("bfloat16" if cuda else "float32")
        overrides += [
            f"--training.mixed_precision_param={precision}",
            "--lora.enable=true",
            f"--lora.rank={args.lora_rank}",
            f"--lora.alpha={2 * args.lora_rank}",
        ]
    if chunk_size:
        overrides += ["--gradcache.enabled=true", f"--gradcache.chunk_sizes={chunk_size}"]
    elif chunk_tokens:
        overrides += ["--gradcache.enabled=true", f"--gradcache.chunk_tokens={chunk_tokens}"]
    return overrides + list(args.train_arg)


def build_trainer(overrides: list[str]) -> Any:
    from titan_contrastive.config import parse_args
    from titan_contrastive.train import Trainer

    return Trainer(parse_args(overrides))
