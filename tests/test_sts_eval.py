"""Semantic similarity evaluation (components/sts_eval.py, `[eval] sts_path`, `python -m titan_contrastive.evaluate
--sts`): the figures sentence-transformers' EmbeddingSimilarityEvaluator gives for the same model and pairs; 2 gloo
processes give what 1 gives; the files it reads (named columns or three in order, CSV, TSV, JSONL); through the
trainer, with the best checkpoint kept by it; bad input is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.eval_runs import keep_best_run
from tests.needs import needs
from tests.test_retrieval_metrics import write_beir
from titan_contrastive.components.sts_eval import evaluate_sts, load_sts
from titan_contrastive.datasets.base import DataError

PAIRS = [
    ("a small animal kept as a pet", "a domestic cat", 4.2),
    ("a vehicle with wheels", "a car on the road", 3.8),
    ("frozen water", "ice", 4.8),
    ("the season after summer", "autumn", 4.5),
    ("a person who flies an aircraft", "a pilot", 4.6),
    ("a musical instrument with keys", "a piano", 4.0),
    ("a small animal kept as a pet", "a bus", 0.4),
    ("frozen water", "a violin", 0.1),
    ("the season after summer", "a sailor", 0.3),
    ("a person who flies an aircraft", "steam", 1.0),
    ("a musical instrument with keys", "a guitar", 2.9),
    ("a vehicle with wheels", "a bicycle", 3.1),
]


def write_sts(file: Path, pairs: list[tuple[str, str, float]] = PAIRS) -> Path:
    rows = [{"sentence1": a, "sentence2": b, "score": s} for a, b, s in pairs]
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return file


def _words(texts: list[str]) -> torch.Tensor:
    """A fixed embedding of each text without a model: counts of its letters (a..z)."""
    return torch.tensor([[t.count(c) for c in "abcdefghijklmnopqrstuvwxyz"] for t in texts], dtype=torch.float64)


@needs("hf")
def test_the_evaluator_equals_sentence_transformers(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The bundled MiniLM through our evaluator (CLI, beside a small BEIR folder) and EmbeddingSimilarityEvaluator,
    whole and at its first 64 dims (`--dims`, the evaluator's `truncate_dim`)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

    from titan_contrastive.evaluate import main
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    file = write_sts(tmp_path / "sts.jsonl")
    out = tmp_path / "out.json"
    beir = write_beir(tmp_path / "beir")
    assert (
        main(["", "--beir", str(beir), "--sts", str(file), "--out", str(out), "--batch-size", "5", "--dims", "64"]) == 0
    )
    ours = json.loads(out.read_text())
    model = SentenceTransformer(str(bundled_minilm()), device="cpu")
    assert 0.5 < ours["sts/spearman_cosine"] < 1 and "ndcg@10" in ours and "dim64/ndcg@10" in ours
    assert ours["sts/pearson_cosine"] != ours["dim64/sts/pearson_cosine"]
    for cut, truncate in (("", None), ("dim64/", 64)):
        evaluator = EmbeddingSimilarityEvaluator(*map(list, zip(*PAIRS)), write_csv=False, truncate_dim=truncate)
        theirs = evaluator(model)
        for name in ("pearson_cosine", "spearman_cosine"):
            assert ours[f"{cut}sts/{name}"] == pytest.approx(theirs[name], abs=1e-6), (cut, name)


def test_the_correlations_are_pearsons_and_spearmans_of_the_cosines(tmp_path: Path) -> None:
    """Against the definitions (numpy), on an embedding without a model; the score's scale does not matter."""
    import numpy as np

    sts = load_sts(str(write_sts(tmp_path / "sts.jsonl")))
    got = evaluate_sts(sts, _words, batch_size=4)
    a, b = _words(sts.sentences1).numpy(), _words(sts.sentences2).numpy()
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    gold = np.array(sts.scores)
    ranks = [np.argsort(np.argsort(x)) for x in (gold, cos)]  # no ties in either here
    assert got["sts/pearson_cosine"] == pytest.approx(np.corrcoef(gold, cos)[0, 1], abs=1e-12)
    assert got["sts/spearman_cosine"] == pytest.approx(np.corrcoef(*ranks)[0, 1], abs=1e-12)
    scaled = load_sts(str(write_sts(tmp_path / "scaled.jsonl", [(a, b, s / 5) for a, b, s in PAIRS])))
    assert evaluate_sts(scaled, _words, batch_size=4) == pytest.approx(got, abs=1e-12)


def _on_ranks(file: str, out: str) -> None:
    dist.init_process_group("gloo")
    results = evaluate_sts(load_sts(file), _words, batch_size=2, rank=dist.get_rank(), world_size=2)
    torch.save(results, Path(out) / f"rank{dist.get_rank()}.pt")


def test_two_processes_give_what_one_gives(tmp_path: Path) -> None:
    """Each rank embeds its shard (11 pairs over 2 ranks in batches of 2)."""
    file = write_sts(tmp_path / "sts.jsonl", PAIRS[:11])
    one = evaluate_sts(load_sts(str(file)), _words, batch_size=2)
    run_distributed(_on_ranks, 2, str(file), str(tmp_path))
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == one


def test_the_files_it_reads(tmp_path: Path) -> None:
    """Named columns in any order (CSV), three in order (CSV with other names, TSV with a header, JSON lists)."""
    want = load_sts(str(write_sts(tmp_path / "sts.jsonl")))
    named = tmp_path / "named.csv"
    named.write_text("score,sentence2,sentence1\n" + "".join(f'{s},"{b}","{a}"\n' for a, b, s in PAIRS))
    ordered = tmp_path / "ordered.csv"
    ordered.write_text("s1,s2,label\n" + "".join(f'"{a}","{b}",{s}\n' for a, b, s in PAIRS))
    tsv = tmp_path / "sts.tsv"
    tsv.write_text("a\tb\tscore\n" + "".join(f"{a}\t{b}\t{s}\n" for a, b, s in PAIRS))
    lists = tmp_path / "lists.jsonl"
    lists.write_text("".join(json.dumps(list(p)) + "\n" for p in PAIRS))
    for file in (named, ordered, tsv, lists):
        assert load_sts(str(file)) == want, file


def test_bad_files_are_one_line(tmp_path: Path) -> None:
    bad_score = tmp_path / "bad.csv"
    bad_score.write_text("sentence1,sentence2,score\nfrozen water,ice,high\n")
    empty = tmp_path / "empty.csv"
    empty.write_text("sentence1,sentence2,score\nfrozen water,,4\nice,snow,3\n")
    one = write_sts(tmp_path / "one.jsonl", PAIRS[:1])
    for path, message in (
        (tmp_path / "missing.jsonl", "is not such a file: give a .jsonl"),
        (tmp_path, "is not such a file"),
        (bad_score, "row 1 is not two sentences and a score"),
        (empty, "row 1 has an empty sentence"),
        (one, "1 scored pair(s); a correlation needs at least 2"),
    ):
        if path == tmp_path:
            path = tmp_path / "sts.txt"
            path.write_text("x")
        with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_sts(str(path))


@needs("hf")
def test_training_evaluates_on_scored_pairs_and_keeps_the_best(tmp_path: Path) -> None:
    """`[eval] sts_path`: the correlations (and at `eval.dims`) land in metrics.jsonl, and `checkpoint.keep_best`
    can name one."""

    file = write_sts(tmp_path / "sts.jsonl")
    evals = keep_best_run(tmp_path, "sts_path", file, "sts/spearman_cosine", "--eval.dims=8")
    assert all(-1 <= e["sts/pearson_cosine"] <= 1 for e in evals)
    assert all(-1 <= e["dim8/sts/spearman_cosine"] <= 1 for e in evals)  # the first 8 of 16 dims
    with pytest.raises(DataError, match="eval.beir_path and eval.sts_path need a text-to-text model family"):
        from tests.test_trainer import make_trainer

        make_trainer(str(tmp_path / "clip"), f"--eval.sts_path={file}", "--data.dataset=synthetic")
