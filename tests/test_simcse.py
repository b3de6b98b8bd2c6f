"""Unsupervised SimCSE (docs/data.md): rows of one text column, each text its own positive through
`data.pairs_columns = ["text", "text"]`, the two views made by the model's dropout; a file of one text column without
it is a one-line error that names the setting. SimCSE's data comes as plain text, a sentence a line
(`wiki1m_for_simcse.txt`): a `.txt` file is rows of the one column `text`."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.needs import needs
from tests.test_negative_pools import write_jsonl
from tests.test_pairs_data import _one_line, make_trainer
from titan_contrastive.datasets import DataError

SENTENCES = [f"a sentence about thing number {i} and its colour" for i in range(12)]


def test_one_text_column_is_a_one_line_error_naming_simcse(tmp_path: Path) -> None:
    from titan_contrastive.datasets.pair_rows import read_rows

    csv_file = tmp_path / "sentences.csv"
    csv_file.write_text("sentence\n" + "".join(f"{s}\n" for s in SENTENCES))
    with_ids = write_jsonl(tmp_path / "ids.jsonl", [{"id": f"s{i}", "text": s} for i, s in enumerate(SENTENCES)])
    for file, name in ((csv_file, "sentence"), (with_ids, "text")):
        with pytest.raises(DataError) as err:
            read_rows(str(file), (), "id", 0.0, "train", "", False, {}, False)
        _one_line(err, f"its rows hold one text column, {name!r}", f'data.pairs_columns = ["{name}", "{name}"]')
    rows = read_rows(str(csv_file), ("sentence", "sentence"), "", 0.0, "train", "", False, {}, False)
    assert rows.texts == [[s, s] for s in SENTENCES]


def test_text_files_are_rows_of_one_text_column(tmp_path: Path) -> None:
    """A `.txt` file (or `.txt.gz`) is its lines that are not blank, each without its line break (CRLF too: universal
    newlines), in the column `text`; a folder of shards reads its data files, not a `README.txt` beside them; plain text
    (no ids) is no corpus format, nor STS pairs': a one-line error."""
    from titan_contrastive.datasets.corpus import corpus_texts
    from titan_contrastive.datasets.pair_rows import read_rows

    lines = "\r\n".join(SENTENCES[:4]) + "\n\n  \n" + "\n".join(SENTENCES[4:]) + "\n"
    (tmp_path / "wiki.txt").write_text(lines, newline="")
    (tmp_path / "wiki.txt.gz").write_bytes(gzip.compress(lines.encode()))
    for name in ("wiki.txt", "wiki.txt.gz"):
        rows = read_rows(str(tmp_path / name), ("text", "text"), "", 0.0, "train", "", False, {}, False)
        assert rows.texts == [[s, s] for s in SENTENCES]
        with pytest.raises(DataError) as err:
            read_rows(str(tmp_path / name), (), "id", 0.0, "train", "", False, {}, False)
        _one_line(err, "its rows hold one text column, 'text'", 'data.pairs_columns = ["text", "text"]')
    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(shards / "part-0.jsonl", [{"text": s} for s in SENTENCES[:5]])
    write_jsonl(shards / "part-1.jsonl", [{"text": s} for s in SENTENCES[5:]])
    (shards / "README.txt").write_text("How these sentences were gathered.\nLicense: none.\n")
    rows = read_rows(str(shards), ("text", "text"), "", 0.0, "train", "", False, {}, False)
    assert rows.texts == [[s, s] for s in SENTENCES]
    with pytest.raises(DataError) as err:
        corpus_texts(str(tmp_path / "wiki.txt"), None, {}, "data.corpus")
    _one_line(err, "wiki.txt: not an existing .jsonl/.json/.csv/.tsv/.parquet/.arrow", "(an id and a text each)")


@needs("hf")
def test_each_text_its_own_positive_seen_through_two_dropout_masks(tmp_path: Path) -> None:
    """A run on one-column rows: each query's positive is its own text, and in training the two are embedded under
    different dropout masks (two views, SimCSE's signal), in evaluation identically; the run trains."""
    path = tmp_path / "sentences.txt"
    path.write_text("".join(f"{s}\n" for s in SENTENCES))
    trainer = make_trainer(
        tmp_path,
        path,
        "--data.pairs_columns=text,text",
        "--training.local_batch_size=6",
        "--training.steps=2",
        "--eval.enable=false",
        "--loss.mask_duplicates=false",
    )
    batch = trainer.train_set.__getitems__(list(range(6)))
    query_ids, doc_ids = batch["query"], batch["doc"]
    assert [q[q != 0].tolist() for q in query_ids] == [d[d != 0].tolist() for d in doc_ids]  # the same text
    dropouts = [m.p for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and max(dropouts) > 0
    trainer.model.train()
    query, doc = (F.normalize(e.float(), dim=-1) for e in trainer.forward(batch)[:2])
    assert (query * doc).sum(-1).max() < 1 - 1e-4  # two views of each text
    trainer.model.eval()
    with torch.no_grad():
        query, doc = (F.normalize(e.float(), dim=-1) for e in trainer.forward(batch)[:2])
    torch.testing.assert_close((query * doc).sum(-1), torch.ones(6), atol=1e-5, rtol=0)
    trainer.model.train()
    trainer.train()
    assert trainer.step == 2
