"""`build_data`: the `[data]` / `[eval]` sections -> train set, eval sets and this rank's loader.

Order of operations (all before any model is built, so a missing file costs no compute):
1. resolve the tokenizer and context length (`data.tokenizer`, `data.context_length` = 0);
2. the train split, then the held-out split (the bundled sets' test split, or `data.val_path`),
   then the zero-shot folder (`eval.zero_shot_path`); each laid out for the family (`prepare`);
3. this rank's resumable loader over the train split.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import Tensor

from titan_contrastive.config import ConfigError
from titan_contrastive.config.data import Data
from titan_contrastive.config.job_config import JobConfig
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.clip_bpe import ClipBpeTokenizer
from titan_contrastive.datasets.file_sources import open_source
from titan_contrastive.datasets.files import FileImageTextDataset
from titan_contrastive.datasets.formats import data_suffix
from titan_contrastive.datasets.frozen import BUNDLED_PROCESSED, EmbeddingTable
from titan_contrastive.datasets.image_folder import ImageFolderZeroShot, load_templates
from titan_contrastive.datasets.loader import EpochLoader, build_dataloader
from titan_contrastive.datasets.pairs import PairsDataset
from titan_contrastive.datasets.protocol import Dataset
from titan_contrastive.datasets.source_modes import source_modes
from titan_contrastive.datasets.sources import Source
from titan_contrastive.datasets.synthetic import SyntheticSource
from titan_contrastive.datasets.tokenizer import ByteTokenizer, CaptionTokenizer
from titan_contrastive.datasets.vl_pairs import VLPairsDataset, family_refusal
from titan_contrastive.losses.distill import log_teacher_temperature

FILE_SOURCES = ("csv", "webdataset", "hf", "synthetic")
TEXT_PAIRS = ("pairs", "wordnet")  # text pairs, tokenized at load by the family's tokenizer
DEFAULT_IMAGE_SIZE = 224
DEFAULT_CONTEXT = {"byte": 32, "clip_bpe": 77}
NEGATIVE_KEYS = {"csv": "csv_negative_keys", "webdataset": "wds_negative_key", "hf": "hf_negative_columns"}
"""data.dataset -> the `[data]` key naming its negative captions."""
logger = logging.getLogger("titan_contrastive")


def frozen_table(cfg: JobConfig) -> EmbeddingTable | None:
    """The file of a frozen model's embeddings (`[loss] guide_embeddings` / `teacher_embeddings`), read for
    the train split (`datasets/frozen.py`); None when neither is set. A run holds one frozen
    model or one such file."""
    loss = cfg.loss
    files = {key: path for key in ("guide_embeddings", "teacher_embeddings") if (path := getattr(loss, key))}
    if not files:
        return None
    (key, path), *rest = files.items()
    if rest and rest[0][1] != path:
        raise DataError(
            f"loss.teacher_embeddings={loss.teacher_embeddings!r} and loss.guide_embeddings={loss.guide_embeddings!r}:"
            " a run holds one frozen model's embeddings; give both the same file, or leave one empty"
        )
    for model_key in ("guide_model", "teacher_model"):
        if folder := getattr(loss, model_key):
            raise DataError(
                f"loss.{model_key}={folder!r} and loss.{key}={path!r}: a run holds one frozen model, run or "
                f"embedded ahead; use the file for both roles (loss.{model_key.replace('model', 'embeddings')}), "
                f"or leave loss.{key} empty"
            )
    return EmbeddingTable.read(path, f"loss.{key}")  # its sides are checked by the data that reads it


def check_negative_keys(data: Data) -> None:
    """A negative-caption key is set only for the kind of data that reads it, and says what it reads."""
    for kind, key in NEGATIVE_KEYS.items():
        value = getattr(data, key)
        if value and data.dataset != kind:
            fix = (
                f"set data.{NEGATIVE_KEYS[data.dataset]} instead"
                if data.dataset in NEGATIVE_KEYS
                else "a pairs file's hard negatives are its extra columns"
                if data.dataset == "pairs"
                else "leave it empty"
            )
            raise DataError(
                f"data.{key}={value!r} names negative captions of data.dataset={kind!r}, but data.dataset="
                f"{data.dataset!r}: {fix}"
            )
    if data.wds_negative_key.strip() in ("json:", ".", "json"):
        raise DataError(
            f"data.wds_negative_key={data.wds_negative_key!r}: name a member extension (e.g. 'neg.txt') or a list "
            "field of the sample's JSON ('json:negatives')"
        )
    if data.corpus and data.dataset not in ("pairs", "vl_pairs"):
        raise DataError(
            f"data.corpus={data.corpus!r} holds the documents of rows of ids: set data.dataset='pairs' or 'vl_pairs'"
        )
    rows = data.dataset in ("pairs", "vl_pairs")
    if data.negatives_per_row and not (rows and data.hard_negatives):
        fix = "set data.hard_negatives=true" if rows else "leave it 0"
        what = "data.hard_negatives=false serves none" if rows else f"data.dataset={data.dataset!r}"
        raise DataError(
            f"data.negatives_per_row={data.negatives_per_row} draws each row's hard negatives from pairs or vl_pairs "
            f"rows, and {what}: {fix}"
        )
    if not all(data.in_batch_negatives) and not (rows and data.hard_negatives):
        fix = "set data.hard_negatives=true" if rows else "leave it empty"
        what = "data.hard_negatives=false serves none" if rows else f"data.dataset={data.dataset!r}"
        raise DataError(
            f"data.in_batch_negatives={data.in_batch_negatives}: a query without in-batch negatives is scored against "
            f"its own hard negatives, from pairs or vl_pairs rows, and {what}: {fix}"
        )
    key = NEGATIVE_KEYS.get(data.dataset, "")
    if key and getattr(data, key) and not data.hard_negatives:
        logger.info(f"data.hard_negatives=false: data.{key} is not read; each problem has in-batch negatives only")


def check_teacher(data: Data, distill: str) -> None:
    """loss.distill without a teacher model reads a pairs file's (or vl_pairs rows') teacher scores of each row's
    positive and hard negatives (`distill`: empty when no scores are read)."""
    if distill and data.dataset not in ("pairs", "vl_pairs"):
        raise DataError(
            f"loss.distill={distill!r} reads a teacher's scores from text pairs (a label/score column) or vl_pairs "
            f"rows (doc_scores), which data.dataset={data.dataset!r} does not serve: use data.dataset='pairs', a "
            "loss.teacher_model (or teacher_embeddings), or leave loss.distill empty"
        )
    if distill == "cosent" and data.dataset != "pairs":
        raise DataError(
            f"loss.distill='cosent' ranks scored text pairs, and data.dataset={data.dataset!r}: use "
            "data.dataset='pairs', or leave loss.distill empty"
        )
    if distill == "cosent" and data.negatives_per_row:
        raise DataError(
            f"loss.distill='cosent' ranks scored pairs, and data.negatives_per_row={data.negatives_per_row} draws "
            "hard negatives for a contrastive objective: leave data.negatives_per_row at 0"
        )
    if distill and distill != "cosent" and not data.hard_negatives:  # CoSENT ranks the positives' scores too
        raise DataError(
            f"loss.distill={distill!r} scores each query's positive against its hard negatives, and "
            "data.hard_negatives=false serves none: set data.hard_negatives=true"
        )


def check_image_root(data: Data) -> None:
    """`data.image_root` only for files of relative image paths (csv, vl_pairs, a CSV `val_path`), and a folder;
    `data.image_cache` only for vl_pairs rows (the images held in their cells)."""
    if data.image_cache and data.dataset != "vl_pairs":
        raise DataError(
            f"data.image_cache={data.image_cache!r}: the images held in vl_pairs rows' cells are written there, and "
            f"data.dataset={data.dataset!r} reads no such rows; leave it empty"
        )
    if not data.image_root:
        return
    csv_val = data_suffix(data.val_path) in (".csv", ".tsv")
    if data.dataset not in ("csv", "vl_pairs") and not csv_val:
        raise DataError(
            f"data.image_root={data.image_root!r}: the relative image paths of csv and vl_pairs files are read "
            f"from it, and data.dataset={data.dataset!r} has none; leave it empty"
        )
    if not Path(data.image_root).expanduser().is_dir():
        raise DataError(
            f"data.image_root={data.image_root!r}: no such folder; give the folder that the files' relative "
            "image paths start from"
        )


def check_joined_sources(data: Data) -> None:
    """`::`-joined sources and their factors only where the data kind reads several; per-source prompts
    only for text pairs and vl_pairs rows, per-source modes for vl_pairs rows (`source_modes`)."""
    source_modes(data)
    for key in ("query_prompts", "doc_prompts"):
        if getattr(data, key) and data.dataset not in ("pairs", "vl_pairs"):
            prompt = key[:-1]  # model.query_prompt, model.doc_prompt
            raise DataError(
                f"data.{key}={getattr(data, key)!r}: per-source prompts are for text pairs and vl_pairs rows "
                f"(data.dataset='pairs' or 'vl_pairs'), not data.dataset={data.dataset!r}; leave it empty and set "
                f"model.{prompt}"
            )
    if data.dataset in (*FILE_SOURCES, "pairs", "vl_pairs") and data.dataset != "synthetic":
        return
    if data.upsampling_factors or "::" in data.path:
        key = "upsampling_factors" if data.upsampling_factors else "path"
        raise DataError(
            f"data.{key}={getattr(data, key)!r}: data.dataset={data.dataset!r} reads one source; several sources "
            "joined with '::' (and their factors) are for csv, webdataset, hf, pairs and vl_pairs data"
        )


def _query_length(data: Any, pair_tokenizer: Any) -> int:
    """Text pairs' query tokens: `[data] context_length`, else the model folder's (a PyLate folder's
    `query_length`, `PairTokenizer.query_length`), else the default."""
    return data.context_length or getattr(pair_tokenizer, "query_length", 0) or DEFAULT_CONTEXT["byte"]


def text_tokenizer(name: str, dataset: str, context_length: int) -> Any:
    """The caption tokenizer of image-text data (`auto`: byte for the bundled sets, else clip_bpe)."""
    if name == "auto":
        name = "clip_bpe" if dataset in FILE_SOURCES else "byte"
    length = context_length or DEFAULT_CONTEXT[name]
    return ByteTokenizer(length) if name == "byte" else ClipBpeTokenizer(length)


@dataclass
class DataBundle:
    train_set: Dataset
    eval_set: Dataset | None
    """None: no held-out data (your own data without data.val_path)."""
    zero_shot_set: Dataset | None
    loader: EpochLoader
    context_length: int
    device_transforms: dict[str, Callable[[Tensor], Tensor]] = field(default_factory=dict)
    """Batch key -> what the step applies to it on the device (`pixels_on_device`: uint8 -> normalized)."""
    frozen: EmbeddingTable | None = None
    """The frozen model's embeddings the training set serves (`[loss] teacher_embeddings` / `guide_embeddings`)."""

    @property
    def eval_sets(self) -> dict[str, Dataset | None]:
        """Result-key prefix -> held-out set: the test split ("") and the zero-shot folder ("zero_shot/")."""
        return {"": self.eval_set, "zero_shot/": self.zero_shot_set}

    def describe(self) -> str:
        ds, held_out, zero_shot = self.train_set, self.eval_set, self.zero_shot_set
        evals = f"eval {len(held_out)}" if held_out is not None else "no eval set (data.val_path is empty)"
        return (
            f"{ds.name} train {len(ds)} samples ({'full set' if ds.full else 'bundled subset'}, {ds.source}), {evals}"
            + (
                f", zero-shot {len(zero_shot)} images in {len(zero_shot.class_names)} classes"
                if zero_shot is not None
                else ""
            )
            + "".join(describe_losses(split, d) for split, d in (("train", ds), ("eval", held_out)) if d is not None)
        )


def describe_losses(split: str, ds: Dataset) -> str:
    """ "; train: 2 bad shards ..." for the data line when indexing left shards out or cut them short, else ""."""
    losses = getattr(ds, "shard_losses", [])
    if not losses:
        return ""
    reasons = ", ".join(f"{n} {r}" for r, n in sorted(Counter(loss.reason for loss in losses).items()))
    uncounted = sum(not loss.promised for loss in losses)
    more = f", plus any more in the {uncounted} without a shards.json or _stats.json count" if uncounted else ""
    return (
        f"; {split}: {len(losses)} bad shard(s) left out or cut short ({reasons}; {sum(loss.lost for loss in losses)} "
        f"samples lost{more}; see the warnings above)"
    )


def build_file_dataset(
    kind: str, split: str, path: str, data: Data, *, tokenizer: Any, image_size: int, seed: int, augment: bool
) -> FileImageTextDataset:
    """One split of the user's image-caption data (`data`: the `[data]` section). Negative captions
    are read for the train split only, with data.hard_negatives: evaluation ranks positives."""
    image_size = image_size or DEFAULT_IMAGE_SIZE
    if kind == "synthetic":  # JPEGs a little larger than the crops, as photos are
        source: Source = SyntheticSource(data.synthetic_samples, max(256, image_size * 8 // 7), seed)
    else:
        source = open_source(kind, path, data, split=split, negatives=split == "train" and data.hard_negatives)
    return FileImageTextDataset(
        name=kind,
        split=split,
        source=source,
        tokenizer=tokenizer,
        image_size=image_size,
        seed=seed,
        augment=augment,
    )


def build_data(
    cfg: JobConfig,
    *,
    family_tokenizer: Callable[[], Any],
    prepare: Callable[[Dataset], None],
    build_bundled: Callable[..., Dataset],
    dp_rank: int,
    dp_degree: int,
    pin_memory: bool,
    global_batch_size: int = 0,
    pixels_on_device: bool = False,
    host_group: Callable[[], dist.ProcessGroup | None] | None = None,
) -> DataBundle:
    """The run's data (see the module docstring). `family_tokenizer()`: a pretrained family's own
    tokenizer (bi_encoder) for text pairs, or None; an ImportError (its optional dependency is
    missing) becomes a one-line ConfigError. `build_bundled`: `datasets.build_dataset`.
    `global_batch_size` (samples per optimizer step) may not exceed the training set: one step
    would then hold samples twice (0: not checked). `pixels_on_device` (a GPU run): a training set
    decoded from files serves uint8 images and the step normalizes them on the device
    (`DataBundle.device_transforms`): a quarter of the bytes through the workers' shared memory,
    the pinning and the host-to-device copy, which the global-negatives step makes twice per
    microbatch. `host_group()`: a gloo group of every rank of the run (`parallelisms.host_group`), each building this
    same data, made where text pairs are built (`TEXT_PAIRS`) so that the ranks share their tokenization
    (`token_table.TokenTable`); None: this process tokenizes alone. `cfg` gives `[data]`, `[eval]`, the seed and
    the local batch."""
    data, eval_cfg, seed, local_batch_size = cfg.data, cfg.eval, cfg.training.seed, cfg.training.local_batch_size
    try:
        pair_tokenizer = family_tokenizer()
    except ImportError as e:
        raise ConfigError(str(e)) from None
    eval_sets: list[Dataset | None] = []
    check_negative_keys(data)
    teacher = cfg.loss.teacher_model or cfg.loss.teacher_embeddings
    # the data's teacher scores, unless a model's embeddings give them (mse reads only embeddings)
    scores = "" if teacher or cfg.loss.distill == "mse" else cfg.loss.distill
    check_teacher(data, scores)
    frozen = frozen_table(cfg)
    check_joined_sources(data)
    check_image_root(data)
    if data.dataset in FILE_SOURCES:
        if pair_tokenizer is not None and not isinstance(pair_tokenizer, CaptionTokenizer):
            raise DataError(
                f"data.dataset={data.dataset!r} is image-text; the model family reads text pairs: use "
                "data.dataset='pairs' or 'wordnet'"
            )
        tokenizer = pair_tokenizer or text_tokenizer(data.tokenizer, data.dataset, data.context_length)
        context_length = tokenizer.context_length
        common = dict(tokenizer=tokenizer, image_size=data.image_size, seed=seed)
        if data.val_path and data.dataset == "synthetic":
            raise DataError(
                f"data.val_path={data.val_path!r}: synthetic data has no held-out set; leave data.val_path empty "
                "and set eval.enable=false"
            )
        train = build_file_dataset(data.dataset, "train", data.path, data, augment=data.augment, **common)
        if data.val_path:  # a CSV/TSV is read as csv whatever the train data is (held-out sets are often small files)
            kind = "csv" if data_suffix(data.val_path) in (".csv", ".tsv") else data.dataset
            eval_sets.append(build_file_dataset(kind, "test", data.val_path, data, augment=False, **common))
        else:
            eval_sets.append(None)
    elif data.dataset == "pairs":
        if pair_tokenizer is None:
            raise DataError(
                "data.dataset='pairs' is text-to-text and needs a model family with a text tokenizer: "
                "use model.name='bi_encoder'"
            )
        context_length = _query_length(data, pair_tokenizer)
        common = dict(
            tokenizer=pair_tokenizer,
            query_length=context_length,
            columns=data.pairs_columns,
            id_column=data.pairs_id_column,
            max_bad_fraction=data.max_bad_fraction,
            hard_negatives=data.hard_negatives,
            negatives_per_row=data.negatives_per_row,
            corpus=data.corpus,
            seed=seed,
        )
        if not data.path:
            raise DataError(
                "data.path is empty: data.dataset='pairs' reads your .jsonl/.json/.csv/.tsv/.txt/.parquet file or "
                "Hugging Face dataset folder; set data.path"
            )
        group = host_group() if host_group else None  # every rank is here: the ranks share the tokenization
        train = PairsDataset(
            split="train",
            path=data.path,
            factors=data.upsampling_factors,
            teacher=scores,
            query_prompts=data.query_prompts,
            doc_prompts=data.doc_prompts,
            in_batch_negatives=data.in_batch_negatives,
            frozen=frozen,
            group=group,
            **common,
        )
        eval_sets.append(
            PairsDataset(split="test", path=data.val_path, group=group, **common) if data.val_path else None
        )
    elif data.dataset == "vl_pairs":  # images and texts per side, through the family's processor (qwen_vl)
        if not data.path:
            raise DataError(
                "data.path is empty: data.dataset='vl_pairs' reads your .jsonl/.json/.csv/.tsv/.parquet/.arrow rows "
                "(query_image, query_text, doc_image, doc_text); set data.path"
            )
        context_length = data.context_length or DEFAULT_CONTEXT["byte"]
        folders = {"image_root": data.image_root, "image_cache": data.image_cache, "corpus": data.corpus}
        folders["group"] = host_group() if host_group else None  # every rank is here: they share the image writes
        train = VLPairsDataset(
            split="train",
            path=data.path,
            mode=data.retrieval_mode,
            modes=source_modes(data),
            hard_negatives=data.hard_negatives,
            negatives_per_row=data.negatives_per_row,
            seed=seed,
            factors=data.upsampling_factors,
            query_templates=data.query_prompts,
            doc_templates=data.doc_prompts,
            in_batch_negatives=data.in_batch_negatives,
            teacher=scores,
            **folders,
        )
        held_out = dict(split="test", path=data.val_path, mode=data.retrieval_mode, **folders)
        eval_sets.append(VLPairsDataset(**held_out) if data.val_path else None)
    else:
        if data.tokenizer == "clip_bpe":
            raise DataError(
                f"data.tokenizer='clip_bpe' with data.dataset={data.dataset!r}: the bundled sets use the byte "
                "tokenizer; set data.tokenizer='auto' or use your own data (csv, webdataset, hf)"
            )
        context_length = getattr(pair_tokenizer, "context_length", 0) or _query_length(data, pair_tokenizer)
        common = dict(
            path=data.path,
            seed=seed,
            context_length=context_length,
            image_size=data.image_size,
            tokenizer=pair_tokenizer,
            hard_negatives=data.hard_negatives,
        )
        text_pairs = data.dataset in TEXT_PAIRS
        if text_pairs and host_group:  # every rank is here: the ranks share the tokenization
            common["group"] = host_group()
        train = build_bundled(
            data.dataset, "train", augment=data.augment, frozen=frozen if text_pairs else None, **common
        )
        eval_sets.append(build_bundled(data.dataset, "test", augment=False, **common))
    if eval_cfg.zero_shot_path:
        if not isinstance(train, FileImageTextDataset):
            raise DataError(
                f"eval.zero_shot_path={eval_cfg.zero_shot_path}: zero-shot folders are read as RGB photos like your "
                f"own image-text data (csv, webdataset, hf), not with data.dataset={data.dataset!r}; leave it empty"
            )
        eval_sets.append(
            ImageFolderZeroShot(
                eval_cfg.zero_shot_path,
                names_file=eval_cfg.zero_shot_names,
                templates=load_templates(eval_cfg.zero_shot_templates),
                tokenizer=train.tokenizer,
                image_size=train.image_shape[-1],
            )
        )
    else:
        eval_sets.append(None)
    for ds in (train, *eval_sets):
        if ds is not None:
            prepare(ds)
    if frozen is not None and data.dataset not in TEXT_PAIRS:  # image-text, vl_pairs: looked up as served
        if train.processed and not isinstance(train, (FileImageTextDataset, VLPairsDataset)):
            raise DataError(f"{frozen.source}: {BUNDLED_PROCESSED}, or name the model (loss.teacher_model) instead")
        train.carry_frozen(frozen)
        items = "query and document" if train.processed else "image and caption"
        logger.info(f"{train.name}: a frozen model's {frozen.dim}-wide embeddings of each {items}, {frozen.source}")
        if train.views:
            logger.info(
                f"{train.name}: each training sample is served one of its image's {train.views} stored views (the "
                "file's crops or flips), with the frozen model's embedding of that view"
            )
        elif frozen.views:
            logger.info(
                f"{train.name}: {frozen.source} holds {frozen.views} views of each image, and data.augment=false "
                "serves the evaluation view: the views are not used"
            )
        if frozen.logit_scale is not None:  # the file keeps its teacher's
            log_teacher_temperature(frozen.source, frozen.logit_scale)
    if isinstance(train, VLPairsDataset) and not train.processed:  # the family's layout asked for no processor
        raise DataError(family_refusal(cfg.model.name))
    if global_batch_size > len(train):
        per_batch = local_batch_size * dp_degree
        raise DataError(
            f"training.global_batch_size={global_batch_size} exceeds the {len(train)} samples of "
            f"{train.name}/{train.split}: "
            f"one step would use samples twice; use at most {len(train) // per_batch * per_batch} (a multiple of "
            f"local_batch_size x dp degree = {per_batch}) or more data"
        )
    transforms = {}
    if pixels_on_device and isinstance(train, FileImageTextDataset) and not (train.processed or train.naflex):
        train.serve_uint8()
        transforms["image"] = train.normalize.apply
    loader = build_dataloader(
        train,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_degree,
        seed=seed,
        num_workers=data.num_workers,
        pin_memory=pin_memory,
        max_bad_fraction=data.max_bad_fraction,
        step_samples=global_batch_size or local_batch_size * dp_degree,
        same_source=data.same_source_batches,
        step_batches=max(1, global_batch_size // (local_batch_size * dp_degree)),
    )
    if data.same_source_batches:
        step, sizes = loader.sampler.step_samples, loader.sampler.source_sizes
        logger.info(
            f"data.same_source_batches: each step's {step} samples come from one source; steps per epoch by source: "
            + ", ".join(str(size // step) for size in sizes)
        )
    return DataBundle(train, eval_sets[0], eval_sets[1], loader, context_length, transforms, frozen)
