"""The image-text records behind a `data.path` of files (`data.dataset` csv, webdataset or hf): one source per
`::`-joined part, read as the `[data]` section says (`open_source`)."""

from __future__ import annotations

from titan_contrastive.config.data import Data
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.hf_disk import HfSource
from titan_contrastive.datasets.mixing import joins, split_sources
from titan_contrastive.datasets.sources import CsvSource, Source, WebDatasetSource, WeightedSources

__all__ = ["open_source"]


def open_source(kind: str, path: str, data: Data, *, split: str = "train", negatives: bool = False) -> Source:
    """The records behind `path` (`::` joins several, the train split's weighted by `data.upsampling_factors`), read
    as the `[data]` section `data` says (column names, shard member keys; with `negatives`, the
    negative captions its `*_negative_*` keys name)."""
    if not path:
        raise DataError(
            f"data.path is empty: data.dataset={kind!r} reads your files; set data.path (see README, 'Your own data')"
        )
    parts, factors = split_sources(path, data.upsampling_factors if split == "train" else ())
    sources: list[Source] = []
    for part in parts:
        if kind == "csv":
            sources.append(
                CsvSource(
                    part,
                    img_key=data.csv_img_key,
                    caption_key=data.csv_caption_key,
                    separator=data.csv_separator,
                    negative_keys=data.csv_negative_keys if negatives else (),
                    image_root=data.image_root,
                )
            )
        elif kind == "webdataset":
            sources.append(
                WebDatasetSource(
                    part,
                    image_keys=data.wds_image_key,
                    caption_key=data.wds_caption_key,
                    negative_key=data.wds_negative_key if negatives else "",
                )
            )
        else:
            sources.append(
                HfSource(
                    part,
                    image_column=data.hf_image_column,
                    text_column=data.hf_text_column,
                    split=split,
                    negative_columns=data.hf_negative_columns if negatives else (),
                )
            )
    return WeightedSources(sources, factors) if joins(factors) else sources[0]
