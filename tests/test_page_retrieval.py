"""Visual document retrieval (ViDoRe-style) evaluation of the qwen_vl family: a BEIR folder whose corpus is page
images (`datasets/beir_folder.py`: BEIR's files with an `image` per document, ViDoRe's BEIR sets saved to disk,
ViDoRe v1's question-answer layout) ranked by a run's text queries (`[eval] beir_path`, `beir_eval.side_embedders`).
The metrics equal the definition over every query and page embedded on its own (dot product, or MaxSim for
ColQwen), written here; 2 gloo processes give what 1 gives; a corpus the model cannot read is one line. STS through
the text queries of such a run equals scipy's correlations of each sentence embedded alone."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from PIL import Image

from tests.dist_utils import run_distributed
from tests.hf_folders import vl_folder
from tests.needs import require
from tests.test_qwen_vl import vl_run
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.beir_folder import read_beir

require("hf")

SHAPES = ((28, 56), (56, 56), (84, 28), (28, 28), (56, 84))
QUERIES = {"q1": "small cat", "q2": "the piano with black keys", "q3": "a car on the water", "q4": "winter snow"}
QRELS = {"q1": {"p3": 2, "p1": 1}, "q2": {"p0": 1}, "q3": {"p4": 2, "p2": 1, "p5": 0}, "q4": {"p2": 0}}
"""Graded, a query with two relevant pages, a score-0 row, a query without a relevant page (left out)."""


def pages(n: int = 7, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"p{i}": rng.integers(0, 256, (*SHAPES[i % len(SHAPES)], 3), dtype=np.uint8) for i in range(n)}


def jsonl_set(root: Path, images: dict[str, np.ndarray]) -> Path:
    """BEIR's files, each document an image file beside corpus.jsonl."""
    (root / "pages").mkdir(parents=True)
    (root / "qrels").mkdir()
    rows = []
    for key, image in images.items():
        Image.fromarray(image).save(root / "pages" / f"{key}.png")
        rows.append(json.dumps({"_id": key, "image": f"pages/{key}.png"}))
    (root / "corpus.jsonl").write_text("\n".join(rows) + "\n")
    (root / "queries.jsonl").write_text("".join(json.dumps({"_id": k, "text": t}) + "\n" for k, t in QUERIES.items()))
    lines = [f"{q}\t{d}\t{s}" for q, docs in QRELS.items() for d, s in docs.items()]
    (root / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "\n".join(lines) + "\n")
    return root


def _vidore_parts(images: dict[str, np.ndarray]) -> dict:
    """ViDoRe's BEIR sets' three tables: integer ids, an `image` column, queries under `query`."""
    import datasets

    number = {key: int(key[1:]) for key in (*images, *QUERIES)}
    corpus = {"corpus-id": [number[k] for k in images], "image": [Image.fromarray(a) for a in images.values()]}
    features = datasets.Features({"corpus-id": datasets.Value("int64"), "image": datasets.Image()})
    queries = {"query-id": [number[k] for k in QUERIES], "query": list(QUERIES.values())}
    rows = [(number[q], number[d], s) for q, docs in QRELS.items() for d, s in docs.items()]
    qrels = {"query-id": [r[0] for r in rows], "corpus-id": [r[1] for r in rows], "score": [r[2] for r in rows]}
    return {
        "corpus": datasets.Dataset.from_dict(corpus, features=features),
        "queries": datasets.Dataset.from_dict(queries),
        "qrels": datasets.Dataset.from_dict(qrels),
    }


def vidore_set(root: Path, images: dict[str, np.ndarray]) -> Path:
    """ViDoRe's BEIR layout saved to disk (qrels a DatasetDict by split)."""
    import datasets

    parts = _vidore_parts(images)
    parts["corpus"].save_to_disk(str(root / "corpus"))
    parts["queries"].save_to_disk(str(root / "queries"))
    datasets.DatasetDict({"test": parts["qrels"]}).save_to_disk(str(root / "qrels"))
    return root


def vidore_repo(root: Path, images: dict[str, np.ndarray]) -> Path:
    """The same set as its dataset repository on the hub: parquet per config (the pages as datasets' Image feature),
    declared in README.md, as `hf download vidore/... --repo-type dataset` leaves it."""
    lines = ["---", "configs:"]
    for part, table in _vidore_parts(images).items():
        table.to_parquet(str(root / part / "test.parquet"))
        lines += [f"- config_name: {part}", "  data_files:", "  - split: test", f"    path: {part}/test.parquet"]
    (root / "README.md").write_text("\n".join([*lines, "---", ""]))
    return root


@pytest.mark.usefixtures("hf_cache")
def test_page_corpora_read_alike(tmp_path: Path) -> None:
    """BEIR's files, ViDoRe's sets saved to disk and its repository's parquet files give the same set (ids as strings,
    ordered by id), and the pages decode to the pixels written."""
    images = pages()
    a, b = read_beir(jsonl_set(tmp_path / "a", images)), read_beir(vidore_set(tmp_path / "b", images))
    c = read_beir(vidore_repo(tmp_path / "c", images))
    ids = sorted(images)
    assert (c.corpus_ids, c.query_ids, c.queries, c.qrels) == (b.corpus_ids, b.query_ids, b.queries, b.qrels)
    for got, name in ((a, str), (b, lambda key: key[1:]), (c, lambda key: key[1:])):  # ViDoRe's ids are numbers
        assert got.corpus_ids == sorted(name(k) for k in ids) and got.corpus == [""] * len(ids)
        judged = [k for k in QUERIES if k != "q4"]  # q4: no relevant page, left out at reading
        assert got.query_ids == [name(k) for k in judged] and got.queries == [QUERIES[k] for k in judged]
        assert len(got.images) == len(ids)
        for i, key in enumerate(got.corpus_ids):
            assert np.array_equal(got.images[i], images[key if got is a else f"p{key}"])
    named = {"1": "q1", "2": "q2", "3": "q3", "4": "q4"}
    assert {named[q]: {f"p{d}": s for d, s in docs.items()} for q, docs in b.qrels.items()} == a.qrels
    assert a.qrels == {"q1": {"p3": 2, "p1": 1}, "q2": {"p0": 1}, "q3": {"p4": 2, "p2": 1}}


def test_the_question_answer_layout_reads_as_vidore_benchmark(tmp_path: Path) -> None:
    """ViDoRe v1: distinct queries (rows without one are distractors), each relevant to its last row's page; a page
    on several rows is one document (its first row's image)."""
    import datasets

    images = pages(5, seed=1)
    rows = [("small cat", "a.png", "p0"), (None, "b.png", "p1"), ("the piano", "c.png", "p2")]
    rows += [("small cat", "d.png", "p3"), ("winter snow", "a.png", "p4")]
    table = {"query": [r[0] for r in rows], "image_filename": [r[1] for r in rows]}
    table["image"] = [Image.fromarray(images[r[2]]) for r in rows]
    features = datasets.Features(
        {"query": datasets.Value("string"), "image_filename": datasets.Value("string"), "image": datasets.Image()}
    )
    folder = tmp_path / "qa"
    datasets.DatasetDict({"test": datasets.Dataset.from_dict(table, features=features)}).save_to_disk(str(folder))
    got = read_beir(folder)
    assert got.queries == ["small cat", "the piano", "winter snow"] and got.corpus_ids == [
        "a.png",
        "b.png",
        "c.png",
        "d.png",
    ]
    assert [got.qrels[q] for q in got.query_ids] == [{"d.png": 1}, {"c.png": 1}, {"a.png": 1}]
    for i, key in enumerate(["p0", "p1", "p2", "p3"]):
        assert np.array_equal(got.images[i], images[key])


def test_bad_page_sets_are_one_line(tmp_path: Path) -> None:
    images = pages()
    folder = jsonl_set(tmp_path / "mixed", images)
    rows = folder.joinpath("corpus.jsonl").read_text().splitlines()
    rows[1] = json.dumps({"_id": "p1", "text": "no page"})
    folder.joinpath("corpus.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.raises(DataError, match="document 'p1' has no image and 6 others do"):
        read_beir(folder)
    folder = jsonl_set(tmp_path / "gone", images)
    (folder / "pages" / "p2.png").write_bytes(b"not a png")
    (folder / "pages" / "p1.png").unlink()
    beir = read_beir(folder)  # images are read when embedded
    with pytest.raises(DataError, match="document 'p1': its image does not read"):
        beir.images[1]
    with pytest.raises(DataError, match="document 'p2': its image does not read"):
        beir.images[2]
    folder.joinpath("qrels", "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\tp0\t1.5\n")
    with pytest.raises(DataError, match=r"score '1.5' is not an integer"):
        read_beir(folder)


def _dcg(gains: list[float]) -> float:
    return sum(g / math.log2(r + 2) for r, g in enumerate(gains))


def definition(scores: torch.Tensor, beir, graded: bool) -> dict[str, float]:
    """nDCG@5/10, MRR@10 and recall@1/5 written from their definitions over the whole score matrix: each query's
    pages by score, ties by id; queries without a relevant page left out."""
    out: dict[str, list[float]] = {}
    for row, qid in zip(scores.tolist(), beir.query_ids):
        relevant = beir.qrels.get(qid, {})
        if not relevant:
            continue
        ranked = [beir.corpus_ids[j] for j in sorted(range(len(row)), key=lambda j: (-row[j], beir.corpus_ids[j]))]
        gains = {d: g if graded else 1.0 for d, g in relevant.items()}
        ideal = sorted(gains.values(), reverse=True)
        for k in (5, 10):
            out.setdefault(f"ndcg@{k}", []).append(_dcg([gains.get(d, 0) for d in ranked[:k]]) / _dcg(ideal[:k]))
        first = next((r for r, d in enumerate(ranked) if d in relevant), None)
        out.setdefault("mrr@10", []).append(1 / (first + 1) if first is not None and first < 10 else 0.0)
        for k in (1, 5):
            out.setdefault(f"recall@{k}", []).append(sum(d in relevant for d in ranked[:k]) / len(relevant))
    return {name: sum(v) / len(v) for name, v in out.items()}


def alone(model, process, beir, pool: tuple[float, int] = (1, 0)) -> torch.Tensor:
    """The score of every query against every page, each embedded on its own (no batch, no placeholder rows); with a
    pool factor > 1, each page's tokens pooled (`test_token_pooling.ward_pooled`: factor, protected tokens)."""
    proc = process.proc
    with torch.no_grad():
        queries = [
            model.embed(proc.encode(process.templates["query"], [t], None)["ids"], side="query") for t in beir.queries
        ]
        docs = []
        for i in range(len(beir.images)):
            out = proc.encode(process.templates["doc"], [""], [beir.images[i]])
            docs.append(model.embed(out["ids"], out["pixel_values"].double(), out["image_grid_thw"], side="doc"))
    q, d = torch.cat(queries), torch.cat(docs)
    if not model.token_dim:
        return q @ d.T
    q, d = q.view(len(q), -1, model.token_dim), list(d.view(len(d), -1, model.token_dim))
    if pool[0] != 1:
        from tests.test_token_pooling import ward_pooled

        d = [ward_pooled(dj, *pool) for dj in d]
    return torch.stack([torch.stack([(qi @ dj.T).max(1).values.sum() for dj in d]) for qi in q])


COLQWEN_POOLED = (
    "--model.pooling=colbert",
    "--model.colbert_dim=8",
    "--data.max_pixels=7056",
    "--eval.beir_pool_factor=3",
    "--eval.beir_pool_protected=0",
)


@pytest.mark.parametrize(  # graded mean pooling and pooled ColQwen by default; last-token and unpooled ColQwen slow
    "options",
    [
        pytest.param(("--model.pooling=last_token",), marks=pytest.mark.slow),
        ("--model.pooling=mean", "--eval.beir_graded=true"),
        pytest.param(
            ("--model.pooling=colbert", "--model.colbert_dim=8", "--data.max_pixels=7056"), marks=pytest.mark.slow
        ),
        COLQWEN_POOLED,
    ],
    ids=["last", "mean-graded", "colqwen", "colqwen-pooled"],
)
def test_a_run_ranks_pages_as_the_definition(tmp_path: Path, options: tuple[str, ...]) -> None:
    """A t2i run with `[eval] beir_path` on a folder of pages: its `beir/...` keys equal the definition over every
    query and page embedded alone (float64; pages of five shapes, embedded three at a time)."""
    folder = jsonl_set(tmp_path / "pages", pages())
    trainer = vl_run(
        tmp_path, "qwen2_vl", "--eval.enable=true", f"--eval.beir_path={folder}", "--eval.batch_size=3", *options
    )
    results = trainer.evaluate()
    (beir,), graded = trainer.text_evals.beir.values(), "--eval.beir_graded=true" in options
    model = trainer.model.eval()
    pool = (3, 0) if options == COLQWEN_POOLED else (1, 0)
    want = definition(alone(model, trainer.text_evals.tokenizer, beir, pool), beir, graded)
    for name, value in want.items():
        assert results[f"beir/{name}"] == pytest.approx(value, abs=1e-12), name
    if pool[0] != 1:  # a third of the tokens kept (and the ranking above is the pooled pages')
        whole = dataclasses.replace(trainer.text_evals, pool=(1.0, 0))(0, batch_size=3, model=model)
        assert results["beir/corpus_tokens"] < whole["beir/corpus_tokens"] / 2
    assert 0 < want["ndcg@5"] < 1  # the ranking matters
    trainer.metrics.close()


def _evaluate(tmp: str, rank: int = 0, world_size: int = 1) -> dict[str, float]:
    """A t2i embedder's BEIR metrics on the pages, this rank embedding its shard, two texts or pages a batch."""
    from titan_contrastive.components.beir_eval import evaluate_beir, side_embedders
    from titan_contrastive.models.qwen_vl.model import QwenVLArgs, QwenVLEmbedder

    torch.manual_seed(0)
    args = QwenVLArgs(path=str(Path(tmp) / "tiny-qwen2_vl"))
    model, process = QwenVLEmbedder(args).double().eval(), args.processor()

    def forward(batch: dict) -> tuple:
        return model(*(batch[k].double() if batch[k].is_floating_point() else batch[k] for k in FORWARD_KEYS))

    beir = read_beir(Path(tmp) / "pages")
    sizes = {"batch_size": 2, "rank": rank, "world_size": world_size, "pages": True}
    with torch.no_grad():
        return evaluate_beir(beir, *side_embedders(forward, process), **sizes)


def _two_ranks(tmp: str) -> None:
    dist.init_process_group("gloo")
    results = _evaluate(tmp, dist.get_rank(), dist.get_world_size())
    torch.save(results, Path(tmp) / f"rank{dist.get_rank()}.pt")


FORWARD_KEYS = ("query", "doc", "query_pixel_values", "query_image_grid_thw", "doc_pixel_values", "doc_image_grid_thw")


def test_two_processes_rank_as_one(tmp_path: Path) -> None:
    """Each rank embeds its shard of the queries and of the pages; the gathered ranking is the single process's."""
    vl_folder(tmp_path, "qwen2_vl", dropout=0.0)
    jsonl_set(tmp_path / "pages", pages())
    one = _evaluate(str(tmp_path))
    run_distributed(_two_ranks, 2, str(tmp_path))
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == one
    assert set(one) >= {"beir/ndcg@5", "beir/ndcg@10", "beir/recall@5"}


@pytest.mark.parametrize(
    "options,corpus,message",
    [
        (
            ("--data.retrieval_mode=i2t",),
            "pages",
            "eval.beir_path and eval.sts_path read text queries; data.retrieval_mode=i2t",
        ),
        ((), "texts", "a corpus of texts, and this run's documents are images"),
    ],
)
def test_what_a_page_run_cannot_read_is_one_line(
    tmp_path: Path, options: tuple[str, ...], corpus: str, message: str
) -> None:
    if corpus == "pages":
        folder = jsonl_set(tmp_path / "set", pages())
    else:
        from tests.test_retrieval_metrics import write_beir

        folder = write_beir(tmp_path / "set")
    with pytest.raises(DataError, match=message):
        vl_run(tmp_path, "qwen2_vl", "--eval.enable=true", f"--eval.beir_path={folder}", *options)


def test_a_text_model_refuses_a_corpus_of_pages_only(tmp_path: Path) -> None:
    from titan_contrastive.components.beir_eval import check_corpus

    beir = read_beir(jsonl_set(tmp_path / "set", pages()))
    with pytest.raises(DataError, match="a corpus of page images without texts, and this model embeds texts"):
        check_corpus(beir, pages=False)


def _colqwen_folder(root: Path) -> Path:
    """The tiny Qwen2-VL with a random ColPali projection to 8 dims saved beside it: a ColQwen folder."""
    from titan_contrastive.models.bi_encoder.tower import load_text_tower
    from titan_contrastive.models.qwen_vl.colpali import write_colpali

    torch.manual_seed(1)
    tower = load_text_tower(str(vl_folder(root, "qwen2_vl", dropout=0.0)))
    write_colpali(tower, torch.nn.Linear(tower.config.get_text_config().hidden_size, 8), root / "colqwen")
    for file in (root / "tiny-qwen2_vl").iterdir():  # the tokenizer and the image processor
        if not (root / "colqwen" / file.name).exists():
            (root / "colqwen" / file.name).write_bytes(file.read_bytes())
    return root / "colqwen"


@pytest.mark.parametrize("colqwen", [False, True], ids=["qwen2_vl", "colqwen"])
def test_the_command_ranks_a_qwen_vl_folders_pages_as_the_definition(tmp_path: Path, colqwen: bool) -> None:
    """`python -m titan_contrastive.evaluate FOLDER --beir PAGES` on a Qwen-VL folder (last-token pooling) and on a
    ColQwen folder (its projection read: MaxSim), in float64, graded: the definition over items embedded alone."""
    from titan_contrastive.evaluate import load_vl_model, main

    folder = _colqwen_folder(tmp_path) if colqwen else vl_folder(tmp_path, "qwen2_vl", dropout=0.0)
    beir_folder = jsonl_set(tmp_path / "pages", pages())
    out = tmp_path / "out.json"
    argv = [str(folder), "--beir", str(beir_folder), "--batch-size", "3", "--dtype", "float64", "--graded"]
    assert main([*argv, "--max-pixels", "7056", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    args, model = load_vl_model(str(folder), max_pixels=7056)
    assert model.token_dim == (8 if colqwen else 0)
    want = definition(alone(model.double(), args.processor(), read_beir(beir_folder)), read_beir(beir_folder), True)
    for name, value in want.items():
        assert got[name] == pytest.approx(value, abs=1e-12), name


def test_the_commands_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from titan_contrastive.evaluate import main

    folder = vl_folder(tmp_path, "qwen2_vl", dropout=0.0)
    beir_folder = jsonl_set(tmp_path / "pages", pages())
    texts = tmp_path / "texts.jsonl"  # a reranking set's rows, and a triplet set's
    texts.write_text(
        json.dumps({"query": "a cat", "positive": ["cats"], "negative": ["a car"]}) + "\n"
        + json.dumps({"anchor": "a cat", "positive": "cats", "negative": "a car"}) + "\n"
    )  # fmt: skip
    reranking, triplets = tmp_path / "reranking.jsonl", tmp_path / "triplets.jsonl"
    reranking.write_text(texts.read_text().splitlines()[0] + "\n")
    triplets.write_text(texts.read_text().splitlines()[1] + "\n")
    text_documents = "its documents are texts, and {} embeds page images as its documents; leave it out"
    capsys.readouterr()  # the folder's writing
    cases = [
        (["", "--beir", str(beir_folder), "--doc-prompt", "{image}"], "--doc-prompt: for a Qwen-VL model folder"),
        ([str(folder), "--reranking", str(reranking)], "--reranking: " + text_documents.format(folder)),
        ([str(folder), "--triplets", str(triplets), "--reranking", str(reranking)], "--reranking --triplets: "),
        ([str(folder), "--beir", str(beir_folder), "--doc-length", "8"], "--doc-length: "),
        ([str(folder), "--beir", str(beir_folder), "--doc-prompt", "{text}"], "model.doc_prompt='{text}'"),
        (["", "--beir", str(beir_folder)], "a corpus of page images without texts, and this model embeds texts"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err and "\n" not in err, err


def test_a_run_measures_sts_through_its_text_queries(tmp_path: Path) -> None:
    """`[eval] sts_path` on a qwen_vl run: both sentences through the query side; Pearson and Spearman of their
    cosines equal scipy's over each sentence embedded alone."""
    from scipy.stats import pearsonr, spearmanr

    pairs = [("small cat", "domestic cat", 4.5), ("the piano", "a guitar", 2.0), ("winter snow", "summer", 1.0)]
    pairs += [("a car", "a bus with wheels", 3.0), ("frozen water", "ice", 4.8), ("a pilot", "a dog", 0.2)]
    sts = tmp_path / "sts.csv"
    sts.write_text("sentence1,sentence2,score\n" + "".join(f"{a},{b},{s}\n" for a, b, s in pairs))
    trainer = vl_run(tmp_path, "qwen2_vl", "--eval.enable=true", f"--eval.sts_path={sts}", "--eval.batch_size=4")
    results = trainer.evaluate()
    model, process = trainer.model.eval(), trainer.text_evals.tokenizer
    with torch.no_grad():

        def embed(text: str) -> torch.Tensor:
            return model.embed(process.proc.encode(process.templates["query"], [text], None)["ids"], side="query")[0]

        cosines = [float(embed(a) @ embed(b)) for a, b, _ in pairs]
    scores = [s for *_, s in pairs]
    assert results["sts/pearson_cosine"] == pytest.approx(pearsonr(cosines, scores)[0], abs=1e-10)
    assert results["sts/spearman_cosine"] == pytest.approx(spearmanr(cosines, scores)[0], abs=1e-10)
    trainer.metrics.close()


def test_the_miners_corpus_refuses_pages(tmp_path: Path) -> None:
    """A text model's `mine --corpus` (`corpus.corpus_texts`) reads ids and texts: a corpus of pages is one line."""
    from titan_contrastive.datasets.corpus import corpus_texts

    folder = jsonl_set(tmp_path / "set", pages())
    with pytest.raises(DataError, match=r"row 1: a corpus row holds an id .* its columns are _id, image: fix --corpus"):
        corpus_texts(str(folder / "corpus.jsonl"), None, {}, "--corpus")
