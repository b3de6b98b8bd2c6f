"""Text pairs from the user's files (`datasets/pairs.py`) and WordNet's mined negatives.

- every format (JSONL, CSV, TSV, Parquet, a Hugging Face save_to_disk folder and its .arrow file)
  serves the same batches for the same rows;
- sentence-transformers' column names (anchor, positive, negative_1..k), a list-valued negatives
  column, and the bad rows they can make;
- the id column: ids shared by rows that share an id, a negative with another row's positive
  text takes that row's id, `doc_id` [B] or [B, 1 + k]; label/score columns are refused;
- data.hard_negatives = false serves no `neg`, for pairs files and for WordNet's third column;
- the duplicate mask with the data's ids equals, in float64 to 1e-10, a dense loss written here
  from the definition (column c is masked for query i iff id(c) == id(positive i)), through
  GradCache with a chunk size that divides nothing and with a token budget, plain accumulation
  and global negatives; with ids, a run trains and evaluates.
"""

from __future__ import annotations

import csv
import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.marks import slow_ones
from tests.needs import needs
from tests.test_hard_negatives import assert_grads_close
from tests.test_trainer import full, grads
from tests.test_wordnet_bi_encoder import write_wordnet
from titan_contrastive.batching import DOC_IDS, NEGATIVES, BatchError, document_ids, with_negatives
from titan_contrastive.datasets import DataError, build_dataset
from titan_contrastive.datasets.loader import build_dataloader
from titan_contrastive.datasets.pair_rows import read_rows
from titan_contrastive.datasets.pairs import PairsDataset

pytestmark = needs("hf")
REL = 1e-10

# (id, query, positive, negative 1, negative 2)
ROWS = [
    ("felis", "a small domesticated feline", "cat", "dog", "tiger"),
    ("felis", "a pet that purrs", "kitty", "puppy", "lion"),  # row 0's document under another name
    ("ocean", "a large body of salt water", "ocean", "lake", "kitty"),  # "kitty": row 1's positive -> felis
    ("clock", "a device that tells the time, with hands", "clock", "calendar", "watch"),
    ("ice", "frozen water", "ice", "steam", "snow"),
    ("sun", "the star at the centre of our solar system", "sun", "moon", "planet"),
    ("ice", "solid water", "ice cube", "vapour", "ocean"),  # "ocean": row 2's positive
    ("piano", 'an instrument with "black and white" keys', "piano", "guitar", "cat"),  # "cat": row 0's
]


@pytest.fixture(scope="module")
def tokenizer():
    from titan_contrastive.models.bi_encoder import BiEncoderArgs, build_tokenizer

    return build_tokenizer(BiEncoderArgs())


def _one_line(err: pytest.ExceptionInfo, *needles: str) -> None:
    message = str(err.value)
    assert len(message.splitlines()) == 1, message
    for needle in needles:
        assert needle in message, message


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def st_rows(with_ids: bool = False) -> list[dict]:
    """ROWS under sentence-transformers' names (the id first, where a user would put it)."""
    return [
        {**({"id": i} if with_ids else {}), "anchor": q, "positive": p, "negative_1": n1, "negative_2": n2}
        for i, q, p, n1, n2 in ROWS
    ]


def every_format(tmp: Path) -> dict[str, tuple[str, tuple[str, ...]]]:
    """ROWS (with ids) in each format: name -> (data.path, data.pairs_columns)."""
    import datasets

    rows = st_rows(with_ids=True)
    paths = {"jsonl": (str(write_jsonl(tmp / "p.jsonl", rows)), ())}
    with open(tmp / "p.csv", "w", newline="", encoding="utf-8-sig") as f:  # a byte-order mark, quoted commas
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    paths["csv"] = (str(tmp / "p.csv"), ())
    names = ("anchor", "positive", "negative_1", "negative_2")
    tsv = ["\t".join(["id", *names])] + ["\t".join(map(str, r.values())) for r in rows]
    (tmp / "p.tsv").write_text("\n".join(tsv) + "\n")
    paths["tsv"] = (str(tmp / "p.tsv"), names)
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp / "p.parquet"))
    paths["parquet"] = (str(tmp / "p.parquet"), ())
    datasets.DatasetDict({"train": table, "test": table.select([0, 1])}).save_to_disk(str(tmp / "hf"))
    paths["hf"] = (str(tmp / "hf"), ())
    paths["arrow"] = (str(next((tmp / "hf" / "train").glob("*.arrow"))), ())
    return paths


def test_every_format_serves_the_same_batches(tmp_path: Path, tokenizer) -> None:
    paths = every_format(tmp_path)
    indices = [3, 0, 7, 2]
    got = {}
    for name, (path, columns) in paths.items():
        ds = PairsDataset(split="train", path=path, columns=columns, tokenizer=tokenizer, query_length=24)
        assert len(ds) == len(ROWS) and ds.num_negatives == 2, name
        got[name] = ds.__getitems__(indices)
    want = got.pop("jsonl")
    assert set(want) == {"query", "doc", "index", NEGATIVES, DOC_IDS}
    for name, batch in got.items():
        assert batch.keys() == want.keys() and all(torch.equal(batch[k], want[k]) for k in want), name
    assert read_rows(paths["csv"][0]).texts[7][0] == ROWS[7][1]  # quotes and commas read back
    # a DatasetDict's "test" split for the held-out set
    assert len(PairsDataset(split="test", path=paths["hf"][0], tokenizer=tokenizer, query_length=24)) == 2
    # headerless TSV, the columns in order (no ids: there are no names)
    (tmp_path / "plain.tsv").write_text("".join("\t".join(r[1:]) + "\n" for r in ROWS))
    plain = PairsDataset(split="train", path=str(tmp_path / "plain.tsv"), tokenizer=tokenizer, query_length=24)
    batch = plain.__getitems__(indices)
    assert DOC_IDS not in batch and all(torch.equal(batch[k], want[k]) for k in ("query", "doc", NEGATIVES))


def test_sentence_transformers_names_and_a_list_of_negatives(tmp_path: Path, tokenizer) -> None:
    texts = [list(r[1:]) for r in ROWS]
    named = write_jsonl(tmp_path / "st.jsonl", st_rows())
    listed = write_jsonl(
        tmp_path / "list.jsonl", [{"query": q, "pos": p, "negatives": [a, b]} for _, q, p, a, b in ROWS]
    )
    assert read_rows(str(named)) == (texts, None, None, {}, None, None)
    assert read_rows(str(listed)).texts == texts
    bad = [
        {"query": "q1", "pos": "p1", "negatives": ["a"]},  # one negative: ragged
        {"query": "q2", "pos": "p2", "negatives": ["a", ""]},  # an empty one
        {"query": "q3", "pos": "p3", "negatives": None},
    ]
    write_jsonl(tmp_path / "bad.jsonl", [*(json.loads(x) for x in listed.read_text().splitlines()), *bad])
    rows = read_rows(str(tmp_path / "bad.jsonl"), max_bad_fraction=0.5)
    assert rows.texts == texts and rows.skipped == {"ragged_negatives": 2, "missing_text": 1}
    # a Parquet list column
    import datasets

    datasets.Dataset.from_list([{"q": q, "p": p, "negs": [a, b]} for _, q, p, a, b in ROWS]).to_parquet(
        str(tmp_path / "list.parquet")
    )
    assert read_rows(str(tmp_path / "list.parquet")).texts == texts
    # data.pairs_columns still picks and orders the columns
    picked = read_rows(str(named), ("anchor", "negative_2", "positive"))
    assert picked.texts == [[q, n2, p] for _, q, p, _, n2 in ROWS]


def _hash(namespace: str, text: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{namespace}\0{text}".encode(), digest_size=8).digest(), "big") >> 1


def identity(column: str, row: int) -> tuple[str, str]:
    """What a column is by the definition: a positive is its row's id; a negative is the id of the
    first row whose positive has its text, else its text."""
    if column == "pos":
        return "id", ROWS[row][0]
    text = ROWS[row][3 if column == "neg1" else 4]
    return next((("id", r[0]) for r in ROWS if r[2] == text), ("text", text))


def test_id_column(tmp_path: Path, tokenizer) -> None:
    rows = st_rows(with_ids=True)
    rows[5]["id"] = 5  # a number is an id too
    path = write_jsonl(tmp_path / "ids.jsonl", rows)
    ds = PairsDataset(split="train", path=str(path), tokenizer=tokenizer, query_length=24)
    batch = ds.__getitems__(range(len(ROWS)))
    ids = batch[DOC_IDS]
    assert ids.dtype == torch.int64 and ids.shape == (len(ROWS), 3)
    assert ids[0, 0] == ids[1, 0] and ids[4, 0] == ids[6, 0] and ids[0, 0] != ids[2, 0]  # shared ids
    assert ids[2, 2] == ids[1, 0] and ids[7, 2] == ids[0, 0] and ids[6, 2] == ids[2, 0]  # a positive's text
    assert ids[0, 0] == _hash("id", "felis") and ids[5, 0] == _hash("id", "5") and ids[0, 1] == _hash("text", "dog")
    for i in range(len(ROWS)):  # every id by the definition
        for c, column in enumerate(("pos", "neg1", "neg2")):
            kind, text = identity(column, i)
            assert ids[i, c] == _hash(kind, "5" if (kind, text) == ("id", "sun") else text)
    # the loader carries them; without negatives they are [B]
    loader = build_dataloader(ds, local_batch_size=4, dp_rank=0, dp_world_size=1, seed=0)
    served = next(iter(loader))
    assert torch.equal(served[DOC_IDS], ids[served["index"]])
    only = PairsDataset(split="train", path=str(path), tokenizer=tokenizer, query_length=24, hard_negatives=False)
    assert torch.equal(only.__getitems__([1, 6])[DOC_IDS], ids[[1, 6], 0])
    # no id column, or data.pairs_id_column = "": no doc_id
    assert DOC_IDS not in PairsDataset(
        split="train", path=str(path), tokenizer=tokenizer, query_length=24, id_column=""
    ).__getitems__([0])
    assert read_rows(str(path), id_column="").texts[0] == ["felis", *ROWS[0][1:]]  # then "id" is a text
    # a row without an id is a bad row
    write_jsonl(
        tmp_path / "noid.jsonl", [*rows, {"anchor": "q", "positive": "p", "negative_1": "a", "negative_2": "b"}]
    )
    assert read_rows(str(tmp_path / "noid.jsonl"), max_bad_fraction=0.5).skipped == {"missing_id": 1}
    with pytest.raises(DataError) as err:
        read_rows(str(path), id_column="doc")
    _one_line(err, "data.pairs_id_column='doc'", "no such column")
    with pytest.raises(DataError) as err:
        read_rows(str(path), ("anchor", "positive", "id"))
    _one_line(err, "data.pairs_id_column='id'", "data.pairs_columns")


def test_scored_pairs_are_refused_unless_cosent_reads_them(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "scored.jsonl", [{"sentence1": "a", "sentence2": "b", "label": 1.0}])
    with pytest.raises(DataError) as err:
        read_rows(str(path))
    _one_line(err, "scored.jsonl", "'label'", "loss.distill=cosent", "data.pairs_columns")
    rows = read_rows(str(path), teacher="cosent")
    assert rows.texts == [["a", "b"]] and rows.scores == [[1.0]]
    (tmp_path / "scored.csv").write_text("sentence1,sentence2,score\na,b,0.5\n")
    with pytest.raises(DataError) as err:
        read_rows(str(tmp_path / "scored.csv"))
    _one_line(err, "scored.csv", "'score'")
    assert read_rows(str(tmp_path / "scored.csv"), ("sentence1", "sentence2")).texts == [["a", "b"]]
    with pytest.raises(DataError) as err:
        read_rows(str(tmp_path / "scored.csv"), ("sentence1", "text"))
    _one_line(err, "scored.csv", "'text'", "data.pairs_columns")


def test_a_dataset_folder_without_the_datasets_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` fails
    (tmp_path / "dataset_dict.json").write_text('{"splits": ["train"]}')  # what save_to_disk writes first
    with pytest.raises(DataError) as err:
        read_rows(str(tmp_path))
    _one_line(err, "data.dataset='pairs'", "pip install -e '.[data]'")


def test_hard_negatives_false_serves_in_batch_negatives_only(tmp_path: Path, tokenizer) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", st_rows())
    on = PairsDataset(split="train", path=str(path), tokenizer=tokenizer, query_length=24)
    off = PairsDataset(split="train", path=str(path), tokenizer=tokenizer, query_length=24, hard_negatives=False)
    assert on.num_negatives == 2 and off.num_negatives == 0
    a, b = on.__getitems__([2, 5]), off.__getitems__([2, 5])
    assert NEGATIVES in a and set(b) == {"query", "doc", "index"}
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_wordnet_with_a_mined_negative(tmp_path: Path, tokenizer) -> None:
    three = [f"{q}\t{p}\t{n}" for _, q, p, n, _ in ROWS]
    write_wordnet(tmp_path / "wn", three, [f"{q}\t{p}" for _, q, p, _, _ in ROWS[:3]])
    common = dict(path=str(tmp_path / "wn"), context_length=24, tokenizer=tokenizer)
    train = build_dataset("wordnet", "train", **common)
    batch = train.__getitems__([0, 4])
    assert batch[NEGATIVES].shape == (2, 1, tokenizer.doc_length) and train.num_negatives == 1
    assert torch.equal(batch[NEGATIVES][:, 0], tokenizer.encode(["dog", "steam"], tokenizer.doc_length))
    assert NEGATIVES not in build_dataset("wordnet", "test", **common).__getitems__([0])
    off = build_dataset("wordnet", "train", hard_negatives=False, **common)
    assert NEGATIVES not in off.__getitems__([0]) and torch.equal(off.__getitems__([0, 4])["doc"], batch["doc"])
    write_wordnet(tmp_path / "mixed", [three[0], "a definition\ta lemma"], ["q\tp"])
    with pytest.raises(DataError) as err:
        build_dataset("wordnet", "train", **{**common, "path": str(tmp_path / "mixed")})
    _one_line(err, "pairs_train.tsv.gz", "all lines of a file alike")


# --- the duplicate mask with the data's ids, against the definition ------------------------------


def dense_masked_infonce(q, pos, neg, scale, rows: list[int]) -> torch.Tensor:
    """Symmetric InfoNCE over the columns [p_1..p_N, n_11..n_1k, ..., n_Nk] (k = 2), column c masked
    for query i (c != i) iff identity(c) == identity(positive i); a masked column leaves the softmax
    denominators of both directions. `rows`: which ROWS the N samples are."""
    n = len(q)
    cols = torch.cat([pos, neg])
    who = [identity("pos", r) for r in rows] + [identity(c, r) for r in rows for c in ("neg1", "neg2")]
    masked = torch.tensor([[c != i and who[c] == who[i] for c in range(len(who))] for i in range(n)])
    logits = (scale * q @ cols.T).masked_fill(masked, float("-inf"))
    labels = torch.arange(n)
    return 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits[:, :n].T, labels))


def same_document(ids: torch.Tensor) -> torch.Tensor:
    """bool [N, N (1 + k)]: column c is positive i's document (the columns as in the loss)."""
    columns = torch.cat([ids[:, 0], ids[:, 1:].flatten()])
    return columns[None, :] == ids[:, 0, None]


KINDS = {  # local batch, accumulation steps, flags
    "gradcache-chunks-of-3": (7, 1, ["--gradcache.enabled=true", "--gradcache.chunk_sizes=3"]),
    "gradcache-token-budget": (7, 1, ["--gradcache.enabled=true", "--gradcache.chunk_tokens=60"]),
    "accumulate": (7, 1, []),
    "global": (3, 2, ["--loss.negatives=global", "--loss.stream_chunk_size=5"]),
}


def make_trainer(tmp: Path, path: Path, *extra: str):
    from tests.test_trainer import make_trainer as base

    return base(
        str(tmp / "run"),
        "--model.name=bi_encoder",
        "--model.flavor=shared",
        "--data.dataset=pairs",
        f"--data.path={path}",
        "--data.context_length=16",
        "--loss.mask_duplicates=true",
        *extra,
    )


@pytest.mark.parametrize("kind", slow_ones(KINDS, ["gradcache-chunks-of-3"]))  # the token budget has GradCache
def test_duplicate_mask_with_data_ids_equals_the_definition(tmp_path: Path, kind: str) -> None:
    local, ga, extra = KINDS[kind]
    path = write_jsonl(tmp_path / "ids.jsonl", st_rows(with_ids=True))
    trainer = make_trainer(
        tmp_path,
        path,
        f"--training.local_batch_size={local}",
        f"--training.global_batch_size={local * ga}",
        "--eval.enable=false",
        *extra,
    )
    trainer.model.eval()  # dropout off: the chunks' dropout draws are tested elsewhere
    rows = list(range(local * ga))
    microbatches = [trainer.train_set.__getitems__(rows[j * local : (j + 1) * local]) for j in range(ga)]
    every = {k: torch.cat([mb[k] for mb in microbatches]) for k in microbatches[0]}

    model = trainer.spec.build_model(trainer.model_args).double()
    model.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    model.eval()
    q, d, scale = model(every["query"], with_negatives(every["doc"], every[NEGATIVES], model.pad_id))
    d = d.reshape(len(q), 3, -1)
    want_loss = dense_masked_infonce(q, d[:, 0], d[:, 1:].flatten(0, 1), scale, rows)
    want_loss.backward()
    # the data's ids mask more than the token ids would ("kitty" is row 0's document too)
    ctx = trainer.step_context
    tokens = document_ids(every["doc"], every[NEGATIVES], ctx.doc_pad_id)
    data, by_tokens = same_document(ctx.document_ids(every)), same_document(tokens)
    assert (data & ~by_tokens).any() and not (by_tokens & ~data).any()

    out = trainer.train_step(microbatches)
    assert abs(out["loss"] - want_loss.item()) <= REL * want_loss.item()
    assert_grads_close(grads(trainer.model), grads(model))
    with pytest.raises(BatchError, match="one id per served document"):
        ctx.document_ids({**every, DOC_IDS: every[DOC_IDS][:, 0]})
    trainer.metrics.close()


def test_data_ids_train_and_evaluate(tmp_path: Path) -> None:
    """With data ids, GradCache and a held-out file with ids: a step trains and the evaluation,
    which forwards positives only, runs."""
    path = write_jsonl(tmp_path / "ids.jsonl", st_rows(with_ids=True))
    trainer = make_trainer(
        tmp_path,
        path,
        "--training.local_batch_size=8",
        "--training.steps=1",
        "--gradcache.enabled=true",
        "--gradcache.chunk_sizes=3",
        f"--data.val_path={path}",
        "--eval.batch_size=5",
    )
    trainer.train()
    trainer.metrics.close()
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (evaluated,) = [row for row in logged if row["kind"] == "eval"]
    assert evaluated["num_samples"] == len(ROWS) and torch.isfinite(torch.tensor(evaluated["loss"]))
