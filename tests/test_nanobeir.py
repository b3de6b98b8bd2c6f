"""Several BEIR sets in one evaluation (`[eval] beir_split = "*"` or "a,b", `evaluate --split`): NanoBEIR's layout
(corpus, queries and qrels by split, qrels without scores) saved to disk and as a downloaded dataset repository;
each set's keys equal that set evaluated alone, and their mean is `beir/...`; sentence-transformers'
NanoBEIREvaluator on the same model and sets gives the same figures; bad split lists are one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.needs import require
from tests.test_retrieval_metrics import CORPUS, QUERIES, write_beir

require("hf")

SETS = {  # NanoBEIR's split names for two of its sets; qrels rows are (query-id, corpus-id), all relevant
    "NanoSciFact": (CORPUS[:5], QUERIES[:3], [("q1", "d5"), ("q1", "d1"), ("q2", "d4"), ("q3", "d2")]),
    "NanoNFCorpus": (CORPUS[2:], QUERIES[1:], [("q2", "d3"), ("q3", "d7"), ("q4", "d2"), ("q5", "d6")]),
}
METRICS = ("ndcg@10", "mrr@10", "map@100", "recall@1", "recall@10")


def _rows(name: str) -> dict[str, list[dict]]:
    corpus, queries, qrels = SETS[name]
    docs = [{"_id": r["_id"], "text": f"{r.get('title', '')} {r['text']}".strip()} for r in corpus]
    return {"corpus": docs, "queries": queries, "qrels": [{"query-id": q, "corpus-id": d} for q, d in qrels]}


def saved_collection(folder: Path) -> Path:
    """corpus/, queries/ and qrels/ as save_to_disk DatasetDicts with one split per set."""
    import datasets

    for part in ("corpus", "queries", "qrels"):
        parts = {name: datasets.Dataset.from_list(_rows(name)[part]) for name in SETS}
        datasets.DatasetDict(parts).save_to_disk(str(folder / part))
    return folder


def repo_collection(folder: Path) -> Path:
    """The same sets as a dataset repository: parquet files per config and split, declared in README.md."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = ["---", "configs:"]
    for part in ("corpus", "queries", "qrels"):
        (folder / part).mkdir(parents=True)
        lines += [f"- config_name: {part}", "  data_files:"]
        for name in SETS:
            pq.write_table(pa.Table.from_pylist(_rows(name)[part]), folder / part / f"{name}.parquet")
            lines += [f"  - split: {name}", f"    path: {part}/{name}.parquet"]
    (folder / "README.md").write_text("\n".join([*lines, "---", ""]))
    return folder


def _evaluate(argv: list[str], out: Path) -> dict:
    from titan_contrastive.evaluate import main

    assert main(["", *argv, "--batch-size", "3", "--out", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.usefixtures("hf_cache")
def test_each_set_alone_and_their_mean_as_sentence_transformers(tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import NanoBEIREvaluator

    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    saved, repo = saved_collection(tmp_path / "saved"), repo_collection(tmp_path / "repo")
    ours = _evaluate(["--beir", str(saved), "--split", "*"], tmp_path / "all.json")
    assert _evaluate(["--beir", str(repo), "--split", "NanoNFCorpus,NanoSciFact"], tmp_path / "r.json") == {
        **ours,
        "beir": str(repo),
        "split": "NanoNFCorpus,NanoSciFact",
    }
    for name, (corpus, queries, qrels) in SETS.items():  # each set alone, as BEIR's files
        alone = write_beir(tmp_path / name, corpus, queries, [(q, d, 1) for q, d in qrels])
        single = _evaluate(["--beir", str(alone)], tmp_path / f"{name}.json")
        assert {m: ours[f"{name}/{m}"] for m in METRICS} == pytest.approx({m: single[m] for m in METRICS}, abs=1e-12)
    for m in METRICS:
        assert ours[m] == pytest.approx(sum(ours[f"{name}/{m}"] for name in SETS) / 2, abs=1e-15)
    assert 0 < ours["ndcg@10"] < 1 and ours["NanoSciFact/ndcg@10"] != ours["NanoNFCorpus/ndcg@10"]
    evaluator = NanoBEIREvaluator(["scifact", "nfcorpus"], dataset_id=str(repo), batch_size=3, write_csv=False)
    theirs = evaluator(SentenceTransformer(str(bundled_minilm()), device="cpu"))
    for m in METRICS:
        assert ours[m] == pytest.approx(theirs[f"NanoBEIR_mean_cosine_{m}"], abs=1e-6), m
        for name in SETS:
            assert ours[f"{name}/{m}"] == pytest.approx(theirs[f"{name}_cosine_{m}"], abs=1e-6), (name, m)


@pytest.mark.usefixtures("hf_cache")
def test_a_run_logs_each_set_and_the_mean(tmp_path: Path) -> None:
    """`[eval] beir_split = "*"` in training: `beir/{set}/...` for each set, and `beir/...` their mean."""
    from tests.test_beir_eval import beir_run

    trainer = beir_run(tmp_path, repo_collection(tmp_path / "nano"), "--eval.beir_split=*", "--eval.batch_size=4")
    results = trainer.evaluate()
    trainer.metrics.close()
    for m in METRICS:
        each = [results[f"beir/{name}/{m}"] for name in SETS]
        assert results[f"beir/{m}"] == pytest.approx(sum(each) / 2, abs=1e-15)


@pytest.mark.parametrize(
    "split,message",
    [
        ("NanoSciFact,*", "eval.beir_split='NanoSciFact,*': give a split name, several separated by commas, or *"),
        ("NanoFEVER", "config 'corpus' has no split 'NanoFEVER' (splits: NanoSciFact, NanoNFCorpus); set eval.beir"),
    ],
)
@pytest.mark.usefixtures("hf_cache")
def test_a_bad_split_list_is_one_line(tmp_path: Path, split: str, message: str) -> None:
    from titan_contrastive.components.beir_eval import load_beir
    from titan_contrastive.datasets.base import DataError

    with pytest.raises(DataError, match=re.escape(message)):
        load_beir(str(repo_collection(tmp_path / "nano")), split)


@pytest.mark.usefixtures("hf_cache")
def test_star_is_every_qrels_split_of_each_layout(tmp_path: Path) -> None:
    from titan_contrastive.datasets.beir_folder import beir_splits

    files = write_beir(tmp_path / "files")
    (files / "qrels" / "dev.tsv").write_text((files / "qrels" / "test.tsv").read_text())
    assert beir_splits(files, "*") == ["dev", "test"]
    assert beir_splits(files, " test , dev ") == ["test", "dev"]
    for folder in (saved_collection(tmp_path / "saved"), repo_collection(tmp_path / "repo")):
        assert beir_splits(folder, "*") == list(SETS)
