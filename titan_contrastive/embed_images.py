"""`python -m titan_contrastive.embed_images --out FILE --job.config_file RUN.toml [--section.key=value ...]`: the
embeddings of a run's images and captions by the run's teacher (`[loss] teacher_model`, or `guide_model`), computed
once, for `[loss] teacher_embeddings` or `guide_embeddings` (`datasets/frozen.py`): an image-text distillation without
the teacher running in every step, as MobileCLIP's reinforced datasets store a teacher's outputs.

The run's config is read as the trainer reads it (its overrides too), and its training data is built as the trainer
builds it, for the run's model family, image size, tokenizer and normalization; the teacher is built as the trainer
builds it and runs in the run's precision; the images are decoded by `data.num_workers` processes. Each training sample
is embedded once at the view evaluation serves (the central crop, or the whole image where the family's processor
squashes it; no flip), not at the random crops training serves: the teacher's target for an image is its embedding of
that one view. With `--views K` it also embeds K train views of each image (view v: the crop, or for the bundled sets
the flip when v is odd, that `datasets.image_keys.view_rng` draws from the image's key and v), and a run reading the
file serves each training sample one of its image's K views with that view's embedding, as MobileCLIP's reinforced
datasets store a few augmentations per image: the student sees exactly what the teacher embedded. Each caption the data
can serve (with its negative captions, and for the bundled sets each template of each class) is embedded once. A bad
sample is skipped, as training skips it.

On vl_pairs rows (the qwen_vl family) the run's Qwen-VL teacher embeds each query and each document an epoch can serve,
every hard negative of every row included, once, each through the run's processor with its side's template (a source's
own, else the model's), as the running teacher reads them; the file's rows are `query` and `document`, keyed by the
filled template with the image's SHA-1 where its visual tokens go (`datasets.vl_items`). Image-text data served
through that processor (csv, webdataset, hf) is embedded sample by sample the same way: its image as the mode's
image side's item, its caption (and i2t's negative captions) as the other side's.

Under `torchrun --nproc_per_node=N -m titan_contrastive.embed_images ...` each rank embeds a contiguous shard of the
samples on its LOCAL_RANK's GPU (or on CPU, the cores split), then the captions its samples serve; rank 0 gathers the
shards in order, in pieces of `PIECE_ROWS` rows per rank through the device, onto its host alone, and writes the rows
one process writes.

FILE (`.parquet`, `.jsonl`, or `.arrow`: mapped by every process of a training machine, one copy of the vectors per
machine, as `embed` writes it) holds one row per image (and per view) and per caption: `side` (`image` or `caption`),
`text` (the image's key, the SHA-1 of its bytes as stored: `datasets.image_keys`, with `#v` for view v; or the caption)
and `embedding` (float32, as the teacher returns it); a .parquet or .arrow file keeps the teacher's logit scale in its
metadata, whose temperature the start log prints. It is written under a temporary name beside it and renamed when
complete, never over an existing file unless `--overwrite`. Then train with `--loss.teacher_embeddings=FILE
--loss.teacher_model=''`. Bad arguments are one `error: ...` line and exit code 2, before any model is loaded."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from titan_contrastive.batching import NEGATIVES
from titan_contrastive.components.precision import at_least_fp32, build_precision
from titan_contrastive.config import ConfigError, JobConfig, parse_args
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.frozen import BUNDLED_PROCESSED, TEACHER_LOGIT_SCALE
from titan_contrastive.datasets.vl_items import FILE_SIDES, ItemChunks
from titan_contrastive.embed import OUT_FORMATS, write
from titan_contrastive.extras import import_failure
from titan_contrastive.mining import MineError
from titan_contrastive.parallelisms import DistInfo, destroy_distributed, init_distributed


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m titan_contrastive.embed_images", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    p.add_argument("--out", type=Path, required=True, help="the file to write: .parquet, .jsonl or .arrow")
    p.add_argument("--batch-size", type=int, default=256, help="samples per forward (default: 256)")
    p.add_argument("--device", default="", help="cpu, cuda, cuda:1 ... (default: cuda if there is one, else cpu)")
    p.add_argument(
        "--views",
        type=int,
        default=0,
        help="also embed K train views of each image, which training then serves (default: 0, the evaluation view "
        "alone)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace --out when it exists")
    return p


def check(opts: argparse.Namespace, cfg: JobConfig) -> tuple[Path, JobConfig]:
    """The output file and the config to build from (without frozen embeddings of its own), or a MineError."""
    if opts.batch_size < 1:
        raise MineError(f"--batch-size={opts.batch_size}: samples per forward, 1 or more")
    if opts.views < 0:
        raise MineError(f"--views={opts.views}: train views per image, 0 (the evaluation view alone) or more")
    out = Path(opts.out).expanduser()
    if out.suffix not in OUT_FORMATS:
        raise MineError(f"--out={out}: write {'/'.join(OUT_FORMATS)} (what loss.teacher_embeddings reads)")
    if out.is_dir() or out.is_symlink():
        raise MineError(f"--out={out} is a folder or a link; give a file name")
    if out.exists() and not opts.overwrite:
        raise MineError(f"--out={out} exists; choose a new file or pass --overwrite")
    loss = cfg.loss
    if not (loss.teacher_model or loss.guide_model):
        raise MineError(
            "loss.teacher_model is empty: embed_images embeds with the run's teacher; set --loss.teacher_model=FOLDER"
        )
    if cfg.data.dataset in ("pairs", "wordnet"):
        raise MineError(
            f"data.dataset={cfg.data.dataset!r}: embed_images embeds image-text data and vl_pairs rows; for text pairs "
            "use python -m titan_contrastive.embed PAIRS --model TEACHER --out FILE"
        )
    distill = loss.distill or ("kl" if loss.teacher_model else "")  # a teacher's config checks out without a term
    loss = dataclasses.replace(loss, teacher_embeddings="", guide_embeddings="", distill=distill)
    training = dataclasses.replace(cfg.training, local_batch_size=1, global_batch_size=-1)  # no batch is drawn
    return out, dataclasses.replace(cfg, loss=loss, training=training)


def build(cfg: JobConfig) -> tuple[Any, Any, Any]:
    """(the family's spec, the training set, the model args sized by the data), built as the trainer builds them."""
    from titan_contrastive import models
    from titan_contrastive.datasets import build_dataset
    from titan_contrastive.datasets.build import build_data

    if cfg.job.custom_import:
        importlib.import_module(cfg.job.custom_import)
    spec = models.get_model_spec(cfg.model.name)
    args, _ = models.resolve_model_args(cfg.model.name, cfg.model.flavor, cfg.model.init_from)
    args = models.configured(args, cfg, spec)
    data = build_data(
        cfg,
        family_tokenizer=lambda: spec.build_tokenizer(args) if spec.build_tokenizer else None,
        prepare=lambda ds: spec.layout.prepare(ds, args, cfg.data.image_sizes, cfg.model.name),
        build_bundled=build_dataset,
        dp_rank=0,
        dp_degree=1,
        pin_memory=False,
    )
    train = data.train_set
    sized = args.update_from_data(
        image_shape=train.image_shape,
        vocab_size=train.tokenizer.vocab_size,
        context_length=data.context_length,
        eos_id=getattr(train.tokenizer, "EOS", 0),
    )
    return spec, train, sized


def on(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """A batch entry (a tensor, or a dict of them: NaFlex patches) on `device`, floating ones in `dtype`."""
    if isinstance(value, dict):
        return {k: on(v, device, dtype) for k, v in value.items()}
    return value.to(device, dtype) if value.is_floating_point() else value.to(device)


class FixedViews(torch.utils.data.Dataset):
    """The training samples `indices` in chunks of `size`, at their fixed view (`fixed_view`: (batch, image keys,
    caption texts)) or at their images' stored view `view` (`view`: (batch, view keys, no texts)), for a loader's
    workers."""

    def __init__(self, train: Any, indices: Sequence[int], size: int, view: int | None = None) -> None:
        self.train, self.indices, self.size, self.view = train, indices, size, view

    def __len__(self) -> int:
        return -(-len(self.indices) // self.size)

    def __getitem__(self, chunk: int) -> tuple[dict[str, Any], list[str], list[str]]:
        indices = self.indices[chunk * self.size : (chunk + 1) * self.size]
        if self.view is None:
            return self.train.fixed_view(indices)
        return (*self.train.view(indices, self.view), [])


PIECE_ROWS = 1 << 16
"""Rows each rank sends rank 0 per gather: a device holds at most (world size x this) rows of the gathered table."""


def gather_to_first(local: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
    """Row shards of different lengths (`counts[r]` rows on rank r) joined in rank order on rank 0 alone, on the host,
    sent in pieces of at most `PIECE_ROWS` rows per rank; None on the other ranks."""
    if len(counts) == 1:
        return local.cpu()
    piece = PIECE_ROWS
    first = dist.get_rank() == 0
    pieces: list[list[torch.Tensor]] = [[] for _ in counts]
    for start in range(0, max(counts), piece):
        rows = local[start : start + piece]
        padded = local.new_zeros((min(piece, max(counts) - start), *local.shape[1:]))
        padded[: len(rows)] = rows
        parts = [torch.empty_like(padded) for _ in counts] if first else None
        dist.gather(padded, parts, dst=0)
        for r, part in enumerate(parts or ()):
            pieces[r].append(part[: max(0, min(counts[r] - start, len(padded)))].cpu())
    return torch.cat([row for rank in pieces for row in rank]) if first else None


def gather_lists(items: list[Any], world_size: int) -> list[Any] | None:
    """Every rank's `items`, joined in rank order, on rank 0; None on the other ranks."""
    if world_size == 1:
        return items
    parts: list[Any] = [None] * world_size if dist.get_rank() == 0 else None
    dist.gather_object(items, parts, dst=0)
    return None if parts is None else [item for part in parts for item in part]


@torch.no_grad()
def embed(
    spec: Any,
    train: Any,
    teacher: torch.nn.Module,
    batch_size: int,
    device: torch.device,
    workers: int = 0,
    *,
    rank: int = 0,
    world: int = 1,
    views: int = 0,
) -> list[tuple] | None:
    """(side, keys or captions, embeddings [n, d]) of every image of `train` at its fixed view (`fixed_view`) and at
    each of `views` stored views (`view`), and of every caption, on rank 0 (None on the others): rank r embeds the
    r-th contiguous shard of the samples (their images decoded by `workers` processes) and the captions they serve,
    and rank 0 gathers the shards in order and keeps each key's first row, so the rows are those of one process."""
    image_key, text_key = spec.input_keys
    dtype = next(teacher.parameters()).dtype
    shards = np.array_split(np.arange(len(train)), world)
    mine = shards[rank].tolist()

    def images_at(view: int | None) -> tuple[tuple[list[str], np.ndarray] | None, torch.Tensor, list[str]]:
        """Every sample's image key and its image's embedding at `view`, on rank 0; no row of such embeddings (their
        width and dtype); the captions this rank's samples serve."""
        chunks = FixedViews(train, mine or [0], batch_size, view)  # an empty shard embeds one sample, for the shapes
        keys, texts, rows = [], [], []
        for batch, chunk_keys, chunk_texts in torch.utils.data.DataLoader(chunks, batch_size=None, num_workers=workers):
            images, tokens = on(batch[image_key], device, dtype), on(batch[text_key], device, dtype)
            rows.append(at_least_fp32(teacher(images, tokens)[0]))
            keys += chunk_keys
            texts += chunk_texts
        vectors = torch.cat(rows)
        return gather_rows(keys[: len(mine)], vectors[: len(mine)], world), vectors[:0], texts if mine else []

    images, none, texts = images_at(None)
    for view in range(views):
        more = images_at(view)[0]
        images = None if images is None else (images[0] + more[0], np.concatenate([images[1], more[1]]))
    picture = on(train.fixed_view([0])[0][image_key], device, dtype)  # one image beside each chunk of captions
    captions = list(dict.fromkeys(texts))  # this rank's, in order: rank 0 keeps each one's first row of all
    rows = [
        at_least_fp32(teacher(picture, on(train.encode_text(captions[i : i + batch_size]), device, dtype))[1])
        for i in range(0, len(captions), batch_size)
    ]
    captioned = gather_rows(captions, torch.cat(rows) if rows else none, world)
    return None if images is None else [("image", *images), ("caption", *captioned)]


def gather_rows(keys: list[str], vectors: torch.Tensor, world_size: int) -> tuple[list[str], np.ndarray] | None:
    """Every rank's (keys, vectors) on rank 0, in rank order, each key's first row kept; None on the other ranks."""
    counts = [len(keys)]
    if world_size > 1:
        counts = [0] * world_size
        dist.all_gather_object(counts, len(keys))
    keys, vectors = gather_lists(keys, world_size), gather_to_first(vectors, counts)
    return None if keys is None else first_rows(keys, vectors.numpy())


def side_rows(
    keys: list[str], rows: list[torch.Tensor], dtype: torch.dtype, device: torch.device, world: int
) -> tuple[list[str], np.ndarray] | None:
    """This rank's `keys` and their embeddings `rows` (chunks) of one side, on rank 0 with every rank's, in rank order,
    each key's first row kept (`gather_rows`); None on the other ranks."""
    widths = [rows[0].shape[1] if rows else 0]
    if world > 1:  # a rank whose items are all bad, or none, sends no rows of the others' width
        widths = [0] * world
        dist.all_gather_object(widths, rows[0].shape[1] if rows else 0)
    kind = torch.promote_types(dtype, torch.float32)
    local = torch.cat(rows) if rows else torch.zeros(0, max(widths), dtype=kind, device=device)
    return gather_rows(keys, local, world)


@torch.no_grad()
def embed_items(
    train: Any, teacher: Any, batch_size: int, device: torch.device, workers: int = 0, *, rank: int = 0, world: int = 1
) -> list[tuple] | None:
    """(side, keys, embeddings [n, d]) of every query and document of vl_pairs rows (`VLPairsDataset.frozen_items`,
    keyed as `datasets.vl_items` says) by the run's qwen_vl teacher (`QwenVLEmbedder.embed`), on rank 0 (None on the
    others): rank r embeds the r-th contiguous shard of each side's items (their images decoded by `workers`
    processes), and rank 0 gathers the shards in order and keeps each key's first row."""
    dtype = next(teacher.parameters()).dtype
    out, found = [], train.frozen_items()
    for own, side in FILE_SIDES.items():
        mine = [found[side][i] for i in np.array_split(np.arange(len(found[side])), world)[rank]]
        keys, rows = [], []
        chunks = ItemChunks(train, side, mine, batch_size)
        for inputs, chunk_keys in torch.utils.data.DataLoader(chunks, batch_size=None, num_workers=workers):
            if chunk_keys:
                rows.append(at_least_fp32(teacher.embed(**on(inputs, device, dtype), side=own)))
                keys += chunk_keys
        out.append((side, side_rows(keys, rows, dtype, device, world)))
    return None if rank else [(side, *rows) for side, rows in out]


@torch.no_grad()
def embed_samples(
    train: Any, teacher: Any, batch_size: int, device: torch.device, workers: int = 0, *, rank: int = 0, world: int = 1
) -> list[tuple] | None:
    """(side, keys, embeddings [n, d]) of every sample's query and document (and negative captions) of image-text
    data served through the qwen_vl processor (`fixed_view`'s batches, keyed by `item_keys`) by the run's teacher, on
    rank 0 (None on the others): rank r embeds the r-th contiguous shard of the samples, and rank 0 gathers the
    shards in order and keeps each key's first row."""
    dtype = next(teacher.parameters()).dtype
    mine = np.array_split(np.arange(len(train)), world)[rank].tolist()
    k = train.num_negatives
    keys: dict[str, list[str]] = {"query": [], "document": []}
    rows: dict[str, list[torch.Tensor]] = {"query": [], "document": []}
    chunks = FixedViews(train, mine, batch_size)
    for batch, images, texts in torch.utils.data.DataLoader(chunks, batch_size=None, num_workers=workers):
        for i, image in enumerate(images):
            query, doc, negatives = train.item_keys(
                image, texts[i * (1 + k)], texts[i * (1 + k) + 1 : (i + 1) * (1 + k)]
            )
            keys["query"].append(query)
            keys["document"] += [doc, *negatives]
        batch = {name: on(value, device, dtype) for name, value in batch.items() if isinstance(value, torch.Tensor)}
        for own, side in FILE_SIDES.items():
            grid = batch[f"{own}_image_grid_thw"]
            pixels = (batch[f"{own}_pixel_values"], grid) if len(grid) else (None, None)
            embedded = at_least_fp32(teacher.embed(batch[own], *pixels, side=own))
            if side == "document" and k:  # each sample's document, then its negative captions' (text documents)
                negatives = at_least_fp32(teacher.embed(batch[NEGATIVES].flatten(0, 1), side=own))
                embedded = torch.cat([embedded[:, None], negatives.view(len(embedded), k, -1)], 1).flatten(0, 1)
            rows[side].append(embedded)
    out = [(side, side_rows(keys[side], rows[side], dtype, device, world)) for side in FILE_SIDES.values()]
    return None if rank else [(side, *rows) for side, rows in out]


def first_rows(keys: list[str], vectors: np.ndarray) -> tuple[list[str], np.ndarray]:
    """Each distinct key (the first sample of each image) and its row of `vectors`."""
    first: dict[str, int] = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    return list(first), vectors[list(first.values())]


def join(device: str) -> DistInfo:
    """This process's rank and device: under torchrun, the job's process group (gloo on CPU, NCCL on CUDA) and the
    LOCAL_RANK's GPU; alone, `device` (default: cuda if there is one, else cpu)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return DistInfo(0, 1, 0, torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")))
    if device not in ("", "cpu", "cuda"):
        raise MineError(
            f"--device={device}: under torchrun each rank embeds on its LOCAL_RANK's GPU; give cpu or cuda, or leave "
            "it out"
        )
    return init_distributed(device or "auto")


def run(opts: argparse.Namespace, overrides: list[str]) -> tuple[Path, str]:
    """Embed and write; (the file, what it holds)."""
    from titan_contrastive.models.build import build_guide

    out, cfg = check(opts, parse_args(overrides))
    info = join(opts.device)
    precision = build_precision(cfg.training, fsdp=False, device=info.device)
    spec, train, sized = build(cfg)
    rows = hasattr(train, "frozen_items")  # vl_pairs: each side's items
    if not (rows or hasattr(train, "fixed_view")):
        raise MineError(f"data.dataset={cfg.data.dataset!r}: not image-text data embed_images can read")
    processed = train.processed
    if processed and not (rows or hasattr(train, "item_keys")):
        raise MineError(BUNDLED_PROCESSED)
    if processed and opts.views:
        raise MineError(
            f"--views={opts.views}: images served through a model's processor are read as they are, one view; leave "
            "--views out"
        )
    if opts.views:
        train.view([0], 0)  # a DataError where the train split serves no views
    teacher = build_guide(spec, cfg, sized, precision.param_dtype, info.device)  # in eval mode
    where = dict(rank=info.rank, world=info.world_size)
    with precision.autocast():  # the run's mixed precision, as its running teacher computes
        if processed:
            items = embed_items if rows else embed_samples
            sides = items(train, teacher, opts.batch_size, info.device, cfg.data.num_workers, **where)
        else:
            sides = embed(
                spec, train, teacher, opts.batch_size, info.device, cfg.data.num_workers, **where, views=opts.views
            )
    own = spec.guide_temperature  # a CLIP's or SigLIP's trained scale, which distill_temperature = 0 reads
    if sides is None:  # another rank's: rank 0 writes
        return out, ""
    write(out, sides, {TEACHER_LOGIT_SCALE: repr(teacher.logit_scale.item())} if own else None)
    width = f"{sides[0][2].shape[1]}-wide embeddings of"
    if processed:
        return out, f"{width} {len(sides[0][1])} queries and {len(sides[1][1])} documents"
    views = f" (and {opts.views} train views of each)" if opts.views else ""
    return out, f"{width} {len(sides[0][1]) // (1 + opts.views)} image(s){views} and {len(sides[1][1])} caption(s)"


def main(argv: list[str] | None = None) -> int:
    opts, overrides = parser().parse_known_args(argv)
    try:
        out, held = run(opts, overrides)
    except ImportError as e:
        print(f"error: {import_failure(e, 'embedding images', 'data')}", file=sys.stderr)
        return 2
    except (OSError, ValueError, ConfigError, DataError) as e:  # MineError, DataError, the config's own checks
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    destroy_distributed(barrier=True)  # every rank waits for rank 0's file
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"wrote {out}: {held}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
