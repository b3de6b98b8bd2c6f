"""Evaluation: zero-shot classification (class captions as the classifier) or retrieval recall.

Order of operations in `evaluate`:
1. each DP rank embeds its contiguous shard of the eval set (no grad, model in eval mode);
2. the embeddings are all-gathered, so every rank holds all rows in dataset order;
3. the eval loss is the mean of the *unscaled* loss over consecutive batches of
   `batch_size` (independent of the number of ranks and of gradient accumulation);
4. zero-shot top-1 (datasets with class names) or image->text recall@1/@5 (others).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn


def _gather_rows(local: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """All-gather row shards of different lengths (`counts[r]` rows on rank r), in rank order."""
    if len(counts) == 1:
        return local
    padded = local.new_zeros((max(counts), *local.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded)
    return torch.cat([p[:n] for p, n in zip(parts, counts)])


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Metrics in float32 for bf16/fp16 models, but float64 models keep float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


@torch.no_grad()
def embed_dataset(model: nn.Module, dataset: Any, *, batch_size: int, device: torch.device,
                  rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Image and caption embeddings and labels of the whole dataset, on every rank."""
    if len(dataset) < world_size:
        raise ValueError(f"eval set has {len(dataset)} samples, fewer than the {world_size} data-parallel ranks")
    shards = np.array_split(np.arange(len(dataset)), world_size)
    img, txt, labels = [], [], []
    for start in range(0, len(shards[rank]), batch_size):
        batch = dataset.__getitems__(shards[rank][start : start + batch_size].tolist())
        images = batch["image"].to(device, model.logit_scale.dtype)
        image_emb, text_emb = model(images, batch["text"].to(device))
        img.append(_at_least_fp32(image_emb))
        txt.append(_at_least_fp32(text_emb))
        labels.append(batch["label"].to(device))
    counts = [len(s) for s in shards]
    local = (torch.cat(img), torch.cat(txt), torch.cat(labels))
    return tuple(_gather_rows(t, counts) for t in local)  # type: ignore[return-value]


@torch.no_grad()
def zero_shot_classifier(model: nn.Module, dataset: Any, device: torch.device) -> torch.Tensor:
    """[num_classes, dim]: the normalised mean embedding of each class over all templates."""
    rows = []
    for name in dataset.class_names:
        emb = _at_least_fp32(model.encode_text(dataset.encode_text([t.format(name) for t in dataset.templates]).to(device)))
        rows.append(nn.functional.normalize(emb.mean(0), dim=-1))
    return torch.stack(rows)


def recall_at_k(image_emb: torch.Tensor, text_emb: torch.Tensor, ks: tuple[int, ...] = (1, 5)) -> dict[str, float]:
    """Image->text recall@k where caption i belongs to image i."""
    sims = image_emb @ text_emb.T
    correct = sims.diagonal().unsqueeze(1)
    rank = (sims > correct).sum(1)  # number of captions scored above the right one
    return {f"image_to_text_r@{k}": (rank < k).float().mean().item() for k in ks}


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Any, loss_fn: Callable[..., torch.Tensor], *, batch_size: int,
             device: torch.device, rank: int = 0, world_size: int = 1) -> dict[str, float]:
    """Eval loss plus zero-shot accuracy or retrieval recall; `loss_fn` must be unscaled."""
    was_training = model.training
    model.eval()
    try:
        img, txt, labels = embed_dataset(model, dataset, batch_size=batch_size, device=device, rank=rank, world_size=world_size)
        scale = _at_least_fp32(model.logit_scale.exp())
        losses = [loss_fn(img[i : i + batch_size], txt[i : i + batch_size], scale) for i in range(0, len(img), batch_size)]
        out = {"loss": torch.stack(losses).mean().item(), "num_samples": float(len(img))}
        if dataset.class_names:
            pred = (img @ zero_shot_classifier(model, dataset, device).T).argmax(1)
            out["zero_shot_top1"] = (pred == labels).float().mean().item()
        else:
            out.update(recall_at_k(img, txt))
        return out
    finally:
        model.train(was_training)
