"""JSON files and the other compressions (`datasets/formats.py`, `datasets/tables.py`), beside gzip
(tests/test_gzipped.py):

- a `.json` file holds one JSON array of rows (indented, or on one line; of objects or of lists) or JSON lines (of
  objects or of lists), as Hugging Face datasets' JSON builder reads one: text pairs, their corpus by id (by Arrow and a
  line at a time), vl_pairs rows and STS pairs serve what the same rows as `.jsonl` serve;
- JSON lines, JSON, CSV and TSV compressed with bzip2, xz or Zstandard serve what the plain files serve, through the
  same readers, the corpus's Arrow reader and Hugging Face data (`data.dataset='hf'`);
- the errors, one line each: a `.json` file of one object, an array with a row that is no object, an array cut short,
  a `.zst` that is no Zstandard, Zstandard without the `[data]` extra.
"""

from __future__ import annotations

import bz2
import json
import lzma
import sys
from pathlib import Path

import pytest

from tests.needs import installed, needs, require
from tests.test_gzipped import _pairs, _same
from tests.test_negative_pools import bge_rows, write_jsonl
from tests.test_pairs_data import _one_line
from titan_contrastive.datasets import DataError


def compressed(path: Path, suffix: str) -> Path:
    """`path` compressed beside it (`path.bz2`, `path.xz`, `path.zst`)."""
    data = path.read_bytes()
    if suffix == ".zst":
        require("data")
        import zstandard

        packed = zstandard.ZstdCompressor().compress(data)
    else:
        packed = {".bz2": bz2.compress, ".xz": lzma.compress}[suffix](data)
    out = path.with_name(path.name + suffix)
    out.write_bytes(packed)
    return out


@pytest.fixture(scope="module")
def tokenizer():
    from titan_contrastive.models.bi_encoder import BiEncoderArgs, build_tokenizer

    return build_tokenizer(BiEncoderArgs())


def _triplets() -> list[list[str]]:
    return [[r["query"], r["pos"][0], r["neg"][0]] for r in bge_rows()]


@needs("hf")
def test_json_files_serve_what_json_lines_serve(tmp_path: Path, tokenizer) -> None:
    rows = bge_rows()
    plain = _pairs(write_jsonl(tmp_path / "bge.jsonl", rows), tokenizer, negatives_per_row=2)
    indented, one_line, lines = (tmp_path / f"{name}.json" for name in ("indented", "one_line", "lines"))
    indented.write_text(json.dumps(rows, indent=2))
    one_line.write_text(json.dumps(rows))
    write_jsonl(lines, rows)
    for file in (indented, one_line, lines):
        assert _same(_pairs(file, tokenizer, negatives_per_row=2), plain, epochs=3), file

    triplets = _triplets()  # unnamed rows: lists, as an array or a line each
    by_lines = _pairs(write_jsonl(tmp_path / "lists.jsonl", triplets), tokenizer, hard_negatives=True)
    (tmp_path / "lists.json").write_text(json.dumps(triplets, indent=1))
    assert _same(_pairs(tmp_path / "lists.json", tokenizer, hard_negatives=True), by_lines)
    assert _same(_pairs(write_jsonl(tmp_path / "list_lines.json", triplets), tokenizer, hard_negatives=True), by_lines)
    assert len(by_lines) == len(triplets)


@needs("hf")
def test_json_files_that_describe_a_dataset_are_no_shards_of_it(tmp_path: Path, tokenizer) -> None:
    """In a folder of shards, a Hugging Face repository's `dataset_infos.json` is no data, nor any `.json` file beside
    shards of another format (a `shards.json`, statistics); a folder of `.json` shards reads them."""
    rows = bge_rows()
    plain = _pairs(write_jsonl(tmp_path / "bge.jsonl", rows), tokenizer, negatives_per_row=2)
    for folder, suffix in (("lines", ".jsonl"), ("arrays", ".json")):
        (tmp_path / folder).mkdir()
        for n in range(2):
            (tmp_path / folder / f"train-{n}{suffix}").write_text(
                "".join(json.dumps(r) + "\n" for r in rows[n * 3 : (n + 1) * 3])
                if suffix == ".jsonl"
                else json.dumps(rows[n * 3 : (n + 1) * 3], indent=1)
            )
        (tmp_path / folder / "dataset_infos.json").write_text(json.dumps({"default": {"features": {}}}, indent=2))
    (tmp_path / "lines" / "shards.json").write_text(json.dumps({"shards": 2}, indent=2))
    for folder in ("lines", "arrays"):
        assert _same(_pairs(tmp_path / folder, tokenizer, negatives_per_row=2), plain, epochs=2), folder


@needs("hf")
def test_json_vl_pairs_sts_and_corpus(tmp_path: Path) -> None:
    from titan_contrastive.components.sts_eval import load_sts
    from titan_contrastive.datasets import corpus
    from titan_contrastive.datasets.vl_pairs import VLPairsDataset

    vl_rows = [{"query_text": f"query {i}", "doc_text": f"document {i}"} for i in range(5)]
    (tmp_path / "vl.json").write_text(json.dumps(vl_rows, indent=2))
    vl_json, vl_lines = (
        VLPairsDataset(split="train", path=str(p), mode="t2t")
        for p in (tmp_path / "vl.json", write_jsonl(tmp_path / "vl.jsonl", vl_rows))
    )
    assert [vl_json._fields(0, i) for i in range(5)] == [vl_lines._fields(0, i) for i in range(5)] == vl_rows

    sts = [
        {"sentence1": "a cat", "sentence2": "a kitten", "score": 4.5},
        {"sentence1": "a", "sentence2": "b", "score": 0},
    ]
    (tmp_path / "sts.json").write_text(json.dumps(sts))
    assert load_sts(str(tmp_path / "sts.json")) == load_sts(str(write_jsonl(tmp_path / "sts.jsonl", sts)))
    assert load_sts(str(tmp_path / "sts.json")).scores == [4.5, 0.0]

    docs = [{"_id": f"d{i}", "text": f"text {i}"} for i in range(50)]  # BEIR's columns, as a JSON array
    (tmp_path / "corpus.json").write_text(json.dumps(docs, indent=1))
    texts = corpus.corpus_texts(str(tmp_path / "corpus.json"), {"d0", "d49"}, {}, "data.corpus")
    assert texts == {"d0": "text 0", "d49": "text 49"}


_CORPORA = [".json", ".json array", ".jsonl.bz2", ".jsonl.xz", ".jsonl.zst", ".json.zst"]


@needs("data")
@pytest.mark.parametrize("arrow", [True, False])
@pytest.mark.parametrize("kind", _CORPORA)
def test_a_corpus_of_each_kind_by_arrow_and_by_lines(tmp_path: Path, monkeypatch, kind: str, arrow: bool) -> None:
    """A corpus as JSON (lines or an array) and as compressed JSON lines gives the plain `.jsonl` file's documents;
    JSON lines are matched by Arrow from `ARROW_JSON_BYTES` (pyarrow decompresses bzip2 and Zstandard, xz comes
    decompressed by Python), an array a line reader's way (`tables`); which reader ran is checked, not assumed."""
    from titan_contrastive.datasets import corpus

    docs = [{"_id": f"d{i}", "title": f"title {i}" if i % 2 else None, "text": f"text {i}"} for i in range(500)]
    wanted = {f"d{i}" for i in (0, 3, 250, 499)}
    plain = write_jsonl(tmp_path / "corpus.jsonl", docs)
    monkeypatch.setattr(corpus, "ARROW_JSON_BYTES", 1 << 40)  # the plain file: the line reader, the reference
    want = corpus.corpus_texts(str(plain), wanted, {}, "data.corpus")
    assert want == {f"d{i}": f"title {i} text {i}" if i % 2 else f"text {i}" for i in (0, 3, 250, 499)}

    if kind == ".json array":
        file = tmp_path / "corpus.json"
        file.write_text(json.dumps(docs, indent=1))
    else:
        file = write_jsonl(tmp_path / f"corpus.{kind.split('.')[1]}", docs)
        for compression in kind.split(".")[2:]:
            file = compressed(file, f".{compression}")
    read_alone: list[Path] = []
    opened = corpus.opened_rows
    monkeypatch.setattr(corpus, "opened_rows", lambda f, *a: (read_alone.append(f), opened(f, *a))[1])
    monkeypatch.setattr(corpus, "ARROW_JSON_BYTES", 0 if arrow else 1 << 40)
    assert corpus.corpus_texts(str(file), wanted, {}, "data.corpus") == want
    assert read_alone == ([] if arrow and kind != ".json array" else [file])


@needs("hf")
@pytest.mark.parametrize("suffix", [".bz2", ".xz", ".zst"])
def test_compressed_files_serve_what_the_plain_files_serve(tmp_path: Path, tokenizer, suffix: str) -> None:
    from titan_contrastive.components.sts_eval import load_sts
    from titan_contrastive.datasets.vl_pairs import VLPairsDataset

    bge = write_jsonl(tmp_path / "bge.jsonl", bge_rows())
    plain = _pairs(bge, tokenizer, negatives_per_row=2)
    assert _same(_pairs(compressed(bge, suffix), tokenizer, negatives_per_row=2), plain, epochs=2)
    array = tmp_path / "bge.json"
    array.write_text(json.dumps(bge_rows(), indent=1))
    assert _same(_pairs(compressed(array, suffix), tokenizer, negatives_per_row=2), plain, epochs=2)

    triplets = _triplets()
    csv_file = tmp_path / "triplets.csv"
    csv_file.write_text("anchor,positive,negative\n" + "".join(",".join(row) + "\n" for row in triplets))
    from_csv = _pairs(compressed(csv_file, suffix), tokenizer, hard_negatives=True)
    assert _same(from_csv, _pairs(csv_file, tokenizer, hard_negatives=True)) and len(from_csv) == len(triplets)

    ids = {t: 7 + n for n, t in enumerate(dict.fromkeys(t for row in triplets for t in row[1:]))}
    by_id = write_jsonl(tmp_path / "ids.jsonl", [{"q": q, "pos": ids[p], "neg": ids[n]} for q, p, n in triplets])
    collection = tmp_path / "collection.tsv"  # MS MARCO's: unnamed id<TAB>text lines
    collection.write_text("".join(f"{i}\t{t}\n" for t, i in ids.items()))
    columns = {"columns": ["q", "pos", "neg"], "hard_negatives": True}
    assert _same(_pairs(by_id, tokenizer, corpus=str(compressed(collection, suffix)), **columns), from_csv)

    vl = tmp_path / "vl.tsv"
    vl.write_text("query_text\tdoc_text\n" + "".join(f"query {i}\tdocument {i}\n" for i in range(5)))
    vl_packed, vl_plain = (VLPairsDataset(split="train", path=str(p), mode="t2t") for p in (compressed(vl, suffix), vl))
    assert [vl_packed._fields(0, i) for i in range(5)] == [vl_plain._fields(0, i) for i in range(5)]
    assert vl_packed._fields(0, 4) == {"query_text": "query 4", "doc_text": "document 4"}
    sts = tmp_path / "sts.csv"
    sts.write_text("sentence1,sentence2,score\na cat,a kitten,4.5\na cat,the stock market,0.2\n")
    assert load_sts(str(compressed(sts, suffix))) == load_sts(str(sts)) and load_sts(str(sts)).scores == [4.5, 0.2]


@needs("data")
@pytest.mark.parametrize("name", ["rows.json", "rows.jsonl.bz2", "rows.jsonl.xz", "rows.jsonl.zst"])
def test_json_and_compressed_files_as_hugging_face_data(tmp_path: Path, hf_cache, name: str) -> None:
    """data.dataset='hf' reads a JSON array and compressed JSON lines (`hf_disk.open_hf_dataset`) as the plain
    JSON lines: the same rows."""
    from titan_contrastive.datasets.hf_disk import open_hf_dataset

    rows = [{"image": f"img/{i}.png", "caption": f"a caption {i}"} for i in range(4)]
    plain = write_jsonl(tmp_path / "plain.jsonl", rows)
    if name == "rows.json":
        file = tmp_path / name
        file.write_text(json.dumps(rows, indent=2))
    else:
        file = compressed(write_jsonl(tmp_path / name.rsplit(".", 1)[0], rows), "." + name.rsplit(".", 1)[1])
    assert open_hf_dataset(str(file), "train").to_list() == open_hf_dataset(str(plain), "train").to_list() == rows


def test_errors_in_one_line(tmp_path: Path, monkeypatch) -> None:
    from titan_contrastive.datasets.pair_rows import read_rows

    def fails(path: Path, *needles: str) -> None:
        with pytest.raises(DataError) as err:
            read_rows(str(path), (), "", 0.0, "train", "", False, {}, False)
        _one_line(err, *needles)

    (tmp_path / "object.json").write_text(json.dumps({"data": [{"query": "q", "positive": "p"}]}, indent=2))
    fails(tmp_path / "object.json", "object.json:1: not a JSON line (", "or one JSON array of them")
    (tmp_path / "strings.json").write_text(json.dumps([{"query": "q", "positive": "p"}, "p2"]))
    fails(tmp_path / "strings.json", "strings.json: row 2 of its JSON array is a str; write each row as an object")
    (tmp_path / "cut.json").write_text('[\n {"query": "q", "positive": "p"},\n {"query": "q2", "pos')
    fails(tmp_path / "cut.json", "cut.json: neither one JSON array of rows nor JSON lines (row 2: Unterminated string")
    (tmp_path / "fake.jsonl.xz").write_text(json.dumps({"query": "q", "positive": "p"}) + "\n")
    fails(tmp_path / "fake.jsonl.xz", "fake.jsonl.xz: not a readable jsonl file (LZMAError")
    (tmp_path / "fake.jsonl.zst").write_text(json.dumps({"query": "q", "positive": "p"}) + "\n")
    if installed("data"):
        fails(tmp_path / "fake.jsonl.zst", "fake.jsonl.zst: not a readable jsonl file (ZstdError")
    from titan_contrastive.components.sts_eval import load_sts
    from titan_contrastive.datasets.sources import CsvSource

    for suffix in (".bz2", ".xz", ".zst") if installed("data") else (".bz2", ".xz"):  # an image-text CSV, STS pairs
        fake = tmp_path / f"fake.csv{suffix}"
        fake.write_text("filepath\ttitle\na.png\ta caption\n")
        for read in (CsvSource, load_sts):
            with pytest.raises(DataError) as err:
                read(str(fake))
            _one_line(err, f"fake.csv{suffix}: not ")
            assert "readable" in str(err.value)
    monkeypatch.setitem(sys.modules, "zstandard", None)  # as without the [data] extra
    fails(
        tmp_path / "fake.jsonl.zst",
        "fake.jsonl.zst (Zstandard) needs zstandard: pip install -e '.[data]' (or give it gzipped)",
    )
    fails(
        tmp_path / "notes.md.xz",
        "not an existing .jsonl/.json/.csv/.tsv/.txt/.parquet/.arrow (the text ones also compressed: .jsonl.gz, .bz2, "
        ".xz, .zst) file or save_to_disk folder",
    )


@pytest.mark.parametrize("suffix", [".gz", ".xz"])
def test_a_beir_folder_of_compressed_corpus_and_queries(tmp_path: Path, suffix: str) -> None:
    """BeIR's Hugging Face repositories hold `corpus.jsonl.gz` and `queries.jsonl.gz`: the folder is a BEIR folder,
    read as the plain one (evaluation, its splits, its judged pairs); a damaged one is a one-line error."""
    import gzip

    from tests.test_retrieval_metrics import write_beir
    from titan_contrastive.datasets.beir_folder import beir_splits, is_beir_folder, judged_pairs, read_beir

    plain, packed = write_beir(tmp_path / "plain"), write_beir(tmp_path / "packed")
    for name in ("corpus.jsonl", "queries.jsonl"):
        data = (packed / name).read_bytes()
        (packed / (name + suffix)).write_bytes(gzip.compress(data) if suffix == ".gz" else lzma.compress(data))
        (packed / name).unlink()
    assert is_beir_folder(packed) and beir_splits(packed, "*") == ["test"]
    assert read_beir(packed) == read_beir(plain) and len(read_beir(plain).corpus_ids) == 7
    assert judged_pairs(packed, "test") == judged_pairs(plain, "test")
    (packed / f"corpus.jsonl{suffix}").write_bytes(b"not compressed\n")
    with pytest.raises(DataError) as err:
        read_beir(packed)
    _one_line(err, f"corpus.jsonl{suffix}: not readable (")


@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_a_json_array_is_read_a_row_at_a_time(tmp_path: Path, monkeypatch, chunk: int) -> None:
    """A JSON array's rows, read through windows of `chunk` characters (rows and strings cut at every place, white
    space, escapes and non-ASCII text inside), are the rows `json.loads` gives, each served before the file is read
    to its end; an array that is not one is one line naming the row."""
    from titan_contrastive.datasets import tables

    monkeypatch.setattr(tables, "JSON_CHUNK", chunk)
    rows = [{"query": f'q {i} \u00e9\u4e2d \\"x\\"', "pos": [f"p {i}", "]"], "n": i} for i in range(40)] + [["a", "b"]]
    file = tmp_path / "rows.json"
    file.write_text(
        "  \n[" + ",\n\t ".join(json.dumps(r, ensure_ascii=i % 2 == 0) for i, r in enumerate(rows)) + "]\n "
    )
    _, read = tables.table_rows(file, (), "train")
    assert next(read) == rows[0]
    assert [rows[0], *read] == json.loads(file.read_text())
    assert list(tables.table_rows(_write(tmp_path / "empty.json", "[ ]"), (), "train")[1]) == []
    for text, needle in [
        ('[{"a": 1}, {"a": 2}] {"a": 3}', "(more follows its closing ])"),
        ('[{"a": 1} {"a": 2}]', "(row 1 is followed by '{', not a comma)"),
        ('[{"a": 1}, {"a": 2}', "(it ends before its closing ])"),
        ('[{"a": 1}, {"a": 2,}]', "(row 2: Expecting property name enclosed in double quotes)"),
        ('[{"a": 1},]', "(row 2: Expecting value)"),
    ]:
        with pytest.raises(DataError) as err:
            list(tables.table_rows(_write(tmp_path / "bad.json", text), (), "train")[1])
        _one_line(err, "bad.json: neither one JSON array of rows nor JSON lines " + needle)


def _write(file: Path, text: str) -> Path:
    file.write_text(text)
    return file
