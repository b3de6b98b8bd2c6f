"""split_vlm_inputs (packed Qwen-VL patches) and unpack_batch (retrieval modes, key priority)."""

from __future__ import annotations

import pytest
import torch

from titan_contrastive.batching import BatchError, split_vlm_inputs
from titan_contrastive.datasets.retrieval import MODES, unpack_batch


def packed_batch(samples: int, images_per_sample: list[int], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n_images = sum(images_per_sample)
    grid = torch.stack(
        [
            torch.ones(n_images, dtype=torch.long),
            torch.randint(1, 5, (n_images,), generator=gen),
            torch.randint(1, 5, (n_images,), generator=gen),
        ],
        dim=1,
    )
    patches = int(grid.prod(1).sum())
    return {
        "input_ids": torch.randint(0, 100, (samples, 7), generator=gen),
        "attention_mask": torch.ones(samples, 7),
        "pixel_values": torch.randn(patches, 3, 2, 2, generator=gen),
        "image_grid_thw": grid,
    }


def concat(chunks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([c[k] for c in chunks]) for k in chunks[0]}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("chunk", [1, 3, 4])
def test_split_round_trips_on_random_grids(seed: int, chunk: int) -> None:
    samples = 5 + seed % 3
    counts = torch.randint(0, 3, (samples,), generator=torch.Generator().manual_seed(seed)).tolist()
    batch = packed_batch(samples, counts, seed)
    chunks = split_vlm_inputs(batch, chunk, images_per_sample=counts)
    assert [len(c["input_ids"]) for c in chunks] == [min(chunk, samples - s) for s in range(0, samples, chunk)]
    for c, start in zip(chunks, range(0, samples, chunk)):
        own = counts[start : start + chunk]
        assert len(c["image_grid_thw"]) == sum(own)
        assert c["pixel_values"].shape[0] == int(c["image_grid_thw"].prod(1).sum())  # whole images only
    back = concat(chunks)
    assert all(torch.equal(back[k], batch[k]) for k in batch)


def test_one_image_per_sample_by_default_and_clip_style_split_on_dim0() -> None:
    batch = packed_batch(4, [1] * 4, 0)
    back = concat(split_vlm_inputs(batch, 3))
    assert all(torch.equal(back[k], batch[k]) for k in batch)
    clip_style = {"pixel_values": torch.randn(5, 3, 8, 8), "input_ids": torch.zeros(5, 4, dtype=torch.long)}
    assert [c["pixel_values"].shape[0] for c in split_vlm_inputs(clip_style, 2)] == [2, 2, 1]
    assert [t.shape[0] for t in split_vlm_inputs(torch.randn(5, 3), 4)] == [4, 1]


def test_image_count_mismatch_is_a_clear_error() -> None:
    batch = packed_batch(3, [1, 2, 1], 1)
    with pytest.raises(BatchError, match="4 images .* for 3 samples: pass images_per_sample"):
        split_vlm_inputs(batch, 2)
    batch["pixel_values"] = batch["pixel_values"][:-1]
    with pytest.raises(BatchError, match="patches .* but pixel_values has"):
        split_vlm_inputs(batch, 2, images_per_sample=[1, 2, 1])


TXT = {"input_ids": torch.zeros(2, 3), "attention_mask": torch.ones(2, 3)}
IMG = {"pixel_values": torch.randn(6, 4), "image_grid_thw": torch.tensor([[1, 1, 3], [1, 3, 1]])}


def prefixed(prefix: str, fields: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}_{k}": v.clone() + (1 if prefix == "pos" else 2 if prefix == "neg" else 0) for k, v in fields.items()
    }


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


KINDS = {"text": TXT, "image": IMG, "multi": {**TXT, **IMG}}


@pytest.mark.parametrize("mode", list(MODES))
def test_unpack_prefixed_keys(mode: str) -> None:
    qk, pk = MODES[mode]
    batch = {**prefixed("query", KINDS[qk]), **prefixed("pos", KINDS[pk]), **prefixed("neg", KINDS[pk])}
    batch.update({"input_ids": torch.full((2, 3), 99.0), "pixel_values": torch.full((6, 4), 99.0)})  # legacy decoys
    q, p, n = unpack_batch(batch, mode)
    strip = lambda d, pre: {k[len(pre) + 1 :]: v for k, v in d.items() if k.startswith(pre + "_")}  # noqa: E731
    assert same(q, strip(batch, "query")) and same(p, strip(batch, "pos")) and same(n, strip(batch, "neg"))


@pytest.mark.parametrize("mode", list(MODES))
def test_unpack_legacy_aliases(mode: str) -> None:
    qk, pk = MODES[mode]
    batch: dict[str, torch.Tensor] = {}
    # legacy text keys serve the query; legacy image keys serve the image positive, else the query
    for side, kind in (("query", qk), ("pos", pk)):
        for field, value in KINDS[kind].items():
            legacy_ok = (field in TXT and side == "query") or (field in IMG and (side == "pos") == (pk == "image"))
            batch[field if legacy_ok and field not in batch else f"{side}_{field}"] = value.clone()
    q, p, n = unpack_batch(batch, mode)
    assert (
        n is None
        and q.keys() >= set(KINDS[qk]) - {"attention_mask"}
        and p.keys() >= set(KINDS[pk]) - {"attention_mask"}
    )
    for side_dict, kind in ((q, qk), (p, pk)):
        for field, value in KINDS[kind].items():
            assert torch.equal(side_dict[field], value)


def test_unpack_never_truth_tests_tensors_and_names_missing_keys() -> None:
    batch = {
        "query_input_ids": torch.zeros(2, 3),
        "pixel_values": torch.randn(6, 4),
        "image_grid_thw": torch.ones(2, 3),
    }
    q, p, _ = unpack_batch(batch, "t2i")  # a multi-element tensor in an `or` would raise here
    assert torch.equal(p["pixel_values"], batch["pixel_values"])
    with pytest.raises(
        BatchError, match=r"mode 't2t': the pos side needs input_ids; none of the keys \['pos_input_ids'\]"
    ):
        unpack_batch(batch, "t2t")
    with pytest.raises(BatchError, match="retrieval mode 'x2y': choose one of t2i, i2i, t2t, i2t, m2i"):
        unpack_batch(batch, "x2y")
