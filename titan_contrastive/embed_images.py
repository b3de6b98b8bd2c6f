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

Under `torchrun --nproc_per_node=N -m titan_contrastive.embed_images ...` rank r embeds chunks r, r + N, r + 2N, ...
of `--batch-size` samples (or items) on its LOCAL_RANK's GPU (or on CPU, the cores split), with the captions each chunk
serves; after each chunk rank 0 gathers every rank's rows through the device and appends them to files on its disk
beside FILE (`row_spool`), so no process holds the vectors, and it writes the rows one process writes, in its order.

FILE (`.parquet`, `.jsonl`, or `.arrow`: mapped by every process of a training machine, one copy of the vectors per
machine, as `embed` writes it) holds one row per image (and per view) and per caption: `side` (`image` or `caption`),
`text` (the image's key, the SHA-1 of its bytes as stored: `datasets.image_keys`, with `#v` for view v; or the caption)
and `embedding` (float32, as the teacher returns it); a .parquet or .arrow file keeps the teacher's logit scale in its
metadata, whose temperature the start log prints. It is written under a temporary name beside it and renamed when
complete, never over an existing file unless `--overwrite`; a .parquet or .arrow file with its index beside it
(FILE.index, as `embed` writes it). Then train with `--loss.teacher_embeddings=FILE
--loss.teacher_model=''`. Bad arguments are one `error: ...` line and exit code 2, before any model is loaded."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from titan_contrastive.batching import NEGATIVES
from titan_contrastive.components.precision import at_least_fp32, build_precision
from titan_contrastive.config import ConfigError, JobConfig, parse_args
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.frozen import BUNDLED_PROCESSED, TEACHER_LOGIT_SCALE
from titan_contrastive.datasets.loader import return_freed_blocks, started
from titan_contrastive.datasets.vl_items import FILE_SIDES, ItemChunks
from titan_contrastive.embed import OUT_FORMATS, write_rows
from titan_contrastive.extras import import_failure
from titan_contrastive.mining import MineError
from titan_contrastive.parallelisms import DistInfo, destroy_distributed, host_group, init_distributed
from titan_contrastive.row_spool import RowSpool, shard


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
    from titan_contrastive.datasets.build import TEXT_PAIRS

    if cfg.data.dataset in TEXT_PAIRS:
        raise MineError(
            f"data.dataset={cfg.data.dataset!r}: embed_images embeds image-text data and vl_pairs rows; for text pairs "
            "use python -m titan_contrastive.embed PAIRS --model TEACHER --out FILE"
        )
    distill = loss.distill or ("kl" if loss.teacher_model else "")  # a teacher's config checks out without a term
    loss = dataclasses.replace(loss, teacher_embeddings="", guide_embeddings="", distill=distill)
    training = dataclasses.replace(cfg.training, local_batch_size=1, global_batch_size=-1)  # no batch is drawn
    return out, dataclasses.replace(cfg, loss=loss, training=training)


def build(cfg: JobConfig) -> tuple[Any, Any, Any]:
    """(the family's spec, the training set, the model args sized by the data), built as the trainer builds them: under
    torchrun every rank builds it, sharing the writing of images held in cells and the tokenization
    (`build_data`'s `host_group`)."""
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
        host_group=host_group,
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
    """The training samples `indices` in chunks of `size`, each chunk at its fixed view and at its images' first `views`
    stored views: [(batch, image keys, caption texts) (`fixed_view`), then (batch, view keys, no texts) (`view`) for
    each view], for a loader's workers."""

    def __init__(self, train: Any, indices: Sequence[int], size: int, views: int = 0) -> None:
        self.train, self.indices, self.size, self.views = train, indices, size, views

    def __len__(self) -> int:
        return -(-len(self.indices) // self.size)

    def __getitem__(self, chunk: int) -> list[tuple[dict[str, Any], list[str], list[str]]]:
        indices = self.indices[chunk * self.size : (chunk + 1) * self.size]
        return [self.train.fixed_view(indices)] + [(*self.train.view(indices, v), []) for v in range(self.views)]


def rounds_of(chunks: torch.utils.data.Dataset, rounds: int, workers: int) -> Iterator[Any]:
    """`chunks` decoded by `workers` processes, then None until `rounds` items have been given."""
    loader = started(
        torch.utils.data.DataLoader(chunks, batch_size=None, num_workers=workers, worker_init_fn=return_freed_blocks)
    )
    for _ in range(rounds):
        yield next(loader, None)


def blocks_of(processed: bool, views: int) -> list[str]:
    """The side of each block of the file's rows, in order: the queries and the documents of data served through the
    qwen_vl processor; else the images at their fixed view, at each stored view, and the captions."""
    return list(FILE_SIDES.values()) if processed else ["image"] * (1 + views) + ["caption"]


@torch.no_grad()
def embed(
    spec: Any,
    train: Any,
    teacher: torch.nn.Module,
    batch_size: int,
    device: torch.device,
    spool: RowSpool,
    workers: int = 0,
    *,
    rank: int = 0,
    world: int = 1,
    views: int = 0,
) -> None:
    """Every image of `train` at its fixed view (`fixed_view`) and at each of `views` stored views (`view`), and every
    caption, into `spool`'s blocks (`blocks_of`): rank r embeds chunks r, r + W, ... of the samples (`row_spool.shard`,
    their images decoded by `workers` processes) and the captions each chunk serves that it has not embedded yet."""
    image_key, text_key = spec.input_keys
    dtype = next(teacher.parameters()).dtype
    mine, rounds = shard(len(train), batch_size, rank, world)
    picture = on(train.fixed_view([0])[0][image_key], device, dtype)  # one image beside each chunk of captions
    done: set[str] = set()
    for chunk in rounds_of(FixedViews(train, mine, batch_size, views), rounds, workers):
        for block, (batch, keys, _) in enumerate(chunk or [(None, [], [])] * (1 + views)):
            inputs = None if batch is None else [on(batch[key], device, dtype) for key in (image_key, text_key)]
            spool.send(block, keys, None if inputs is None else at_least_fp32(teacher(*inputs)[0]))
        captions = [text for text in dict.fromkeys(chunk[0][2] if chunk else []) if text not in done]
        done.update(captions)
        rows = [
            at_least_fp32(teacher(picture, on(train.encode_text(captions[i : i + batch_size]), device, dtype))[1])
            for i in range(0, len(captions), batch_size)
        ]
        spool.send(1 + views, captions, torch.cat(rows) if rows else None)


@torch.no_grad()
def embed_items(
    train: Any,
    teacher: Any,
    batch_size: int,
    device: torch.device,
    spool: RowSpool,
    workers: int = 0,
    *,
    rank: int = 0,
    world: int = 1,
) -> None:
    """Every query and document of vl_pairs rows (`VLPairsDataset.frozen_items`, keyed as `datasets.vl_items` says) by
    the run's qwen_vl teacher (`QwenVLEmbedder.embed`) into `spool`'s blocks: rank r embeds chunks r, r + W, ... of each
    side's items (`row_spool.shard`, their images decoded by `workers` processes)."""
    dtype = next(teacher.parameters()).dtype
    found = train.frozen_items()
    for block, (own, side) in enumerate(FILE_SIDES.items()):
        mine, rounds = shard(len(found[side]), batch_size, rank, world)
        chunks = ItemChunks(train, side, [found[side][i] for i in mine], batch_size)
        for inputs, keys in (chunk or (None, []) for chunk in rounds_of(chunks, rounds, workers)):
            rows = at_least_fp32(teacher.embed(**on(inputs, device, dtype), side=own)) if keys else None
            spool.send(block, keys, rows)


@torch.no_grad()
def embed_samples(
    train: Any,
    teacher: Any,
    batch_size: int,
    device: torch.device,
    spool: RowSpool,
    workers: int = 0,
    *,
    rank: int = 0,
    world: int = 1,
) -> None:
    """Every sample's query and document (and negative captions) of image-text data served through the qwen_vl
    processor (`fixed_view`'s batches, keyed by `item_keys`) by the run's teacher into `spool`'s blocks: rank r embeds
    chunks r, r + W, ... of the samples (`row_spool.shard`)."""
    dtype = next(teacher.parameters()).dtype
    mine, rounds = shard(len(train), batch_size, rank, world)
    k = train.num_negatives
    for chunk in rounds_of(FixedViews(train, mine, batch_size), rounds, workers):
        if chunk is None:
            for block in range(len(FILE_SIDES)):
                spool.send(block, [], None)
            continue
        [(batch, images, texts)] = chunk
        keys: dict[str, list[str]] = {"query": [], "document": []}
        for i, image in enumerate(images):
            query, doc, negatives = train.item_keys(
                image, texts[i * (1 + k)], texts[i * (1 + k) + 1 : (i + 1) * (1 + k)]
            )
            keys["query"].append(query)
            keys["document"] += [doc, *negatives]
        batch = {name: on(value, device, dtype) for name, value in batch.items() if isinstance(value, torch.Tensor)}
        for block, (own, side) in enumerate(FILE_SIDES.items()):
            grid = batch[f"{own}_image_grid_thw"]
            pixels = (batch[f"{own}_pixel_values"], grid) if len(grid) else (None, None)
            embedded = at_least_fp32(teacher.embed(batch[own], *pixels, side=own))
            if side == "document" and k:  # each sample's document, then its negative captions' (text documents)
                negatives = at_least_fp32(teacher.embed(batch[NEGATIVES].flatten(0, 1), side=own))
                embedded = torch.cat([embedded[:, None], negatives.view(len(embedded), k, -1)], 1).flatten(0, 1)
            spool.send(block, keys[side], embedded)


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
    if info.rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
    with RowSpool(
        blocks_of(processed, opts.views), None if info.rank else out.parent, info.world_size, info.device
    ) as spool:
        with precision.autocast():  # the run's mixed precision, as its running teacher computes
            if processed:
                items = embed_items if rows else embed_samples
                items(train, teacher, opts.batch_size, info.device, spool, cfg.data.num_workers, **where)
            else:
                embed(
                    spec,
                    train,
                    teacher,
                    opts.batch_size,
                    info.device,
                    spool,
                    cfg.data.num_workers,
                    **where,
                    views=opts.views,
                )
        if info.rank:  # another rank's: rank 0 writes
            return out, ""
        sides, keys, vectors = spool.rows()
        own = spec.guide_temperature  # a CLIP's or SigLIP's trained scale, which distill_temperature = 0 reads
        write_rows(out, sides, keys, vectors, {TEACHER_LOGIT_SCALE: repr(teacher.logit_scale.item())} if own else None)
    width = f"{vectors.shape[1]}-wide embeddings of"
    if processed:
        return out, f"{width} {sides[0][1]} queries and {sides[1][1]} documents"
    views = f" (and {opts.views} train views of each)" if opts.views else ""
    return out, f"{width} {sides[0][1]} image(s){views} and {sides[-1][1]} caption(s)"


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
