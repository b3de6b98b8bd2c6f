"""Gzipped data files (`datasets/formats.py`): JSON lines, CSV and TSV as sentence-transformers' training files and
tevatron's corpora are published (`train.jsonl.gz`, `collection.tsv.gz`) are read as the same files uncompressed are,
decompressed as they are read:

- text pairs (FlagEmbedding's rows drawn per epoch, a CSV of triplets with a byte-order mark), their corpus by id (MS
  MARCO's unnamed collection.tsv, JSON lines read by Arrow and a line at a time), a folder of gzipped shards, a vl_pairs
  file, an image-text CSV (open_clip's) and an STS file serve what the uncompressed files serve;
- a run trains on them and evaluates STS on them; another evaluates on a gzipped CSV beside tar shards; Hugging Face
  data (`data.dataset='hf'`) in such a file;
- the errors, one line each: a `.gz` that is no gzip, one cut short, a folder of both forms of one format, a format
  that is not read.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from tests.needs import needs
from tests.test_negative_pools import _equal, bge_rows, write_jsonl
from tests.test_pairs_data import _one_line
from titan_contrastive.datasets import DataError
from titan_contrastive.datasets.pairs import PairsDataset


def gzipped(path: Path) -> Path:
    """`path` gzipped beside it (`path.gz`)."""
    out = path.with_name(path.name + ".gz")
    with open(path, "rb") as src, gzip.open(out, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return out


@pytest.fixture(scope="module")
def tokenizer():
    from titan_contrastive.models.bi_encoder import BiEncoderArgs, build_tokenizer

    return build_tokenizer(BiEncoderArgs())


def _pairs(path: Path, tokenizer, **kw) -> PairsDataset:
    return PairsDataset(split="train", path=str(path), tokenizer=tokenizer, query_length=12, seed=5, **kw)


def _same(a: PairsDataset, b: PairsDataset, epochs: int = 1) -> bool:
    if len(a) != len(b):
        return False
    for epoch in range(epochs):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        if not _equal(a.__getitems__(list(range(len(a)))), b.__getitems__(list(range(len(b))))):
            return False
    return True


@needs("hf")
def test_gzipped_text_pairs_and_their_corpus_serve_what_the_plain_files_serve(tmp_path: Path, tokenizer) -> None:
    rows = bge_rows()
    bge = write_jsonl(tmp_path / "bge.jsonl", rows)
    plain = _pairs(bge, tokenizer, negatives_per_row=2)
    assert _same(_pairs(gzipped(bge), tokenizer, negatives_per_row=2), plain, epochs=3)

    triplets = [(r["query"], r["pos"][0], r["neg"][0]) for r in rows]
    csv_file = tmp_path / "triplets.csv"
    lines = ["anchor,positive,negative"] + [",".join(f'"{t}"' for t in row) for row in triplets]
    csv_file.write_text("\ufeff" + "\n".join(lines) + "\n", encoding="utf-8")  # a byte-order mark, as Excel writes
    from_csv = _pairs(gzipped(csv_file), tokenizer, hard_negatives=True)
    assert _same(from_csv, _pairs(csv_file, tokenizer, hard_negatives=True))
    assert _same(from_csv, _pairs(write_jsonl(tmp_path / "t.jsonl", _named(triplets)), tokenizer, hard_negatives=True))

    texts = list(dict.fromkeys(t for row in triplets for t in row[1:]))
    ids = {t: 7 + n for n, t in enumerate(texts)}
    by_id = write_jsonl(tmp_path / "ids.jsonl", [{"q": q, "pos": ids[p], "neg": ids[n]} for q, p, n in triplets])
    collection = tmp_path / "collection.tsv"  # MS MARCO's: unnamed id<TAB>text lines, more than the rows name
    collection.write_text("".join(f"{i}\t{t}\n" for t, i in ids.items()) + "999\ta passage no row names\n")
    columns = {"columns": ["q", "pos", "neg"], "hard_negatives": True}
    from_ids = _pairs(by_id, tokenizer, corpus=str(gzipped(collection)), **columns)
    assert _same(from_ids, _pairs(by_id, tokenizer, corpus=str(collection), **columns))
    assert _same(from_ids, from_csv)


@needs("hf")
def test_a_run_trains_on_gzipped_pairs_and_evaluates_gzipped_sts(tmp_path: Path) -> None:
    from tests.test_pairs_data import make_trainer

    rows = write_jsonl(tmp_path / "bge.jsonl", bge_rows())
    sts = tmp_path / "sts.csv"
    sts.write_text("sentence1,sentence2,score\na cat,a kitten,4.5\na cat,the stock market,0.2\na dog,a puppy,4.8\n")
    trainer = make_trainer(
        tmp_path,
        gzipped(rows),
        "--data.negatives_per_row=2",
        "--training.local_batch_size=4",
        "--training.steps=1",
        "--eval.enable=true",
        f"--eval.sts_path={gzipped(sts)}",
    )
    assert len(trainer.train_set) == len(bge_rows())
    trainer.train()
    trainer.metrics.close()
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("sts/spearman_cosine" in r for r in evals if r["kind"] == "eval")


def _named(triplets: list[tuple[str, str, str]]) -> list[dict]:
    return [{"anchor": a, "positive": p, "negative": n} for a, p, n in triplets]


@needs("data")
@pytest.mark.parametrize("arrow", [True, False])
def test_a_gzipped_json_lines_corpus_by_arrow_and_by_lines(tmp_path: Path, monkeypatch, arrow: bool) -> None:
    """A gzipped JSON lines corpus gives the plain file's documents read by Arrow (pyarrow decompresses it by its
    suffix) and a line at a time; which reader ran is checked, not assumed."""
    from titan_contrastive.datasets import corpus

    monkeypatch.setattr(corpus, "ARROW_JSON_BYTES", 0 if arrow else 1 << 40)
    read_alone: list[Path] = []
    opened = corpus.opened_rows
    monkeypatch.setattr(corpus, "opened_rows", lambda file, *a: (read_alone.append(file), opened(file, *a))[1])
    docs = [{"_id": f"d{i}", "title": f"title {i}" if i % 2 else None, "text": f"text {i}"} for i in range(500)]
    plain = write_jsonl(tmp_path / "corpus.jsonl", docs)
    wanted = {f"d{i}" for i in (0, 3, 250, 499)}
    monkeypatch.setattr(corpus, "ARROW_JSON_BYTES", 1 << 40)  # the plain file: the line reader, the reference
    want = corpus.corpus_texts(str(plain), wanted, {}, "data.corpus")
    monkeypatch.setattr(corpus, "ARROW_JSON_BYTES", 0 if arrow else 1 << 40)
    read_alone.clear()
    assert corpus.corpus_texts(str(gzipped(plain)), wanted, {}, "data.corpus") == want
    assert want == {f"d{i}": f"title {i} text {i}" if i % 2 else f"text {i}" for i in (0, 3, 250, 499)}
    assert read_alone == ([] if arrow else [tmp_path / "corpus.jsonl.gz"])


@needs("hf")
def test_gzipped_shards_vl_pairs_and_sts(tmp_path: Path, tokenizer) -> None:
    """A folder of gzipped shards, and a pattern of them, are one source, as the folder of the plain shards is;
    gzipped vl_pairs rows, an image-text CSV and STS pairs are the plain files' rows."""
    from titan_contrastive.components.sts_eval import load_sts
    from titan_contrastive.datasets.vl_pairs import VLPairsDataset

    rows = bge_rows()
    for folder in ("plain", "packed"):
        (tmp_path / folder).mkdir()
        for n in range(2):
            shard = write_jsonl(tmp_path / folder / f"train-{n}.jsonl", rows[n * 3 : (n + 1) * 3])
            if folder == "packed":
                gzipped(shard)
                shard.unlink()
    plain = _pairs(tmp_path / "plain", tokenizer, negatives_per_row=2)
    assert _same(_pairs(tmp_path / "packed", tokenizer, negatives_per_row=2), plain, epochs=2)
    assert _same(_pairs(f"{tmp_path}/packed/*.jsonl.gz", tokenizer, negatives_per_row=2), plain, epochs=2)

    vl = tmp_path / "vl.tsv"
    vl.write_text("query_text\tdoc_text\n" + "".join(f"query {i}\tdocument {i}\n" for i in range(5)))
    vl_gz, vl_plain = (VLPairsDataset(split="train", path=str(p), mode="t2t") for p in (gzipped(vl), vl))
    assert len(vl_gz) == len(vl_plain) == 5
    assert [vl_gz._fields(0, i) for i in range(5)] == [vl_plain._fields(0, i) for i in range(5)]
    assert vl_gz._fields(0, 4) == {"query_text": "query 4", "doc_text": "document 4"}
    from titan_contrastive.datasets.sources import CsvSource

    images = tmp_path / "images.csv"  # open_clip's CSV of image paths and captions, tab-separated
    images.write_text("filepath\ttitle\tneg\n" + "".join(f"img/{i}.png\ta caption {i}\tnot {i}\n" for i in range(4)))
    packed, plain = (CsvSource(str(p), negative_keys=["neg"]) for p in (gzipped(images), images))
    assert [packed._rows[i] for i in range(4)] == [plain._rows[i] for i in range(4)] and len(packed) == 4
    assert packed._rows[3] == [str(tmp_path / "img" / "3.png"), "a caption 3", "not 3"]
    sts = tmp_path / "sts.tsv"
    sts.write_text("sentence1\tsentence2\tscore\na cat\ta kitten\t4.5\na cat\tthe stock market\t0.2\n")
    assert load_sts(str(gzipped(sts))) == load_sts(str(sts)) and load_sts(str(sts)).scores == [4.5, 0.2]


def test_a_gzipped_csv_evaluates_a_run_on_tar_shards(tmp_path: Path, caplog) -> None:
    """`data.val_path` a gzipped CSV beside tar shards of training data: read as csv, as the plain CSV is."""
    from tests.test_user_data import write_emoji_files
    from titan_contrastive.train import main

    caplog.set_level("INFO", logger="titan_contrastive")
    paths = write_emoji_files(tmp_path)["paths"]
    args = ["--data.dataset=webdataset", f"--data.path={paths['webdataset']}", "--data.image_size=32"]
    args += [f"--data.val_path={gzipped(Path(paths['csv']))}", "--training.local_batch_size=20", "--training.steps=1"]
    assert main([*args, "--metrics.enable_tensorboard=false", f"--job.dump_folder={tmp_path / 'run'}"]) == 0
    assert "eval step 1 on 200 csv test samples" in caplog.text


@needs("data")
def test_a_gzipped_file_as_hugging_face_data(tmp_path: Path, hf_cache) -> None:
    """data.dataset='hf' reads a gzipped JSON lines or CSV file (`hf_disk.open_hf_dataset`, by the suffix before
    `.gz`) as the plain file: the same rows."""
    from titan_contrastive.datasets.hf_disk import open_hf_dataset

    rows = [{"image": f"img/{i}.png", "caption": f"a caption {i}"} for i in range(4)]
    plain = write_jsonl(tmp_path / "rows.jsonl", rows)
    assert open_hf_dataset(str(gzipped(plain)), "train").to_list() == open_hf_dataset(str(plain), "train").to_list()
    assert open_hf_dataset(str(plain.with_name("rows.jsonl.gz")), "train").to_list() == rows


def test_errors_in_one_line(tmp_path: Path) -> None:
    from titan_contrastive.datasets.pair_rows import read_rows

    def fails(path: Path | str, *needles: str) -> None:
        with pytest.raises(DataError) as err:
            read_rows(str(path), (), "", 0.0, "train", "", False, {}, False)
        _one_line(err, *needles)

    (tmp_path / "plain.jsonl.gz").write_text(json.dumps({"query": "q", "positive": "p"}) + "\n")
    fails(tmp_path / "plain.jsonl.gz", "plain.jsonl.gz: not readable (BadGzipFile")
    whole = gzip.compress(
        ("".join(json.dumps({"query": f"q{i}", "positive": f"p{i}"}) + "\n" for i in range(999))).encode()
    )
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    fails(tmp_path / "cut.jsonl.gz", "cut.jsonl.gz: not a readable jsonl file (EOFError")
    (tmp_path / "both").mkdir()
    write_jsonl(tmp_path / "both" / "a.jsonl", [{"query": "q", "positive": "p"}])
    gzipped(tmp_path / "both" / "a.jsonl")
    fails(tmp_path / "both", "files of 2 formats (.jsonl, .jsonl.gz)", f"{tmp_path / 'both' / '*.jsonl'}")
    (tmp_path / "notes.md.gz").write_bytes(gzip.compress(b"query\tpositive\n"))
    fails(
        tmp_path / "notes.md.gz",
        "not an existing .jsonl/.json/.csv/.tsv/.txt/.parquet/.arrow (the text ones also compressed: .jsonl.gz, .bz2, "
        ".xz, .zst) file or save_to_disk folder",
    )
