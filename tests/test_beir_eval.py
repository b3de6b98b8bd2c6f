"""Retrieval evaluation on BEIR folders (components/beir_eval.py, `python -m titan_contrastive.evaluate`,
`[eval] beir_path`): the figures sentence-transformers' InformationRetrievalEvaluator gives for the
same model and folder (graded qrels, a query without relevant documents, tied documents); 2 gloo
processes give what 1 gives; the bundled WordNet set; bad input is one line and exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.hf_folders import encoder_folder
from tests.needs import needs
from tests.test_hf_text import folder_run
from tests.test_retrieval_metrics import write_beir
from titan_contrastive.components.beir_eval import BUNDLED, evaluate_beir, load_beir, pair_embedders

METRICS = {"ndcg@5", "ndcg@10", "mrr@10", "map@100", "recall@1", "recall@5", "recall@10", "recall@100"}


def test_the_bundled_set() -> None:
    (beir,) = load_beir("bundled").values()
    assert len(beir.queries) == 2000 and len(beir.corpus) == 5000
    assert all(len(docs) == 1 for docs in beir.qrels.values()) and len(beir.qrels) == 2000
    assert len({c.lower() for c in beir.corpus}) == 5000  # no lemma twice: one right answer per definition
    assert (BUNDLED / "LICENSE").is_file()


@needs("hf")
def test_the_evaluator_equals_sentence_transformers(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The bundled MiniLM through our evaluator (CLI) and through InformationRetrievalEvaluator, whole and at its
    first 128 dims (`--dims`, the evaluator's `truncate_dim`)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    from titan_contrastive.datasets.beir_folder import read_beir
    from titan_contrastive.evaluate import main
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    folder = write_beir(tmp_path / "beir")
    assert (
        main(["", "--beir", str(folder), "--out", str(tmp_path / "out.json"), "--batch-size", "3", "--dims", "128"])
        == 0
    )
    ours = json.loads((tmp_path / "out.json").read_text())
    beir = read_beir(folder)
    model = SentenceTransformer(str(bundled_minilm()), device="cpu")
    for cut, truncate in (("", None), ("dim128/", 128)):
        evaluator = InformationRetrievalEvaluator(
            queries=dict(zip(beir.query_ids, beir.queries)),
            corpus=dict(zip(beir.corpus_ids, beir.corpus)),
            relevant_docs={q: set(docs) for q, docs in beir.qrels.items()},
            mrr_at_k=[10],
            ndcg_at_k=[5, 10],
            map_at_k=[100],
            precision_recall_at_k=[1, 5, 10, 100],
            accuracy_at_k=[1],
            write_csv=False,
            truncate_dim=truncate,
        )
        theirs = evaluator(model)
        assert ours[f"{cut}recall@1"] < 1 and ours[f"{cut}mrr@10"] < 1  # the ranking matters (q2's tie included)
        for name in METRICS:
            assert ours[f"{cut}{name}"] == pytest.approx(theirs[f"cosine_{name}"], abs=1e-6), (cut, name)


def test_splits_of_one_corpus_embed_it_once(tmp_path: Path) -> None:
    """A BEIR folder's dev and test share corpus.jsonl and queries.jsonl: each split embeds only its own judged
    queries (as BEIR's loader keeps them), the corpus is embedded once for both, and each split's figures equal
    that split evaluated alone."""
    from titan_contrastive.components.beir_eval import evaluate_sets

    folder = write_beir(tmp_path / "beir")
    (folder / "qrels" / "dev.tsv").write_text("query-id\tcorpus-id\tscore\nq5\td6\t1\nq1\td1\t1\nq2\td4\t0\n")
    seen: dict[str, list[str]] = {"query": [], "doc": []}

    def embedder(side: str):
        def embed(texts: list[str]) -> torch.Tensor:
            seen[side] += texts
            rows = [torch.randn(8, generator=torch.Generator().manual_seed(sum(map(ord, t)))) for t in texts]
            return torch.nn.functional.normalize(torch.stack(rows), dim=1)

        return embed

    sets = load_beir(str(folder), "dev,test")
    assert sets["dev"].query_ids == ["q1", "q5"] and sets["test"].query_ids == ["q1", "q2", "q3", "q4"]
    both = evaluate_sets(sets, embedder("query"), embedder("doc"), batch_size=3)
    assert len(seen["doc"]) == len(sets["test"].corpus) and len(seen["query"]) == 6
    for name, beir in sets.items():
        alone = evaluate_beir(beir, embedder("query"), embedder("doc"), batch_size=3)
        assert alone == {key.replace(f"beir/{name}/", "beir/"): v for key, v in both.items() if f"/{name}/" in key}
    assert both["beir/ndcg@10"] == (both["beir/dev/ndcg@10"] + both["beir/test/ndcg@10"]) / 2


def _evaluate(folder: str, model_folder: str) -> dict[str, float]:
    from titan_contrastive.datasets.beir_folder import read_beir
    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs, build_tokenizer

    args = BiEncoderArgs(path=model_folder, query_length=16).resolve(doc_length=16)
    model = BiEncoder(args).eval()
    embedders = pair_embedders(lambda b: model(b["query"], b["doc"]), build_tokenizer(args), 16)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    return evaluate_beir(read_beir(folder), *embedders, batch_size=2, rank=rank, world_size=world)


def _on_ranks(folder: str, model_folder: str, out: str) -> None:
    dist.init_process_group("gloo")
    results = _evaluate(folder, model_folder)
    torch.save(results, Path(out) / f"rank{dist.get_rank()}.pt")


@needs("hf")
def test_two_processes_give_what_one_gives(tmp_path: Path) -> None:
    """Each rank embeds its shard (odd sizes: 5 queries, 7 documents over 2 ranks in batches of 2)."""
    from tests.hf_folders import WORDS

    corpus = [{"_id": f"d{i}", "text": " ".join(WORDS[3 * i : 3 * i + 2 + i % 3])} for i in range(7)]
    queries = [{"_id": f"q{i}", "text": " ".join(WORDS[3 * i + 1 : 3 * i + 4])} for i in range(5)]
    qrels = [(f"q{i}", f"d{i}", 1) for i in range(5)] + [("q1", "d6", 2)]
    folder = write_beir(tmp_path / "beir", corpus, queries, qrels)
    model = encoder_folder(tmp_path)
    one = _evaluate(str(folder), str(model))
    run_distributed(_on_ranks, 2, str(folder), str(model), str(tmp_path))
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == one
    assert set(one) == {f"beir/{m}" for m in METRICS}


def beir_run(tmp: Path, beir: Path, *extra: str):
    """A one-step trainer on the tiny BERT folder that evaluates on the BEIR folder `beir`."""
    settings = ("--training.local_batch_size=6", "--training.steps=1", "--eval.enable=true")
    return folder_run(tmp, "encoder", *settings, f"--eval.beir_path={beir}", *extra)


@needs("hf")
def test_training_evaluates_on_a_beir_folder(tmp_path: Path) -> None:
    """`[eval] beir_path`: the metrics land in metrics.jsonl with the run's other evaluation (with
    `beir_precisions`, the quantized corpus's beside them)."""
    trainer = beir_run(tmp_path, write_beir(tmp_path / "beir"), "--eval.beir_precisions", "ubinary")
    trainer.train()
    trainer.metrics.close()
    rows = [json.loads(line) for line in (tmp_path / "run-encoder" / "metrics.jsonl").read_text().splitlines()]
    (evaluated,) = [row for row in rows if row.get("kind") == "eval"]
    assert {f"beir/{m}" for m in METRICS} <= set(evaluated) and 0 <= evaluated["beir/ndcg@10"] <= 1
    assert {f"ubinary/beir/{m}" for m in METRICS} <= set(evaluated)


@needs("hf")
def test_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from titan_contrastive.evaluate import main

    capsys.readouterr()
    assert main(["", "--beir", str(tmp_path / "missing")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "is not a folder" in err[0]
    assert main([str(tmp_path), "--beir", str(write_beir(tmp_path / "beir"))]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "holds no config.json nor modules.json" in err[0]
