"""A `data.path` that names a dataset in several files (`datasets/shards.py`): a glob pattern or a folder of shards,
as a Hugging Face dataset repository's snapshot holds them, is one source. Text pairs serve what the one file of
all their rows serves; image-text (`hf`) shards serve the bundled loader's tensors; bad patterns and folders are
one-line errors. vl_pairs shards: tests/test_qwen_vl_pairs.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.needs import needs, require
from tests.test_pairs_data import ROWS, _one_line, st_rows, write_jsonl
from tests.test_user_data import _dataset, write_emoji_files
from titan_contrastive.datasets import DataError
from titan_contrastive.datasets.bad_samples import BAD_SAMPLES
from titan_contrastive.datasets.pairs import PairsDataset


@pytest.fixture(scope="module")
def tokenizer():
    from titan_contrastive.models.bi_encoder import BiEncoderArgs, build_tokenizer

    return build_tokenizer(BiEncoderArgs())


@pytest.fixture(scope="module")
def emoji(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    return write_emoji_files(tmp_path_factory.mktemp("emoji"))


@needs("hf")
def test_shards_of_one_source_read_as_one_file(tmp_path: Path, tokenizer) -> None:
    """A folder of JSONL shards and a glob of Parquet shards (a dataset repository's snapshot) serve what the
    one file of all their rows serves, in sorted file order; a `::` join takes a pattern as one source; a
    pattern or folder without data files, mixed formats and shards that disagree are one-line errors."""
    import datasets

    rows = st_rows(with_ids=True)
    whole = write_jsonl(tmp_path / "all.jsonl", rows)
    (tmp_path / "jsonl").mkdir()
    for n, (start, stop) in enumerate([(0, 3), (3, 4), (4, 8)]):  # file names sort as the rows' order
        write_jsonl(tmp_path / "jsonl" / f"train-{n:05d}-of-00003.jsonl", rows[start:stop])
    (tmp_path / "jsonl" / "README.md").write_text("a dataset card: not data\n")
    (tmp_path / "parquet").mkdir()
    for n, (start, stop) in enumerate([(0, 5), (5, 8)]):
        datasets.Dataset.from_list(rows[start:stop]).to_parquet(str(tmp_path / "parquet" / f"train-{n}.parquet"))
    indices = [3, 0, 7, 2, 5]

    def served(path: str) -> dict:
        ds = PairsDataset(split="train", path=path, tokenizer=tokenizer, query_length=24)
        assert len(ds) == len(ROWS) and ds.num_negatives == 2, path
        return ds.__getitems__(indices)

    want = served(str(whole))
    for path in (tmp_path / "jsonl", f"{tmp_path}/parquet/train-*.parquet", f"{tmp_path}/**/train-*.jsonl"):
        got = served(str(path))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), path
    joined = PairsDataset(
        split="train", path=f"{tmp_path}/parquet/*.parquet::{whole}", tokenizer=tokenizer, query_length=24
    )
    assert joined.source_sizes == [len(ROWS), len(ROWS)]  # the pattern is one source of all its files
    (tmp_path / "empty").mkdir()
    (tmp_path / "splits").mkdir()  # a repository's splits side by side (MMEB-train's subsets hold three)
    for split in ("original", "diverse_instruction"):
        write_jsonl(tmp_path / "splits" / f"{split}-00000-of-00001.jsonl", rows)
    one = PairsDataset(split="train", path=f"{tmp_path}/splits/original-*", tokenizer=tokenizer, query_length=24)
    assert len(one) == len(ROWS)  # a pattern names its split
    (tmp_path / "mixed").mkdir()
    write_jsonl(tmp_path / "mixed" / "a.jsonl", rows[:2])
    datasets.Dataset.from_list(rows[2:]).to_parquet(str(tmp_path / "mixed" / "b.parquet"))
    write_jsonl(
        tmp_path / "jsonl" / "train-00009-of-00003.jsonl", [{k: v for k, v in r.items() if k != "id"} for r in rows]
    )
    for path, needles in (
        (
            f"{tmp_path}/nothing-*.jsonl",
            (
                "the pattern matches no .jsonl/.json/.csv/.tsv/.txt/.parquet/.arrow (the text ones also compressed: "
                ".jsonl.gz, .bz2, .xz, .zst) file",
            ),
        ),
        (str(tmp_path / "empty"), ("the folder (not a save_to_disk folder) holds no",)),
        (
            str(tmp_path / "splits"),
            (
                "holds the shards of 2 splits (diverse_instruction, original, by their names); name one, e.g. ",
                "/splits/diverse_instruction-*.jsonl",
            ),
        ),
        (str(tmp_path / "mixed"), ("files of 2 formats (.jsonl, .parquet)", "mixed/*.jsonl")),
        (str(tmp_path / "jsonl"), ("train-00009-of-00003.jsonl and train-00000-of-00003.jsonl differ", "ids")),
    ):
        with pytest.raises(DataError) as err:
            PairsDataset(split="train", path=path, tokenizer=tokenizer, query_length=24)
        _one_line(err, *needles)


def test_hf_shards_serve_the_bundled_samples(emoji: dict) -> None:
    """A glob of Parquet shards whose image paths are relative to them, and a folder of JSON-lines shards
    (as a dataset repository's snapshot holds them): one dataset, in sorted file order, equal to the bundled
    loader's samples."""
    require("data")
    import datasets

    root, rows = emoji["root"], emoji["rows"]
    (root / "jsonl-shards").mkdir(exist_ok=True)
    for n, start in enumerate(range(0, len(rows), 64)):
        part = rows[start : start + 64]
        table = datasets.Dataset.from_dict({"image": [p for p, _ in part], "text": [c for _, c in part]})
        table.to_parquet(str(root / f"hf-{n:05d}.parquet"))
        with open(root / "jsonl-shards" / f"train-{n:05d}.jsonl", "w") as f:
            f.writelines(json.dumps({"image": str(root / p), "text": c}) + "\n" for p, c in part)
    indices = [0, 5, 63, 64, 65, 127, 199, 3]
    want = emoji["bundled"].__getitems__(indices)
    for path in (str(root / "hf-*.parquet"), str(root / "jsonl-shards")):
        ds = _dataset(emoji, "hf", augment=False, split="test", path=path)
        got = ds.__getitems__(indices)
        assert len(ds) == 200 and got[BAD_SAMPLES] == [], path
        assert torch.equal(got["image"], want["image"]) and torch.equal(got["text"], want["text"]), path
