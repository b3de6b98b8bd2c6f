"""Pools of positives and hard negatives, k of them drawn per epoch (`data.negatives_per_row`, `datasets/pools.py`).

- the draw against its definition: in the file's order exactly the rule's places; shuffled, a
  permutation of each row's own positives and negatives, k distinct negatives per epoch where a row
  holds k, each negative served exactly k times in N epochs, each positive once in P, the same for the
  same seed and another for another;
- FlagEmbedding's rows (`{"query", "pos": [...], "neg": [...]}`, any number of each) served as those
  places say: the tokens, the ids, the teacher's scores and a frozen model's embeddings of the drawn texts;
  their `pos_scores` / `neg_scores` and `prompt` read; tevatron's passages as the texts they hold;
- the loader: every rank count serves the same global batches, with workers too, and a resumed loader
  continues across an epoch exactly; a run trains on such a file and evaluates;
- the errors: a list of positives without the setting, an id column with several positives, rows with no
  negative (skipped, counted), settings that contradict it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from tests.needs import needs
from tests.test_pairs_data import _one_line
from titan_contrastive.batching import DOC_IDS, FROZEN_DOCS, FROZEN_QUERIES, NEGATIVES, TEACHER_SCORES
from titan_contrastive.datasets import DataError
from titan_contrastive.datasets.frozen import EmbeddingTable
from titan_contrastive.datasets.loader import build_dataloader
from titan_contrastive.datasets.pairs import PairsDataset
from titan_contrastive.datasets.pools import Pools

POSITIVES = [1, 3, 2, 1, 2, 1]
NEGATIVES_HELD = [7, 2, 5, 3, 1, 4]


def _segments(pools: Pools, row: int) -> tuple[list[int], list[int]]:
    """The flat places of a row's positives and of its negatives."""
    start, p, n = (int(t[row]) for t in (pools.start, pools.positives, pools.negatives))
    return list(range(start, start + p)), list(range(start + p, start + p + n))


def test_in_the_files_order_the_draw_is_the_rule() -> None:
    pools = Pools(POSITIVES, NEGATIVES_HELD, 3, None)
    rows = torch.arange(len(POSITIVES))
    for epoch in range(9):
        got = pools.draw(rows, epoch).tolist()
        for row in range(len(POSITIVES)):
            positives, negatives = _segments(pools, row)
            want = [positives[epoch % len(positives)]]
            want += [negatives[(epoch * 3 + j) % len(negatives)] for j in range(3)]
            assert got[row] == want, (epoch, row)


def test_shuffled_draws_cover_each_rows_own_documents_evenly() -> None:
    k = 3
    pools = Pools(POSITIVES, NEGATIVES_HELD, k, seed=11)
    rows = torch.arange(len(POSITIVES))
    horizon = math.lcm(*NEGATIVES_HELD, *POSITIVES)
    draws = torch.stack([pools.draw(rows, e) for e in range(horizon)])  # [epochs, rows, 1 + k]
    for row, (p, n) in enumerate(zip(POSITIVES, NEGATIVES_HELD)):
        positives, negatives = _segments(pools, row)
        served_p, served_n = draws[:, row, 0].tolist(), draws[:, row, 1:]
        assert set(served_p) == set(positives) and set(served_n.flatten().tolist()) == set(negatives)
        for start in range(0, horizon, p):  # each positive once in every P epochs
            assert sorted(served_p[start : start + p]) == positives
        for start in range(0, horizon, n):  # each negative k times in every N epochs
            counts = torch.bincount(served_n[start : start + n].flatten(), minlength=len(pools))
            assert counts[negatives].tolist() == [k] * n
        for epoch in range(horizon):
            per_epoch = torch.bincount(served_n[epoch], minlength=len(pools))[negatives]
            assert int(per_epoch.max()) - int(per_epoch.min()) <= 1 and int(per_epoch.max()) == math.ceil(k / n)
    in_order = torch.stack([Pools(POSITIVES, NEGATIVES_HELD, k, None).draw(rows, e) for e in range(horizon)])
    assert not torch.equal(draws, in_order)
    again, other = Pools(POSITIVES, NEGATIVES_HELD, k, 11), Pools(POSITIVES, NEGATIVES_HELD, k, 12)
    assert torch.equal(draws[:6], torch.stack([again.draw(rows, e) for e in range(6)]))
    assert not torch.equal(draws[:6], torch.stack([other.draw(rows, e) for e in range(6)]))


def bge_rows(ids: bool = False) -> list[dict]:
    """FlagEmbedding's rows: row r holds POSITIVES[r] positives and NEGATIVES_HELD[r] negatives, and a teacher's
    score per document (positives first) that names it."""
    return [
        {
            **({"id": f"doc{r}"} if ids else {}),
            "query": f"what is thing number {r}",
            "pos": [f"thing {r} answer {i}" for i in range(p)],
            "neg": [f"thing {r} wrong {j}" for j in range(n)],
            "scores": [score(r, i, True) for i in range(p)] + [score(r, j, False) for j in range(n)],
        }
        for r, (p, n) in enumerate(zip(POSITIVES, NEGATIVES_HELD))
    ]


def score(row: int, i: int, positive: bool) -> float:
    return 100.0 * row + (i if positive else 50 + i)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer():
    from titan_contrastive.models.bi_encoder import BiEncoderArgs, build_tokenizer

    return build_tokenizer(BiEncoderArgs())


def _pooled(path: Path, tokenizer, k: int = 3, **kw) -> PairsDataset:
    return PairsDataset(
        split="train", path=str(path), tokenizer=tokenizer, query_length=12, negatives_per_row=k, seed=5, **kw
    )


@needs("hf")
def test_rows_are_served_as_the_draw_names_them(tmp_path: Path, tokenizer) -> None:
    rows = bge_rows()
    ds = _pooled(write_jsonl(tmp_path / "bge.jsonl", rows), tokenizer, teacher="kl")
    flat = [t for r in rows for t in r["pos"] + r["neg"]]  # the pools' flat places, row by row
    scores = torch.tensor([s for r in rows for s in r["scores"]], dtype=torch.float32)
    text_of = {tuple(tokenizer.encode_docs([t])[0].tolist()): t for t in flat}
    assert len(text_of) == len(flat)
    seen: set[str] = set()
    for epoch in range(4):
        ds.set_epoch(epoch)
        indices = [4, 0, 5, 1, 3, 2]
        batch, places = ds.__getitems__(indices), ds.documents(indices)
        assert batch[NEGATIVES].shape[:2] == (6, 3) and batch[TEACHER_SCORES].shape == (6, 4)
        for b, row in enumerate(indices):
            served = [text_of[tuple(batch["doc"][b].tolist())]]
            served += [text_of[tuple(n.tolist())] for n in batch[NEGATIVES][b]]
            assert served == [flat[i] for i in places[b].tolist()]
            assert served[0] in rows[row]["pos"] and all(t in rows[row]["neg"] for t in served[1:])
            assert torch.equal(batch[TEACHER_SCORES][b], scores[places[b]])
            assert torch.equal(batch["query"][b], tokenizer.encode_queries([rows[row]["query"]], 12)[0])
            seen.update(served)
    assert seen == set(flat)  # in 3 epochs, 3 a time: row 0's 7 negatives, row 1's 3 positives
    held_out = PairsDataset(
        split="test", path=str(tmp_path / "bge.jsonl"), tokenizer=tokenizer, query_length=12, negatives_per_row=3
    )
    batch = held_out.__getitems__(list(range(6)))
    assert NEGATIVES not in batch and [text_of[tuple(d.tolist())] for d in batch["doc"]] == [r["pos"][0] for r in rows]


@needs("hf")
def test_ids_and_frozen_embeddings_follow_the_draw(tmp_path: Path, tokenizer) -> None:
    rows = [r | {"pos": r["pos"][:1]} for r in bge_rows(ids=True)]
    rows[3]["neg"][1] = rows[2]["pos"][0]  # another row's positive: its id
    path = write_jsonl(tmp_path / "ids.jsonl", [{k: v for k, v in r.items() if k != "scores"} for r in rows])
    texts = [("query", r["query"]) for r in rows] + [("document", t) for r in rows for t in r["pos"] + r["neg"]]
    g = torch.Generator().manual_seed(0)
    table = [{"side": s, "text": t, "embedding": torch.randn(4, generator=g).tolist()} for s, t in dict.fromkeys(texts)]
    frozen = EmbeddingTable.read(str(write_jsonl(tmp_path / "e.jsonl", table)), "loss.teacher_embeddings")
    vector = {(r["side"], r["text"]): torch.tensor(r["embedding"]) for r in table}
    ds = _pooled(path, tokenizer, k=2, frozen=frozen)
    flat = [t for r in rows for t in r["pos"] + r["neg"]]
    id_of = {t: r["id"] for r in rows for t in r["pos"]}
    from titan_contrastive.datasets.pairs import _hash63

    shared = 0
    for epoch in range(3):  # row 3's 3 negatives, 2 a time: each served twice
        ds.set_epoch(epoch)
        batch, places = ds.__getitems__(list(range(6))), ds.documents(list(range(6)))
        for b, row in enumerate(rows):
            served = [flat[i] for i in places[b].tolist()]
            want = [_hash63("id", id_of[t]) if t in id_of else _hash63("text", t) for t in served]
            assert batch[DOC_IDS][b].tolist() == want
            shared += served[1:].count(rows[2]["pos"][0])
            query = vector[("query", row["query"])].to(batch[FROZEN_QUERIES].dtype)
            assert torch.equal(batch[FROZEN_QUERIES][b], query)
            docs = torch.stack([vector[("document", t)] for t in served]).to(batch[FROZEN_DOCS].dtype)
            assert torch.equal(batch[FROZEN_DOCS][b], docs)
    assert shared == 2


def _global_batches(ds: PairsDataset, world: int, workers: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """Each step's global batch (4 samples a step), the ranks' parts joined in rank order."""
    loaders = [
        build_dataloader(ds, local_batch_size=4 // world, dp_rank=r, dp_world_size=world, seed=7, num_workers=workers)
        for r in range(world)
    ]
    out = []
    for _ in range(steps):
        parts = [next(loader) for loader in loaders]
        out.append({key: torch.cat([p[key] for p in parts]) for key in parts[0]})
    return out


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@needs("hf")
def test_every_rank_count_and_a_resume_serve_the_same_draws(tmp_path: Path, tokenizer) -> None:
    ds = _pooled(write_jsonl(tmp_path / "bge.jsonl", bge_rows()), tokenizer, k=2)
    one = _global_batches(ds, 1, 0, 5)  # 1 step of 4 per epoch (6 rows, drop_last): 5 epochs
    assert len({tuple(b[NEGATIVES].flatten().tolist()) for b in one}) == 5
    for world, workers in ((2, 0), (4, 0), (2, 2)):
        assert all(_equal(a, b) for a, b in zip(one, _global_batches(ds, world, workers, 5))), (world, workers)
    loader = build_dataloader(ds, local_batch_size=4, dp_rank=0, dp_world_size=1, seed=7)
    for _ in range(2):
        next(loader)
    state = loader.state_dict()
    resumed = build_dataloader(ds, local_batch_size=4, dp_rank=0, dp_world_size=1, seed=7)
    resumed.load_state_dict(state)
    assert all(_equal(next(resumed), want) for want in one[2:])


@needs("hf")
def test_a_run_trains_on_pools_and_evaluates(tmp_path: Path) -> None:
    from tests.test_trainer import make_trainer

    path = write_jsonl(tmp_path / "bge.jsonl", [{k: v for k, v in r.items() if k != "scores"} for r in bge_rows()])
    trainer = make_trainer(
        str(tmp_path / "run"),
        "--model.name=bi_encoder",
        "--model.flavor=shared",
        "--data.dataset=pairs",
        f"--data.path={path}",
        f"--data.val_path={path}",
        "--data.negatives_per_row=2",
        "--data.context_length=16",
        "--training.local_batch_size=3",
        "--training.steps=4",
        "--gradcache.enabled=true",
        "--gradcache.chunk_sizes=2",
        "--eval.batch_size=4",
    )
    trainer.train()
    trainer.metrics.close()
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [row for row in logged if row["kind"] == "train"]
    assert train[-1]["step"] == 4 and all(math.isfinite(row["loss"]) for row in train)
    assert [row["num_samples"] for row in logged if row["kind"] == "eval"] == [6]


@needs("hf")
def test_errors_and_bad_rows(tmp_path: Path, tokenizer, caplog: pytest.LogCaptureFixture) -> None:
    path = write_jsonl(tmp_path / "bge.jsonl", bge_rows())
    with pytest.raises(DataError) as err:
        PairsDataset(split="train", path=str(path), tokenizer=tokenizer, query_length=12)
    _one_line(err, "row 2", "positive is a list of 3 texts", "data.negatives_per_row")
    single = [r | {"pos": r["pos"][:1]} for r in bge_rows()]  # one positive, negatives of any number
    with pytest.raises(DataError) as err:
        PairsDataset(
            split="train", path=str(write_jsonl(tmp_path / "one.jsonl", single)), tokenizer=tokenizer, query_length=12
        )
    _one_line(err, "'ragged_negatives': 2", "data.negatives_per_row = k")
    with pytest.raises(DataError) as err:
        _pooled(write_jsonl(tmp_path / "ids.jsonl", bge_rows(ids=True)), tokenizer)
    _one_line(err, "row 2", "3 positives and an id column ('id')", "data.pairs_id_column=''")
    bare = bge_rows() + [{"query": f"q{i}", "pos": ["p"], "neg": []} for i in range(2)]
    ds = _pooled(write_jsonl(tmp_path / "bare.jsonl", bare), tokenizer, max_bad_fraction=0.5)
    assert len(ds) == 6 and ds.skipped == {"no_negatives": 2}
    with pytest.raises(DataError) as err:
        _pooled(write_jsonl(tmp_path / "none.jsonl", bare[6:]), tokenizer, max_bad_fraction=1.0)
    _one_line(err, "2 of its 2 rows hold no hard negative to draw from", "data.max_bad_fraction")
    held_out = PairsDataset(
        split="test", path=str(tmp_path / "none.jsonl"), tokenizer=tokenizer, query_length=12, negatives_per_row=3
    )
    assert len(held_out) == 2  # evaluation reads positives only
    with caplog.at_level("INFO", logger="titan_contrastive"):
        _pooled(path, tokenizer, k=4)
    assert "4 of each row's hard negatives (it holds 1 to 7)" in caplog.text
    assert "3 row(s) hold fewer than 4 and serve some twice" in caplog.text


@needs("hf")
def test_own_prompts_are_refused_where_the_pooling_leaves_the_prompt_out(tmp_path: Path) -> None:
    from tests.test_trainer import make_trainer
    from titan_contrastive.config import ConfigError

    path = write_jsonl(tmp_path / "flag.jsonl", [r | {"prompt": "Find: "} for r in bge_rows()[:2]] + bge_rows()[2:])
    common = ("--model.name=bi_encoder", "--data.dataset=pairs", f"--data.path={path}", "--data.negatives_per_row=2")
    common += ("--training.local_batch_size=3",)
    with pytest.raises(ConfigError) as err:
        make_trainer(str(tmp_path / "run"), *common, "--model.include_prompt=false")
    _one_line(err, "2 rows give their query a prompt of their own", "model.include_prompt=true")
    assert make_trainer(str(tmp_path / "run2"), *common).train_set.own_prompts == 2


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["--data.hard_negatives=false"], ("data.negatives_per_row=2", "data.hard_negatives=true")),
        (["--data.dataset=wordnet"], ("data.negatives_per_row=2", "data.dataset='wordnet'", "leave it 0")),
        (["--loss.distill=cosent"], ("loss.distill='cosent'", "leave data.negatives_per_row at 0")),
    ],
)
def test_settings_that_contradict_it_are_refused_before_any_compute(
    tmp_path: Path, overrides: list[str], needles: tuple[str, ...]
) -> None:
    from tests.test_trainer import make_trainer

    path = write_jsonl(tmp_path / "bge.jsonl", bge_rows())
    with pytest.raises(DataError) as err:
        make_trainer(
            str(tmp_path / "run"),
            "--model.name=bi_encoder",
            "--data.dataset=pairs",
            f"--data.path={path}",
            "--data.negatives_per_row=2",
            *overrides,
        )
    _one_line(err, *needles)


@needs("hf")
def test_tevatron_rows_of_passages_serve_as_their_texts(tmp_path: Path, tokenizer, caplog) -> None:
    """tevatron's `{"query_id", "query", "positive_passages", "negative_passages"}` rows, passages `{"docid", "title",
    "text"}`, serve what FlagEmbedding's rows of the texts `title text` do, with their columns named or not (not:
    its query_id would be the query, and the query the positive, by sentence-transformers' order)."""

    def passage(text: str, n: int) -> dict:
        title, _, body = text.partition(" ")
        return {"docid": str(n), "title": title, "text": body} if n % 2 else {"docid": str(n), "text": text}

    rows = bge_rows()
    tevatron = [
        {
            "query_id": str(r),
            "query": row["query"],
            "positive_passages": [passage(t, i) for i, t in enumerate(row["pos"])],
            "negative_passages": [passage(t, i) for i, t in enumerate(row["neg"])],
        }
        for r, row in enumerate(rows)
    ]
    columns = ("query", "positive_passages", "negative_passages")
    path = write_jsonl(tmp_path / "tevatron.jsonl", tevatron)
    ds = _pooled(path, tokenizer, columns=columns)
    with caplog.at_level("INFO", logger="titan_contrastive"):
        unnamed = _pooled(path, tokenizer)
    assert "tevatron's rows: query, positive_passages, negative_passages as the texts (left: query_id)" in caplog.text
    flag = _pooled(
        write_jsonl(tmp_path / "bge.jsonl", [{k: r[k] for k in ("query", "pos", "neg")} for r in rows]), tokenizer
    )
    for epoch in range(3):
        for each in (ds, unnamed, flag):
            each.set_epoch(epoch)
        assert _equal(ds.__getitems__(list(range(6))), flag.__getitems__(list(range(6))))
        assert _equal(unnamed.__getitems__(list(range(6))), flag.__getitems__(list(range(6))))


@needs("hf")
def test_flagembedding_rows_with_their_scores_and_prompts(tmp_path: Path, tokenizer, caplog) -> None:
    """FlagEmbedding's rows, whatever their key order: query, pos and neg the texts, pos_scores + neg_scores the
    teacher's scores of them (following the draw), a row's `prompt` before its query in place of the model's;
    other columns left, named in the log."""
    rows = bge_rows()
    flag = [
        {
            "type": "normal",
            **({"prompt": f"Instruct {r}: "} if r % 2 else {}),
            "neg": row["neg"],
            "query": row["query"],
            "pos": row["pos"],
            "pos_scores": row["scores"][: len(row["pos"])],
            "neg_scores": row["scores"][len(row["pos"]) :],
        }
        for r, row in enumerate(rows)
    ]
    prompted = dataclasses.replace(tokenizer, query_prompt="query: ")
    with caplog.at_level("INFO", logger="titan_contrastive"):
        ds = _pooled(write_jsonl(tmp_path / "flag.jsonl", flag), prompted, teacher="kl")
    assert "FlagEmbedding's rows: query, pos, neg as the texts; pos_scores + neg_scores as the teacher's scores;" in (
        caplog.text
    )
    assert "(left: type)" in caplog.text
    reference = _pooled(write_jsonl(tmp_path / "bge.jsonl", rows), prompted, teacher="kl")
    for epoch in range(3):
        ds.set_epoch(epoch)
        reference.set_epoch(epoch)
        got, want = ds.__getitems__(list(range(6))), reference.__getitems__(list(range(6)))
        assert _equal({k: v for k, v in got.items() if k != "query"}, {k: v for k, v in want.items() if k != "query"})
        assert torch.equal(got[TEACHER_SCORES], want[TEACHER_SCORES])
    queries = ds.__getitems__(list(range(6)))["query"]
    for r, row in enumerate(rows):
        text = f"Instruct {r}: {row['query']}" if r % 2 else f"query: {row['query']}"
        assert torch.equal(queries[r], tokenizer.encode_queries([text], 12)[0]), r
