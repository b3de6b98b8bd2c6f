"""BEIR over a quantized corpus (`[eval] beir_precisions`, `evaluate --precision`): the metrics equal the ones of
the ranking written here from sentence-transformers' quantization guide, on a corpus small enough that its rescoring
sees every document (2 x 100 candidates), so the ranking is each query's float vector against every document's
dequantized values (int8: 256 buckets per dimension over the corpus's range) or bits (ubinary: 1 where positive);
at a Matryoshka cut, of the renormalized first m dims. A float search is not it (the quantization moves the ranks),
nor is one calibrated on the queries."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.needs import needs
from titan_contrastive.components.beir_eval import CUTS, K, evaluate_beir
from titan_contrastive.components.retrieval_metrics import ir_metrics
from titan_contrastive.datasets.beir_folder import BeirSet

pytestmark = needs("hf")

WIDTH, DOCS, QUERIES = 16, 150, 40


def problem() -> tuple[BeirSet, dict[str, torch.Tensor]]:
    """A BEIR set of DOCS documents and QUERIES queries, each near its 1-3 relevant documents, and the vectors."""
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    docs = torch.randn(DOCS, WIDTH, generator=gen, dtype=torch.float64)
    qrels, queries = {}, []
    for i in range(QUERIES):
        relevant = rng.sample(range(DOCS), rng.randint(1, 3))
        qrels[f"q{i}"] = {f"d{j:03d}": 1 for j in relevant}
        queries.append(docs[relevant].mean(0) + 0.8 * torch.randn(WIDTH, generator=gen, dtype=torch.float64))
    vectors = {f"doc {j}": v for j, v in enumerate(docs)} | {f"query {i}": v for i, v in enumerate(queries)}
    beir = BeirSet(
        corpus_ids=[f"d{j:03d}" for j in range(DOCS)],
        corpus=[f"doc {j}" for j in range(DOCS)],
        query_ids=[f"q{i}" for i in range(QUERIES)],
        queries=[f"query {i}" for i in range(QUERIES)],
        qrels=qrels,
    )
    return beir, vectors


def defined(queries: np.ndarray, corpus: np.ndarray, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The ranking from the guide's definitions: the corpus held in `precision`, every document rescored."""
    if precision == "int8":
        low, high = corpus.min(0), corpus.max(0)
        step = (high - low) / 255
        held = np.clip(np.floor((corpus - low) / step), 0, 255) * step + low
    else:
        held = (corpus > 0).astype(np.float64)
    scores = torch.from_numpy(queries @ held.T)
    order = scores.argsort(dim=1, descending=True, stable=True)[:, :K]
    return scores.gather(1, order), order


@pytest.mark.parametrize("precision", ["int8", "ubinary"])
def test_a_quantized_corpus_ranks_as_the_definition(precision: str) -> None:
    beir, vectors = problem()

    def embed(texts: list[str]) -> torch.Tensor:
        return torch.stack([vectors[t] for t in texts]).float()

    got = evaluate_beir(beir, embed, embed, batch_size=32, dims=[8], precisions=[precision])
    q = torch.stack([vectors[t] for t in beir.queries]).float()
    c = torch.stack([vectors[t] for t in beir.corpus]).float()
    for cut, m in (("", WIDTH), ("dim8/", 8)):
        qm, cm = q[:, :m], c[:, :m]
        if cut:
            qm, cm = torch.nn.functional.normalize(qm, dim=-1), torch.nn.functional.normalize(cm, dim=-1)
        scores, indices = defined(qm.double().numpy(), cm.numpy().astype(np.float64), precision)
        want = ir_metrics(scores, indices, beir.query_ids, beir.corpus_ids, beir.qrels, **CUTS)
        for name, value in want.items():
            assert got[f"{precision}/{cut}beir/{name}"] == pytest.approx(value, abs=1e-12), (cut, name)
        assert 0 < want["ndcg@10"] < 1
    moved = [name for name in want if got[f"{precision}/beir/{name}"] != got[f"beir/{name}"]]
    assert moved, "the quantized search ranked as the float one: the test cannot tell them apart"


def test_quantized_search_is_refused_where_a_text_is_not_one_dense_vector() -> None:
    from titan_contrastive.config import ConfigError, parse_args

    beir, vectors = problem()

    def embed(texts: list[str]) -> torch.Tensor:
        return torch.stack([vectors[t] for t in texts]).float().relu()

    for kind in ({"sparse": True}, {"token_dim": 8}):
        with pytest.raises(ValueError, match="quantized search is for one dense vector per text"):
            evaluate_beir(beir, embed, embed, batch_size=32, precisions=["ubinary"], **kind)
    with pytest.raises(ConfigError, match="eval.beir_precisions"):
        parse_args(["--eval.beir_precisions", "int4"])


def test_a_run_of_token_sets_refuses_beir_precisions(tmp_path: Path) -> None:
    from tests.test_beir_eval import beir_run
    from tests.test_retrieval_metrics import write_beir
    from titan_contrastive.config import ConfigError

    with pytest.raises(ConfigError, match=r"^eval.beir_precisions=\['ubinary'\]: .* embeds a text as its tokens"):
        beir_run(
            tmp_path, write_beir(tmp_path / "beir"), "--model.pooling=colbert", "--eval.beir_precisions", "ubinary"
        )
