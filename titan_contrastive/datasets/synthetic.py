"""`data.dataset = "synthetic"`: any number of image-caption records without data on disk, for
throughput and memory runs at global batches larger than the bundled sets (open_clip's
`--dataset-type synthetic`, with the real per-sample work kept).

The records go through the same `files.FileImageTextDataset` as your own data, so every sample
costs what a real one costs in the loader: a JPEG decode, a random-resized crop, a bicubic resize,
normalization and tokenization, in the data workers. The JPEGs come from a pool made once when the
source is built: the bundled emoji, enlarged to `side` pixels, with noise so that they compress
and decode like photos rather than flat drawings. Record i is pool image i mod the pool size with
the caption "a photo of <its name>, sample i"; a contrastive batch larger than the pool holds
repeated images, which does not change the cost of a step (the loss is still computed over all
of them), only what it learns: this source measures a training run's speed, not its accuracy.
"""

from __future__ import annotations

import functools
import io

import numpy as np
from PIL import Image

from titan_contrastive.datasets.emoji import BUNDLE_FILE, load_emoji
from titan_contrastive.datasets.sources import Record, ShardLoss

POOL = 256  # distinct JPEGs, about 20 KB each at 256 px
NOISE = 12.0  # standard deviation of the added noise, in levels


class SyntheticSource:
    """`samples` records over a pool of `POOL` JPEGs of `side` x `side` pixels (a `sources.Source`)."""

    def __init__(self, samples: int, side: int, seed: int = 0) -> None:
        self.samples, self.side = samples, side
        self.location = f"synthetic ({samples} samples over {POOL} generated {side} px JPEGs)"
        self.losses: list[ShardLoss] = []
        self.num_negatives = 0
        self._jpegs, self._names = _pool(side, seed)

    def __len__(self) -> int:
        return self.samples

    def read(self, index: int) -> Record:
        k = index % len(self._jpegs)
        return Record(self._jpegs[k], f"a photo of {self._names[k]}, sample {index}", "synthetic", str(index))


@functools.lru_cache(maxsize=4)  # once per process: the trainers a benchmark or a test session builds share it
def _pool(side: int, seed: int) -> tuple[tuple[bytes, ...], tuple[str, ...]]:
    """(JPEGs, their emoji's names): `POOL` emoji drawn by `seed`, enlarged to `side` px, with noise."""
    images, names = load_emoji(BUNDLE_FILE)
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(images), size=min(POOL, len(images)), replace=False)
    jpegs = []
    for i in picks:
        big = np.asarray(Image.fromarray(images[i]).resize((side, side), Image.Resampling.BICUBIC), np.float32)
        noisy = np.clip(big + rng.normal(0.0, NOISE, big.shape), 0, 255).astype(np.uint8)
        out = io.BytesIO()
        Image.fromarray(noisy).save(out, format="JPEG", quality=90)
        jpegs.append(out.getvalue())
    return tuple(jpegs), tuple(names[i] for i in picks)
