"""`python -m titan_contrastive.mine --corpus FILE --ids`: hard negatives for rows that name their documents by id.

- What it mines is the definition's choice (`tests/test_mine.py`'s reference) for the rows' texts, the corpus's
  every document a candidate (an MS MARCO collection.tsv of unnamed `id, text` rows): the mined file's positives
  are the rows' own ids, its negatives the ids of the texts the reference selects (a text held under two ids: the
  first), a row whose positive the corpus lacks skipped, and a run with data.corpus reads it back to those texts;
  with `--keep-fewer --scores` the 1 to k negatives as a list of ids, a score each and the positive's.
- Bad input is one `error:` line naming the flag, exit 2, before the model is loaded and nothing written: `--ids`
  without `--corpus`, tevatron's rows of ids without `--ids`, rows whose positives the corpus lacks, a corpus row
  that is not `id, text`, a page model with `--ids`.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest

from tests.needs import needs

pytestmark = needs("hf", "data")


def write_corpus(path: Path, documents: dict[str, str]) -> Path:
    """MS MARCO's collection.tsv: `id<TAB>text` rows, no header."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f, delimiter="\t").writerows(documents.items())
    return path


def write_id_rows(path: Path, rows: list[tuple[str, str, list[str]]], ids: list[str]) -> Path:
    """tevatron's rows of ids (query_text, positive_document_ids, negative_document_ids) with an `id` each."""
    lines = [
        {"query_id": f"q{n}", "query_text": q, "positive_document_ids": [p], "negative_document_ids": negs, "id": i}
        for n, ((q, p, negs), i) in enumerate(zip(rows, ids))
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def corpus_and_rows(n: int) -> tuple[list[list[str]], dict[str, str], list[tuple[str, str, list[str]]]]:
    """(the rows' texts, the corpus {id: text}: each row's positive as `p<i>`, 30 other documents `d<j>` and each of
    their texts again as `e<j>` after them; the rows by id)."""
    from tests.hf_folders import WORDS
    from tests.test_mine import tiny_rows

    rows = tiny_rows(n)
    rng = random.Random(2)
    positives = {f"p{i}": row[1] for i, row in enumerate(rows)}
    others = {f"d{j}": " ".join(rng.sample(WORDS, 3)) for j in range(30)}
    documents = {**positives, **others, **{f"e{j}": others[f"d{j}"] for j in range(30)}}
    by_id = [(row[0], f"p{i}", [f"d{i % 30}"]) for i, row in enumerate(rows)]
    return rows, documents, by_id


@pytest.mark.parametrize("fewer", [False, True], ids=["k each", "keep-fewer"])
def test_id_rows_mine_the_definitions_negatives_and_are_written_as_ids(
    tmp_path: Path, capsys: pytest.CaptureFixture, fewer: bool
) -> None:
    from tests.test_mine import bi_encoder_step, check_mined, expected, mine, run_embedder
    from titan_contrastive.datasets.corpus import resolve_documents
    from titan_contrastive.datasets.pair_rows import read_rows
    from titan_contrastive.mining import write_rows

    step = bi_encoder_step(tmp_path, shared=True)
    rows, documents, by_id = corpus_and_rows(20)
    ids = [f"t{i}" for i in range(len(rows))]
    corpus = write_corpus(tmp_path / "collection.tsv", documents)
    unknown = ("a query whose positive is not there", "x0", ["d0"])  # a bad row, skipped: 1 of 21 is allowed
    src = write_id_rows(tmp_path / "rows.jsonl", [*by_id[:7], unknown, *by_id[7:]], [*ids[:7], "bad", *ids[7:]])
    out = tmp_path / "mined.jsonl"
    flags = ["--ids", f"--corpus={corpus}", "--negatives=2", "--range-max=100", "--relative-margin=0.01"]
    flags += ["--keep-fewer", "--scores"] if fewer else []
    assert mine(capsys, src, f"--model={step}", f"--out={out}", *flags) == (0, [])
    if fewer:  # a score for the positive and each negative, after them
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        assert all(len(line["scores"]) == 1 + len(line["negatives"]) for line in lines)
        assert any(len(line["negatives"]) == 2 for line in lines)

    written = read_rows(str(out), id_column="id", by_id=True, pooled=fewer)
    assert written.ids and all(row[1] == f"p{ids.index(i)}" for row, i in zip(written.texts, written.ids))
    negatives = {d for row in written.texts for d in row[2:]}
    assert negatives & {f"d{j}" for j in range(30)} and negatives <= set(documents) - {f"e{j}" for j in range(30)}
    as_texts = tmp_path / "as_texts.jsonl"
    texts = [[r[0], *(documents[d] for d in r[1:])] for r in written.texts]
    if fewer:
        write_rows(
            as_texts,
            ["anchor", "positive", "negatives", "id"],
            [[*t[:2], t[2:], i] for t, i in zip(texts, written.ids)],
        )
    else:
        write_rows(
            as_texts,
            ["anchor", "positive", "negative_1", "negative_2", "id"],
            [[*t, i] for t, i in zip(texts, written.ids)],
        )
    embed, seen, _, _ = run_embedder(step)
    want = expected(rows, embed, k=2, skip=0, margin=0.01, extra=list(documents.values()), fewer=fewer)
    score = lambda q, d: float(seen["query"][q] @ seen["doc"][d])  # noqa: E731
    assert check_mined(as_texts, rows, ids, want, score, pooled=fewer) >= 15

    (run_rows,) = resolve_documents([written], [str(out)], str(corpus), {}, 0.001)  # what data.corpus reads
    assert run_rows.texts == texts


@pytest.mark.parametrize(
    "case, named",
    [
        ("ids without corpus", "error: --ids: the rows' documents are ids into a corpus; give its file with --corpus"),
        ("id rows without --ids", "(embed: --corpus; mine: --corpus with --ids)"),
        ("positives not in the corpus", "rows name a document that --corpus="),
        ("corpus rows of four fields", "an unnamed corpus row is id, text or id, title, text, and this one has 4"),
        ("no corpus file", "--corpus=<tmp>/absent.tsv: not an existing"),
    ],
)
def test_bad_input_is_one_line_before_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture, case: str, named: str
) -> None:
    from tests.test_mine import mine

    _, documents, by_id = corpus_and_rows(20)
    corpus = write_corpus(tmp_path / "collection.tsv", documents)
    if case == "positives not in the corpus":
        by_id = [(q, p.replace("p", "x"), negs) for q, p, negs in by_id]
    if case == "corpus rows of four fields":
        corpus.write_text("".join(f"{k}\ta\tb\t{v}\n" for k, v in documents.items()))
    src = write_id_rows(tmp_path / "rows.jsonl", by_id, [f"t{i}" for i in range(len(by_id))])
    flags = {
        "ids without corpus": ["--ids"],
        "id rows without --ids": [f"--corpus={corpus}"],
        "no corpus file": ["--ids", f"--corpus={tmp_path / 'absent.tsv'}"],
    }.get(case, ["--ids", f"--corpus={corpus}"])
    before = sorted(p.name for p in tmp_path.iterdir())
    model = tmp_path / "no-such-model"
    code, err = mine(capsys, src, f"--model={model}", f"--out={tmp_path / 'mined.jsonl'}", *flags)
    assert code == 2 and len(err) == 1 and named.replace("<tmp>", str(tmp_path)) in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_page_model_refuses_ids(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from tests.test_mine import mine

    model = tmp_path / "qwen2-vl"  # what mine's page mode is chosen by: a Qwen-VL config's model type
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    src = write_id_rows(tmp_path / "rows.jsonl", [("a query", "p0", [])], ["t0"])
    code, err = mine(capsys, src, f"--model={model}", f"--out={tmp_path / 'mined.jsonl'}", "--ids", "--corpus=x")
    assert code == 2 and err == [
        f"error: --ids: --model={model} mines pages, which are files, not ids; leave --ids out"
    ]
