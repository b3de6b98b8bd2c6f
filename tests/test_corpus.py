"""Documents by id (`data.corpus`, `datasets/corpus.py`): rows that name their documents by id serve what rows of
those documents' texts serve.

- tevatron's rows of ids (`query_text`, `positive_document_ids`, `negative_document_ids`) against its corpus
  (`docid`, `title`, `text`), ids as texts and integers: the batches of FlagEmbedding's rows of the same texts,
  epoch after epoch of draws; only the documents the rows name are kept, each text held once;
- named columns of ids against the other corpus forms (MS MARCO's collection.tsv, an unnamed id-title-text TSV,
  BEIR's `_id` rows, CSV, a folder of Parquet shards): the batches of the text triplets;
- the errors, one line each: rows of ids without a corpus, a corpus that is not there, rows without an id or a
  text, an id given two texts, a corpus that holds none of them, too many rows naming documents it does not hold
  (fewer: skipped and counted), a corpus for data that is not text pairs;
- a run trains on rows of ids through the trainer and evaluates on held-out rows of ids;
- a retrieval set's folder (BEIR's corpus.jsonl, queries.jsonl, qrels/) as data.path: its split's judged pairs
  serve as the rows of those texts with the documents' ids (a score-0 judgement left out; of the corpus only the
  judged documents read into memory), each query's relevant documents as its positives under
  data.negatives_per_row (refused in one line: the qrels name no negatives).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from tests.needs import needs, require
from tests.test_negative_pools import _equal, bge_rows, write_jsonl
from tests.test_pairs_data import _one_line
from titan_contrastive.datasets import DataError
from titan_contrastive.datasets.beir_folder import read_beir
from titan_contrastive.datasets.corpus import corpus_texts
from titan_contrastive.datasets.pairs import PairsDataset


@pytest.fixture(scope="module")
def tokenizer():
    from titan_contrastive.models.bi_encoder import BiEncoderArgs, build_tokenizer

    return build_tokenizer(BiEncoderArgs())


def _docids(rows: list[dict]) -> dict[str, str | int]:
    """An id per distinct document text of FlagEmbedding's `rows`: integers and texts in turn."""
    texts = dict.fromkeys(t for r in rows for t in r["pos"] + r["neg"])
    return {t: n if n % 2 else f"d{n}" for n, t in enumerate(texts)}


def _tevatron(rows: list[dict], ids: dict[str, str | int]) -> list[dict]:
    return [
        {
            "query_id": f"q{r}",
            "query_text": row["query"],
            "positive_document_ids": [ids[t] for t in row["pos"]],
            "negative_document_ids": [ids[t] for t in row["neg"]],
        }
        for r, row in enumerate(rows)
    ]


def _tevatron_corpus(ids: dict[str, str | int], extra: int = 5) -> list[dict]:
    """tevatron's corpus rows of `ids`' documents (some split into a title and a text), shuffled, with `extra`
    documents no row names."""
    docs = []
    for n, (text, ident) in enumerate(reversed(ids.items())):
        title, _, body = text.partition(" ")
        docs.append({"docid": ident, "title": title, "text": body} if n % 3 else {"docid": ident, "text": text})
    return docs + [{"docid": f"x{i}", "text": f"a passage no row names {i}"} for i in range(extra)]


def _dataset(path: Path, tokenizer, **kw) -> PairsDataset:
    return PairsDataset(split="train", path=str(path), tokenizer=tokenizer, query_length=12, seed=5, **kw)


@needs("hf")
def test_tevatron_rows_of_ids_serve_the_texts_of_their_corpus(tmp_path: Path, tokenizer, caplog) -> None:
    rows = bge_rows()
    ids = _docids(rows)
    train = write_jsonl(tmp_path / "train.jsonl", _tevatron(rows, ids))
    corpus = write_jsonl(tmp_path / "corpus.jsonl", _tevatron_corpus(ids))
    with caplog.at_level("INFO", logger="titan_contrastive"):
        by_id = _dataset(train, tokenizer, negatives_per_row=3, corpus=str(corpus))
    assert "tevatron's rows of document ids: query_text, positive_document_ids" in caplog.text
    assert f"data.corpus={corpus}: {len(ids)} of the {len(ids)} documents the rows name" in caplog.text
    flag = _dataset(
        write_jsonl(tmp_path / "bge.jsonl", [{k: r[k] for k in ("query", "pos", "neg")} for r in rows]),
        tokenizer,
        negatives_per_row=3,
    )
    for epoch in range(3):
        by_id.set_epoch(epoch)
        flag.set_epoch(epoch)
        assert _equal(by_id.__getitems__(list(range(6))), flag.__getitems__(list(range(6)))), epoch
    seen = {text: text for text in ids}
    wanted = {str(ids[t]) for t in list(ids)[:4]}
    texts = corpus_texts(str(corpus), wanted, seen, "data.corpus")
    assert set(texts) == wanted  # the corpus's other documents are not kept
    assert all(texts[str(ids[t])] is seen[t] for t in list(ids)[:4])  # each text one object, the rows' own


def _triplets(rows: list[dict]) -> list[tuple[str, str, str]]:
    return [(r["query"], r["pos"][0], r["neg"][0]) for r in rows]


@needs("hf")
@pytest.mark.parametrize("form", ["collection.tsv", "titled.tsv", "beir.jsonl", "titled.csv", "parquet shards"])
def test_named_columns_of_ids_against_each_corpus_form(tmp_path: Path, tokenizer, form: str) -> None:
    triplets = _triplets(bge_rows())
    texts = dict.fromkeys(t for row in triplets for t in row[1:])
    ids = {t: 100 + n for n, t in enumerate(texts)}
    rows = [{"q": q, "pos": ids[p], "neg": str(ids[n])} for q, p, n in triplets]  # an id as an integer or a text
    train = write_jsonl(tmp_path / "ids.jsonl", rows)
    if form == "collection.tsv":
        corpus = tmp_path / form
        corpus.write_text("".join(f"{i}\t{t}\n" for t, i in ids.items()))
    elif form == "titled.tsv":  # tevatron's corpus.tsv: id, title, text
        corpus = tmp_path / form
        corpus.write_text("".join(f"{i}\t{t.replace(' ', chr(9), 1)}\n" for t, i in ids.items()))
    elif form == "beir.jsonl":
        corpus = write_jsonl(tmp_path / form, [{"_id": str(i), "title": "", "text": t} for t, i in ids.items()])
    elif form == "titled.csv":
        corpus = tmp_path / form
        with open(corpus, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["id", "title", "text"])
            out.writerows([i, t.split(" ", 1)[0], t.split(" ", 1)[1]] for t, i in ids.items())
    else:
        require("data")
        import pyarrow as pa
        import pyarrow.parquet as pq

        corpus = tmp_path / "shards"
        corpus.mkdir()
        docs = [{"docid": str(i), "contents": t} for t, i in ids.items()]
        for s in range(2):
            pq.write_table(pa.Table.from_pylist(docs[s::2]), corpus / f"part-{s}.parquet")
    by_id = _dataset(train, tokenizer, columns=["q", "pos", "neg"], corpus=str(corpus))
    plain = _dataset(write_jsonl(tmp_path / "texts.jsonl", [dict(zip("abc", t)) for t in triplets]), tokenizer)
    assert len(by_id) == len(plain) == len(triplets)
    assert _equal(by_id.__getitems__(list(range(6))), plain.__getitems__(list(range(6))))


@needs("data")
@pytest.mark.parametrize("form", ["parquet of integer ids", "parquet of padded dictionary ids", "saved dataset"])
def test_an_arrow_corpus_gives_the_wanted_documents_from_every_batch(tmp_path: Path, form: str) -> None:
    """A Parquet file or saved dataset is filtered by its id column before its rows are read (`corpus._wanted_rows`):
    the wanted documents of 9,000 rows in row groups of 1,000 (saved dataset: `tables.BATCH` rows a batch), ids as
    integers or as padded dictionary-encoded texts (not ASCII), are those the definition gives (title, a space,
    text); a wanted id given another text at the last row is the two-texts error naming that row; a table without a
    text column is the error of its first row; ids of another type (a float column) name no document, as a JSON
    corpus of them does."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 9000
    ids: list = list(range(n)) if "integer" in form else [f" dé{i} " for i in range(n)]
    titles, bodies = [f"title {i}" if i % 3 else "" for i in range(n)], [f"the text of {i}" for i in range(n)]

    def table(ids: list, titles: list[str], bodies: list[str]) -> pa.Table:
        column = pa.array(ids).dictionary_encode() if "dictionary" in form else pa.array(ids)
        return pa.table({"docid": column, "title": titles, "text": bodies})

    path = tmp_path / ("corpus" if form == "saved dataset" else "corpus.parquet")
    if form == "saved dataset":
        datasets.Dataset(table(ids, titles, bodies)).save_to_disk(str(path))
    else:
        pq.write_table(table(ids, titles, bodies), path, row_group_size=1000)
    picked = [3, 999, 1000, 4095, 4096, 5500, 8999]
    wanted = {str(ids[i]).strip() for i in picked} | {"not there"}
    want = {str(ids[i]).strip(): f"{titles[i]} {bodies[i]}".strip() for i in picked}
    assert corpus_texts(str(path), wanted, {}, "data.corpus") == want
    again = table([*ids, ids[999]], [*titles, ""], [*bodies, "another"])
    pq.write_table(again, tmp_path / "twice.parquet", row_group_size=1000)
    with pytest.raises(DataError) as err:
        corpus_texts(str(tmp_path / "twice.parquet"), wanted, {}, "data.corpus")
    _one_line(err, f"document {str(ids[999]).strip()!r} is given two texts", f"row {n + 1} differs")
    pq.write_table(pa.table({"docid": ["d3"], "body": ["x"]}), tmp_path / "bodies.parquet")
    with pytest.raises(DataError) as err:
        corpus_texts(str(tmp_path / "bodies.parquet"), wanted, {}, "data.corpus")
    _one_line(err, "row 1: a corpus row holds an id", "its columns are docid, body")
    floats = pa.table({"id": pa.array([float(i) for i in range(10)]), "text": [f"t{i}" for i in range(10)]})
    pq.write_table(floats, tmp_path / "floats.parquet")
    write_jsonl(tmp_path / "floats.jsonl", floats.to_pylist())
    assert corpus_texts(str(tmp_path / "floats.parquet"), {"1", "1.0"}, {}, "data.corpus") == {}
    assert corpus_texts(str(tmp_path / "floats.jsonl"), {"1", "1.0"}, {}, "data.corpus") == {}


def _defined(lines: list[str], wanted: set[str]) -> dict[str, str]:
    """The wanted documents of JSON lines by the module docstring's definition, each line read alone: the id of the
    first of docid, _id, id a row has (a text trimmed, or an integer), the text of the first of text, contents, after
    the title and a space where the title is a text."""
    out = {}
    for line in lines:
        if line.strip():
            row = json.loads(line.removeprefix("\ufeff"))
            ident = next(row[c] for c in ("docid", "_id", "id") if c in row)
            ident = str(ident).strip() if type(ident) in (int, str) else ""
            body, title = next(row[c] for c in ("text", "contents") if c in row), row.get("title")
            text = f"{title.strip()} {body.strip()}" if isinstance(title, str) and title.strip() else (body or "")
            if ident in wanted and text.strip():
                out[ident] = text.strip()
    return out


@needs("data")
def test_a_json_lines_corpus_is_chosen_by_its_id_column_in_arrow(tmp_path: Path, monkeypatch) -> None:
    """JSON lines that Arrow reads as one table are filtered by their id column there (`corpus._json_batches`),
    never read a line at a time: of 3,000 rows in blocks of 4 KiB (ids padded non-ASCII texts or integers; titles
    absent, null or given; blank lines; a nested column; a byte-order mark), the wanted documents are the
    definition's. Lines that are
    not one table to Arrow are read a line at a time and give the definition's documents or the line reader's error:
    an integer id blocks after text ids, a wanted row's text under `contents` beside `text` rows, an id given as null
    (the next row's under `id`); a later row without an id, and a line that is no JSON, fail as they did. A file
    under `corpus.ARROW_JSON_BYTES`, or with a pyarrow without `pyarrow.json.open_json`, is read a line
    at a time."""
    from titan_contrastive.datasets import corpus

    monkeypatch.setattr(corpus, "STREAM_BYTES", 4096)
    monkeypatch.setattr(corpus, "ARROW_JSON_BYTES", 0)  # every file by Arrow (a smaller one: the end)
    read_alone: list[Path] = []
    opened = corpus.opened_rows
    monkeypatch.setattr(corpus, "opened_rows", lambda file, *a: (read_alone.append(file), opened(file, *a))[1])

    def row(i: int, integer: bool) -> dict:
        out: dict = {"_id": i if integer else f"  dé{i} ", "text": f" the text of {i} ", "meta": {"n": [i, i]}}
        if i % 3:
            out["title"] = None if i % 3 == 1 else f"title {i}"
        return out

    def lines(integer: bool, changed: dict[int, object] | None = None, bom: bool = False) -> list[str]:
        rows = [json.dumps(changed.get(i, row(i, integer)) if changed else row(i, integer)) for i in range(3000)]
        rows[10:10] = ["", "   "]
        return [("\ufeff" if bom else "") + rows[0], *rows[1:]]

    def read(name: str, text: list[str]) -> dict[str, str]:
        (tmp_path / name).write_text("\n".join(text) + "\n", encoding="utf-8")
        return corpus_texts(str(tmp_path / name), wanted, {}, "data.corpus")

    picked = [0, 1, 2, 9, 10, 11, 500, 1234, 2500, 2999]
    for integer, bom in ((False, False), (True, False), (False, True)):
        wanted = {str(i) if integer else f"dé{i}" for i in picked} | {"not there"}
        text = lines(integer, bom=bom)
        assert read("whole.jsonl", text) == _defined(text, wanted) and len(_defined(text, wanted)) == len(picked)
        assert read_alone == []
    wanted = {f"dé{i}" for i in picked} | {"2500", "11"}
    cases = {
        "integer.jsonl": lines(False, {2500: {"_id": 2500, "text": "an integer's text"}}),
        "contents.jsonl": lines(False, {11: {"_id": "dé11", "contents": "contents, not text"}}),
        "null.jsonl": lines(False, {20: {"_id": None, "text": "no id"}, 21: {"id": "11", "text": "under id"}}),
    }
    for name, text in cases.items():
        got = read(name, text)
        assert got == _defined(text, wanted) and got and read_alone[-1] == tmp_path / name, name
    with pytest.raises(DataError) as err:
        read("no_id.jsonl", lines(False, {2000: {"key": "x", "text": "t"}}))
    _one_line(err, "row 2001: a corpus row holds an id", "its columns are key, text")
    with pytest.raises(DataError) as err:
        read("broken.jsonl", [*lines(False)[:2000], "{not json"])
    _one_line(err, "broken.jsonl:2001: not a JSON line")
    monkeypatch.setattr(corpus, "ARROW_JSON_BYTES", (tmp_path / "whole.jsonl").stat().st_size + 1)
    text = lines(False)
    assert read("whole.jsonl", text) == _defined(text, wanted) and read_alone[-1] == tmp_path / "whole.jsonl"
    import pyarrow.json

    monkeypatch.setattr(corpus, "ARROW_JSON_BYTES", 0)
    monkeypatch.delattr(pyarrow.json, "open_json")  # a pyarrow without its streaming JSON reader
    assert read("old.jsonl", text) == _defined(text, wanted) and read_alone[-1] == tmp_path / "old.jsonl"


@needs("hf")
def test_errors_in_one_line_and_rows_of_unknown_documents(tmp_path: Path, tokenizer, caplog) -> None:
    rows = bge_rows()
    ids = _docids(rows)
    train = write_jsonl(tmp_path / "train.jsonl", _tevatron(rows, ids))
    corpus = _tevatron_corpus(ids)

    def fails(path: Path, docs: list[dict] | str, *needles: str) -> None:
        """`path`'s rows against a corpus of `docs` (rows, or a TSV's text) fail in one line naming `needles`."""
        where = write_jsonl(tmp_path / "c.jsonl", docs) if isinstance(docs, list) else tmp_path / "c.tsv"
        if isinstance(docs, str):
            where.write_text(docs)
        with pytest.raises(DataError) as err:
            _dataset(path, tokenizer, negatives_per_row=3, corpus=str(where))
        _one_line(err, *needles)

    with pytest.raises(DataError) as err:
        _dataset(train, tokenizer, negatives_per_row=3)
    _one_line(err, "name their documents by id", "set data.corpus")
    with pytest.raises(DataError) as err:
        _dataset(train, tokenizer, negatives_per_row=3, corpus=str(tmp_path / "missing.jsonl"))
    _one_line(err, f"data.corpus={tmp_path / 'missing.jsonl'}: not an existing")
    bare = [{k: v for k, v in r.items() if k != "query_text"} for r in _tevatron(rows, ids)]
    bare = write_jsonl(tmp_path / "bare.jsonl", bare)
    fails(bare, corpus, "hold no query_text or query column")
    fails(train, [{"docid": 1, "body": "x"}], "row 1: a corpus row holds an id", "its columns are docid, body")
    fails(train, "1\ta\tb\tc\n", "row 1: an unnamed corpus row is id, text or id, title, text", "has 4 fields")
    twice = corpus + [{"docid": corpus[0]["docid"], "text": "another text"}]
    fails(train, twice, f"document {str(corpus[0]['docid'])!r} is given two texts", f"row {len(twice)}")
    fails(train, [{"docid": "elsewhere", "text": "t"}], f"holds none of the {len(ids)} documents the rows name")
    lost = {ids[rows[1]["neg"][0]], ids[rows[4]["pos"][0]]}  # two rows' documents
    partial = [d for d in corpus if d["docid"] not in lost]
    fails(train, partial, "2 of its 6 rows name a document that data.corpus=", "data.max_bad_fraction")
    write_jsonl(tmp_path / "c.jsonl", partial)
    with caplog.at_level("WARNING", logger="titan_contrastive"):
        ds = _dataset(train, tokenizer, negatives_per_row=3, corpus=str(tmp_path / "c.jsonl"), max_bad_fraction=0.5)
    assert len(ds) == 4 and ds.skipped == {"unknown_document": 2}
    assert "2 row(s) name a document not in data.corpus" in caplog.text


@needs("hf")
def test_a_run_trains_on_rows_of_ids_and_evaluates(tmp_path: Path) -> None:
    from tests.test_trainer import make_trainer

    rows = bge_rows()
    ids = _docids(rows)
    train = write_jsonl(tmp_path / "train.jsonl", _tevatron(rows, ids))
    corpus = write_jsonl(tmp_path / "corpus.jsonl", _tevatron_corpus(ids))
    common = ("--model.name=bi_encoder", "--model.flavor=shared", f"--data.corpus={corpus}")
    with pytest.raises(DataError) as err:
        make_trainer(str(tmp_path / "wordnet"), *common, "--data.dataset=wordnet")
    _one_line(
        err, f"data.corpus={str(corpus)!r} holds the documents of rows of ids", "data.dataset='pairs' or 'vl_pairs'"
    )
    trainer = make_trainer(
        str(tmp_path / "run"),
        *common,
        "--data.dataset=pairs",
        f"--data.path={train}",
        f"--data.val_path={train}",
        "--data.negatives_per_row=2",
        "--data.context_length=16",
        "--training.local_batch_size=3",
        "--training.steps=2",
        "--eval.batch_size=4",
    )
    trainer.train()
    trainer.metrics.close()
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [row for row in logged if row["kind"] == "train"]
    assert train_rows[-1]["step"] == 2 and all(math.isfinite(row["loss"]) for row in train_rows)
    assert [row["num_samples"] for row in logged if row["kind"] == "eval"] == [6]


def test_the_embed_command_reads_rows_of_ids_as_their_texts(tmp_path: Path) -> None:
    """`python -m titan_contrastive.embed --corpus` (teacher embeddings written ahead) reads what a run reads."""
    from titan_contrastive.embed import read_rows

    rows = bge_rows()
    ids = _docids(rows)
    train = write_jsonl(tmp_path / "train.jsonl", _tevatron(rows, ids))
    corpus = write_jsonl(tmp_path / "corpus.jsonl", _tevatron_corpus(ids))
    flag = write_jsonl(tmp_path / "bge.jsonl", [{k: r[k] for k in ("query", "pos", "neg")} for r in rows])
    assert read_rows(str(train), [], str(corpus)) == read_rows(str(flag), []) != []


def _beir_folder(folder: Path, rows: list[dict], ids: dict[str, str | int]) -> Path:
    """BEIR's files of FlagEmbedding's `rows`: every document in the corpus (some with a title), each query's
    positives judged relevant in `train` (and one negative judged 0), the first two queries' first positives in
    `test`."""
    folder.mkdir()
    docs = []
    for text, ident in ids.items():
        title, _, body = text.partition(" ")
        docs.append(
            {"_id": str(ident), "title": title, "text": body} if len(docs) % 2 else {"_id": str(ident), "text": text}
        )
    write_jsonl(folder / "corpus.jsonl", docs)
    write_jsonl(folder / "queries.jsonl", [{"_id": f"q{r}", "text": row["query"]} for r, row in enumerate(rows)])
    (folder / "qrels").mkdir()
    train = [(f"q{r}", ids[t], 1) for r, row in enumerate(rows) for t in row["pos"]] + [
        ("q0", ids[rows[0]["neg"][0]], 0)
    ]
    test = [(f"q{r}", ids[rows[r]["pos"][0]], 1) for r in range(2)]
    for split, judged in (("train", train), ("test", test)):
        lines = "".join(f"{q}\t{d}\t{score}\n" for q, d, score in judged)
        (folder / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + lines)
    return folder


@needs("hf")
def test_a_retrieval_sets_folder_serves_its_judged_pairs(tmp_path: Path, tokenizer, caplog) -> None:
    rows = bge_rows()
    ids = _docids(rows)
    folder = _beir_folder(tmp_path / "beir", rows, ids)
    with caplog.at_level("INFO", logger="titan_contrastive"):
        beir = _dataset(folder, tokenizer)
    pairs = [{"query": r["query"], "positive": t, "id": str(ids[t])} for r in rows for t in r["pos"]]
    assert f"the retrieval set's 'train' split, {len(pairs)} rows of its judged pairs" in caplog.text
    plain = _dataset(write_jsonl(tmp_path / "pairs.jsonl", pairs), tokenizer)
    assert len(beir) == len(plain) == len(pairs)
    assert _equal(beir.__getitems__(list(range(len(pairs)))), plain.__getitems__(list(range(len(pairs)))))
    held_out = PairsDataset(split="test", path=str(folder), tokenizer=tokenizer, query_length=12)
    assert len(held_out) == 2
    whole, judged = read_beir(folder, "train"), read_beir(folder, "train", judged_only=True)  # what the rows read
    named = {str(ids[t]) for r in rows for t in r["pos"]} | {str(ids[rows[0]["neg"][0]])}  # the score 0 one too
    assert set(judged.corpus_ids) == named < set(whole.corpus_ids) == {str(i) for i in ids.values()}
    assert (judged.queries, judged.qrels) == (whole.queries, whole.qrels)
    assert dict(zip(judged.corpus_ids, judged.corpus)).items() <= dict(zip(whole.corpus_ids, whole.corpus)).items()
    with open(folder / "corpus.jsonl", "a") as f:  # a document no qrels names is not read into a text by the rows
        f.write(json.dumps({"_id": "unjudged", "text": 5}) + "\n")
    assert len(_dataset(folder, tokenizer)) == len(pairs)
    with pytest.raises(DataError, match="`text`/`title` of 'unjudged' is not a string"):
        read_beir(folder, "train")  # which evaluation reads whole
    with pytest.raises(DataError) as err:
        _dataset(folder, tokenizer, negatives_per_row=3)
    _one_line(err, "6 of its 6 rows hold no hard negative to draw from")
    with pytest.raises(DataError) as err:
        _dataset(folder, tokenizer, columns=["query", "positive"])
    _one_line(err, "is a retrieval set (corpus, queries, qrels)", "leave it empty")
    with pytest.raises(DataError) as err:
        _dataset(folder, tokenizer, corpus=str(folder / "corpus.jsonl"))
    _one_line(err, "holds its own corpus", "leave data.corpus empty")
