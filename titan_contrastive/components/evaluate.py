"""Evaluation: zero-shot classification (class captions as the classifier) or retrieval recall.

A family names its evaluation in its spec (`ModelSpec.evaluate`): `evaluate_contrastive`
(default) or `evaluate_reconstructions` (vae), each taking one `EvalContext`.

Order of operations in `evaluate`:
1. each DP rank embeds its contiguous shard of the eval set (no grad, model in eval mode);
2. the embeddings are all-gathered, so every rank holds all rows in dataset order;
3. the eval loss is the mean of the *unscaled* loss over consecutive batches of
   `batch_size` (independent of the number of ranks and of gradient accumulation);
4. zero-shot top-1 (datasets with class names) or recall@k both ways, image->text and text->image (others).

`evaluate_reconstruction` (vae family): masked MSE and PSNR of the reconstructions in [0, 1],
summed exactly over ranks (numerator and denominator), and a PNG grid of originals over
reconstructions.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from titan_contrastive.atomic_write import write_atomically
from titan_contrastive.components.pixel_loss import masked_error_sum
from titan_contrastive.components.precision import at_least_fp32
from titan_contrastive.config import ConfigError
from titan_contrastive.datasets.bad_samples import BAD_SAMPLES
from titan_contrastive.datasets.protocol import Dataset, ZeroShotDataset
from titan_contrastive.losses import MicrobatchLoss, Objective, matryoshka

logger = logging.getLogger("titan_contrastive")


def gather_rows(local: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """All-gather row shards of different lengths (`counts[r]` rows on rank r), in rank order."""
    if len(counts) == 1:
        return local
    padded = local.new_zeros((max(counts), *local.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded)
    return torch.cat([p[:n] for p, n in zip(parts, counts)])


Forward = Callable[..., Any]  # (batch, **model kwargs) -> the model's outputs, with the run's dtype and autocast


@dataclass(frozen=True)
class EvalContext:
    """What an evaluation gets from the run (built by the trainer at each evaluation)."""

    model: nn.Module
    """Switched to eval mode for the evaluation, and back."""
    forward: Forward
    dataset: Dataset
    """The held-out split; every rank evaluates a contiguous shard of it."""
    objective: Objective | None
    """The run's objective (None: a family with its own loss)."""
    batch_size: int
    device: torch.device
    rank: int
    world_size: int
    dump_folder: Path
    step: int
    dims: tuple[int, ...] = ()
    """Also the retrieval recall of the embeddings cut to their first m dims (`eval.dims`)."""
    layers: tuple[int, ...] = ()
    """Also the retrieval recall at each of the model's earlier exits (`loss.adaptive_layers`)."""


def _shards(dataset: Dataset, world_size: int) -> list[np.ndarray]:
    """Contiguous index shards, one per DP rank."""
    if len(dataset) < world_size:
        raise ValueError(f"eval set has {len(dataset)} samples, fewer than the {world_size} data-parallel ranks")
    return np.array_split(np.arange(len(dataset)), world_size)


def _rank_batches(
    dataset: Dataset, batch_size: int, rank: int, world_size: int
) -> Iterator[tuple[list[int], dict[str, torch.Tensor]]]:
    """(indices, batch) over this rank's shard. Every rank gets the same number of batches (FSDP2
    all-gathers parameters inside each forward call, a collective): a rank whose shard is used up
    gets ([], a batch of one sample again) to run and drop."""
    shards = _shards(dataset, world_size)
    mine = shards[rank]
    for start in range(0, max(len(s) for s in shards), batch_size):
        indices = mine[start : start + batch_size].tolist()
        batch = dataset.__getitems__(indices or [int(mine[0])])
        for skip in batch.pop(BAD_SAMPLES, None) or []:  # the dataset filled the slot with the next good sample
            logger.warning(f"eval: skipped bad sample: {skip}")
        yield indices, batch


@contextlib.contextmanager
def eval_mode(model: nn.Module, exits: bool = False) -> Iterator[None]:
    """The model in eval mode for the block, then back to what it was; `exits`: embedding at its earlier exits too,
    side by side after the last layer's (a model with `exits_in_eval`, the bi_encoder with `loss.adaptive_layers`)."""
    was_training, inner = model.training, getattr(model, "module", model)  # DDP's wrapped model
    model.eval()
    if exits:
        inner.exits_in_eval = True
    try:
        yield
    finally:
        model.train(was_training)
        if exits:
            inner.exits_in_eval = False


@torch.no_grad()
def embed_dataset(
    forward: Forward, dataset: Dataset, *, batch_size: int, device: torch.device, rank: int, world_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """Both towers' embeddings (image/caption, query/document) and labels (or sample indices),
    all rows on every rank, and the loss's scalars the model returns after them (exp(logit_scale)
    and, for the sigmoid loss, logit_bias)."""
    img, txt, labels = [], [], []
    scalars: tuple[torch.Tensor, ...] = ()
    for indices, batch in _rank_batches(dataset, batch_size, rank, world_size):
        image_emb, text_emb, *rest = forward(batch)
        scalars = tuple(at_least_fp32(x) for x in rest)
        if indices:
            img.append(at_least_fp32(image_emb))
            txt.append(at_least_fp32(text_emb))
            labels.append(batch.get("label", batch["index"]).to(device))
    local = (torch.cat(img), torch.cat(txt), torch.cat(labels))
    counts = [len(s) for s in _shards(dataset, world_size)]
    return (*(gather_rows(t, counts) for t in local), scalars)  # type: ignore[return-value]


@torch.no_grad()
def zero_shot_classifier(forward: Forward, dataset: ZeroShotDataset) -> torch.Tensor:
    """[num_classes, dim]: the normalised mean embedding of each class over all templates.

    The captions go through the model's full forward (with the first image as a placeholder, in
    whatever form the dataset serves images) rather than a text-tower call: under FSDP2 only the
    root forward unshards the root's parameters.
    """
    captions = [t.format(name) for name in dataset.class_names for t in dataset.templates]
    batch = dataset.__getitems__([0] * len(captions))
    batch["text"] = dataset.encode_text(captions)
    emb = forward(batch)[1]
    per_class = at_least_fp32(emb).view(len(dataset.class_names), len(dataset.templates), -1).mean(1)
    return nn.functional.normalize(per_class, dim=-1)


def dim_cuts(width: int, dims: Sequence[int]) -> list[tuple[int, str]]:
    """(dims, key prefix) of each evaluation of embeddings `width` wide: the whole ("") and each smaller m of
    `dims` (`[eval] dims`: a Matryoshka model's first m dims, "dim{m}/"), widest first; a ValueError for an m wider
    than the embeddings."""
    if any(m > width for m in dims):
        raise ValueError(f"eval.dims={list(dims)}: the embeddings have {width} dimensions; use dims <= {width}")
    return [(width, ""), *((m, f"dim{m}/") for m in sorted(set(dims) - {width}, reverse=True))]


@torch.no_grad()
def check_embedding_dims(
    model: nn.Module, forward: Forward, dataset: Dataset, dims: dict[str, list[int]], objective: Objective | None = None
) -> None:
    """A ConfigError before training when a setting (`dims`: {"eval.dims": [...], ...}) asks for more
    dims than the embeddings have, found by the forward of one sample in eval mode (than each token has, where the
    run's `objective` scores token sets: its `token_dim`)."""
    if not any(dims.values()):
        return
    token_dim = getattr(objective, "token_dim", 0)
    if token_dim:
        what, width = "tokens", token_dim
    else:
        with eval_mode(model):
            what, width = "embeddings", forward(dataset.__getitems__([0]))[0].shape[-1]
    for key, values in dims.items():
        if values and max(values) > width:
            raise ConfigError(f"{key}={list(values)}: the {what} have {width} dimensions; use dims <= {width}")


Similarity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(first tower's embeddings [n, .], second's [m, .]) -> their scores [n, m]; the dot product unless an objective
scores otherwise (late interaction's `similarity`)."""


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b.T


def recall_at_k(sims: torch.Tensor, ks: tuple[int, ...] = (1, 5), direction: str = "image_to_text") -> dict[str, float]:
    """Recall@k of the rows against the columns of `sims` [n, n], where row i belongs to column i (caption i to
    image i, lemma i to definition i)."""
    correct = sims.diagonal().unsqueeze(1)
    rank = (sims > correct).sum(1)  # number of candidates scored above the right one
    return {f"{direction}_r@{k}": (rank < k).float().mean().item() for k in ks}


@torch.no_grad()
def evaluate(
    model: nn.Module,
    forward: Forward,
    dataset: Dataset,
    loss_fn: Callable[..., torch.Tensor],
    *,
    batch_size: int,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
    dims: tuple[int, ...] = (),
    similarity: Similarity = dot,
    token_dim: int = 0,
    similarity_at: Callable[[int], Similarity] | None = None,
    layers: tuple[int, ...] = (),
) -> dict[str, float]:
    """Eval loss plus zero-shot accuracy or retrieval recall; `loss_fn` must be unscaled.

    `forward(batch) -> (first tower's emb, second tower's emb, exp(logit_scale)[, logit_bias])` runs
    `model` with the trainer's dtype and autocast; `model` is only switched to eval mode and back.
    `dims`: retrieval recall also with the embeddings cut to their first m dims and re-normalized
    (a Matryoshka model's smaller embeddings), under the keys `dim{m}/...`. `similarity`: how a query and a
    document are scored, both ways (the documents' recall reads the same scores, by column); for token sets
    (`token_dim`) a cut is each token's, scored by `similarity_at(m)`. `layers`: the model's earlier exits
    (`loss.adaptive_layers`), whose recall is reported under `layer{k}/...`; everything else reads the last layer's.
    """
    with eval_mode(model, exits=bool(layers)):
        img, txt, labels, scalars = embed_dataset(
            forward, dataset, batch_size=batch_size, device=device, rank=rank, world_size=world_size
        )
        exits = {}
        if layers:
            width = img.shape[-1] // (1 + len(layers))
            (img, *earlier_img), (txt, *earlier_txt) = img.split(width, -1), txt.split(width, -1)
            exits = dict(zip(layers, zip(earlier_img, earlier_txt)))
        losses = [
            loss_fn(img[i : i + batch_size], txt[i : i + batch_size], *scalars) for i in range(0, len(img), batch_size)
        ]
        out = {"loss": torch.stack(losses).mean().item(), "num_samples": float(len(img))}
        if dataset.class_names:
            pred = similarity(img, zero_shot_classifier(forward, dataset)).argmax(1)
            out["zero_shot_top1"] = (pred == labels).float().mean().item()
        else:  # both ways: image->text and text->image (query->doc and doc->query)
            backward = "_to_".join(reversed(dataset.recall_direction.split("_to_")))
            sims = similarity(img, txt)
            out.update(recall_at_k(sims, dataset.recall_ks, dataset.recall_direction))
            out.update(recall_at_k(sims.T, dataset.recall_ks, backward))
            for m, cut in dim_cuts(token_dim or img.shape[-1], dims)[1:]:
                score = similarity_at(m) if token_dim and similarity_at else dot
                sims = score(*(matryoshka.prefix(x, m, token_dim) for x in (img, txt)))
                out.update(
                    {f"{cut}{k}": v for k, v in recall_at_k(sims, dataset.recall_ks, dataset.recall_direction).items()}
                )
                out.update({f"{cut}{k}": v for k, v in recall_at_k(sims.T, dataset.recall_ks, backward).items()})
            for layer, (a, b) in exits.items():
                sims = similarity(a, b)
                for ranked, way in ((sims, dataset.recall_direction), (sims.T, backward)):
                    out.update({f"layer{layer}/{k}": v for k, v in recall_at_k(ranked, dataset.recall_ks, way).items()})
        return out


def evaluate_contrastive(ctx: EvalContext) -> dict[str, float]:
    """`evaluate` with the family's loss, unscaled (never divided by the accumulation steps)."""
    token_dim = getattr(ctx.objective, "token_dim", 0)
    return evaluate(
        ctx.model,
        ctx.forward,
        ctx.dataset,
        MicrobatchLoss(ctx.objective),
        batch_size=ctx.batch_size,
        device=ctx.device,
        rank=ctx.rank,
        world_size=ctx.world_size,
        dims=ctx.dims,
        similarity=getattr(ctx.objective, "similarity", dot),
        token_dim=token_dim,
        similarity_at=(lambda m: matryoshka.at_width(ctx.objective, m).similarity) if token_dim else None,  # type: ignore[attr-defined]
        layers=ctx.layers,
    )


@torch.profiler.record_function("evaluate_sets")  # a named span in [profiling] traces
def evaluate_sets(
    evaluate_fn: Callable[[EvalContext], dict[str, float]],
    context: Callable[[Dataset], EvalContext],
    sets: dict[str, Dataset | None],
) -> dict[str, float]:
    """The family's evaluation of each held-out set, its keys prefixed with the set's key in `sets`
    (the run's test split: "", the zero-shot folder: "zero_shot/")."""
    results: dict[str, float] = {}
    for prefix, dataset in sets.items():
        if dataset is not None:
            results.update({prefix + k: v for k, v in evaluate_fn(context(dataset)).items()})
    return results


def describe_results(results: dict[str, float], sets: dict[str, Dataset | None]) -> str:
    """'on 200 emoji test samples and ...: loss 1.2345  ...' for the log."""
    where = " and ".join(
        f"{int(results[p + 'num_samples'])} {ds.name} test samples" for p, ds in sets.items() if ds is not None
    )
    return f"on {where or 'the BEIR folder'}: " + "  ".join(
        f"{k} {v:.4f}" for k, v in results.items() if not k.endswith("num_samples")
    )


def _save_grid(originals: torch.Tensor, recons: torch.Tensor, masks: torch.Tensor, path: Path, scale: int = 4) -> None:
    """Originals (top row) over reconstructions (bottom row), padding shown black, as a PNG."""
    from PIL import Image

    def row(x: torch.Tensor) -> torch.Tensor:  # [N, C, H, W] in [-1, 1] -> [C, H, N*(W+2)]
        x = ((x.float() * 0.5 + 0.5).clamp(0, 1) * masks.float()).cpu()
        return torch.cat([torch.nn.functional.pad(img, (1, 1)) for img in x], dim=2)

    top = row(originals)
    grid = torch.cat([top, torch.zeros(originals.shape[1], 2, top.shape[2]), row(recons)], dim=1)
    pixels = (grid * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    image = Image.fromarray(pixels[..., 0] if pixels.shape[2] == 1 else pixels)
    write_atomically(path, image.resize((image.width * scale, image.height * scale), Image.NEAREST).save)


@torch.no_grad()
def evaluate_reconstruction(
    model: nn.Module,
    reconstruct: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    dataset: Dataset,
    *,
    batch_size: int,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
    grid_path: Path | None = None,
    grid_images: int = 12,
) -> dict[str, float]:
    """Masked MSE / PSNR of `reconstruct(batch) -> images` over the dataset (numerator and
    denominator summed over ranks); rank 0 writes the grid of its first images."""
    with eval_mode(model):
        sums = torch.zeros(2, dtype=torch.float64, device=device)  # squared error, scored values
        for i, (indices, batch) in enumerate(_rank_batches(dataset, batch_size, rank, world_size)):
            recon = reconstruct(batch)
            if not indices:
                continue
            image, mask = batch["image"].to(device, torch.float64), batch["mask"].to(device, torch.float64)
            sums += torch.stack([masked_error_sum(recon.double(), image, mask, "l2"), mask.sum() * image.shape[1]])
            if rank == 0 and i == 0 and grid_path is not None:
                n = min(grid_images, len(indices))
                _save_grid(batch["image"][:n], recon[:n], batch["mask"][:n], grid_path)
        if world_size > 1:
            dist.all_reduce(sums)
        mse = (sums[0] / sums[1]).item()
        return {
            "loss": mse,
            "num_samples": float(len(dataset)),
            "psnr_db": 10 * math.log10(1 / mse) if mse > 0 else math.inf,
        }


def evaluate_reconstructions(ctx: EvalContext) -> dict[str, float]:
    """`evaluate_reconstruction` through `forward(batch, reconstruct=True)`; the grid goes to
    `{dump_folder}/reconstructions_step{step}.png`."""
    return evaluate_reconstruction(
        ctx.model,
        functools.partial(ctx.forward, reconstruct=True),
        ctx.dataset,
        batch_size=ctx.batch_size,
        device=ctx.device,
        rank=ctx.rank,
        world_size=ctx.world_size,
        grid_path=ctx.dump_folder / f"reconstructions_step{ctx.step}.png",
    )
