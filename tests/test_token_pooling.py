"""Token pooling of a late-interaction index (`components/token_pooling.py`, `[eval] beir_pool_factor`,
`evaluate --pool-factor`) against its definition, written here with scipy: a document's zero tokens dropped, its first
p tokens kept, the rest cut by Ward's linkage over their cosine distances into max(floor(n / factor), 1) clusters,
each replaced by its mean, every token normalized. Each document's pooled tokens (float64; zero tokens inside and
after, documents shorter than p, an empty one), whatever batch it comes in; BEIR scored by MaxSim over the pooled
documents, on 1 and 2 gloo processes; the command on a ColBERT folder; the refusals. A ColQwen run's pooled pages:
tests/test_page_retrieval.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import run_distributed
from tests.needs import require

require("hf")

DIM = 8


def ward_pooled(tokens: torch.Tensor, factor: float, protected: int) -> torch.Tensor:
    """A document's token vectors [L, d] pooled as the definition says (module docstring)."""
    from scipy.cluster.hierarchy import fcluster, linkage
    from scipy.spatial.distance import squareform

    kept = tokens[(tokens != 0).any(-1)]
    head, rest = kept[:protected], kept[protected:]
    clusters = max(int(len(rest) // factor), 1)
    if len(rest) > 1 and clusters < len(rest):
        unit = F.normalize(rest.double(), dim=-1)
        distances = (1 - unit @ unit.T).clamp(0, 2).numpy()
        labels = torch.from_numpy(fcluster(linkage(squareform(distances, checks=False), "ward"), clusters, "maxclust"))
        rest = torch.stack([rest[labels == c].mean(0) for c in labels.unique()])
    return F.normalize(torch.cat([head, rest]), dim=-1)


def _documents(seed: int = 0) -> torch.Tensor:
    """Rows [7, 12 * DIM] of unit tokens: zero tokens inside and after, one of two tokens, one of one, one empty."""
    g = torch.Generator().manual_seed(seed)
    tokens = F.normalize(torch.randn(7, 12, DIM, generator=g, dtype=torch.float64), dim=-1)
    tokens[0, 4] = tokens[0, 9] = 0  # skipped punctuation
    tokens[1, 7:] = 0
    tokens[2, 2:] = 0
    tokens[3, 1:] = 0
    tokens[4] = 0
    return tokens.flatten(1)


def _same_tokens(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same set of vectors (the order of the clusters is not part of the definition)."""
    assert got.shape == want.shape
    order = lambda x: x[x[:, 0].argsort()]  # noqa: E731
    assert torch.allclose(order(got), order(want), rtol=0, atol=1e-12)


@pytest.mark.parametrize("factor,protected", [(2, 1), (3, 0), (1.5, 2), (4, 1)])
def test_each_documents_tokens_are_its_ward_clusters(factor: float, protected: int) -> None:
    from titan_contrastive.components.token_pooling import document_pooler, pooled_tokens, token_counts

    rows = _documents()
    pool = document_pooler(DIM, factor, protected, "test")
    batched = pool(rows)
    assert batched.shape == (7, pooled_tokens(12, factor, protected) * DIM)
    alone = torch.cat([pool(row[None]) for row in rows.flip(0)]).flip(0)  # one at a time, in another order
    assert torch.allclose(alone, batched, rtol=0, atol=1e-15)  # a sum's order aside
    for row, doc in zip(batched, rows):
        want = ward_pooled(doc.view(-1, DIM), factor, protected)
        got = row.view(-1, DIM)
        assert (got[len(want) :] == 0).all()
        _same_tokens(got[: len(want)], want)
    assert token_counts(batched, DIM).tolist()[:5] == [
        len(ward_pooled(d.view(-1, DIM), factor, protected)) for d in rows[:5]
    ]
    assert token_counts(batched, DIM)[0] < token_counts(rows, DIM)[0]  # a long document is pooled


def _maxsim(q: torch.Tensor, docs: list[torch.Tensor]) -> torch.Tensor:
    """MaxSim of each query with each document; a document without tokens: -inf (a max over nothing)."""
    return torch.tensor([[float((qi @ d.T).max(1).values.sum()) if len(d) else -torch.inf for d in docs] for qi in q])


def _beir(n_queries: int = 5):
    from titan_contrastive.datasets.beir_folder import BeirSet

    ids = [str(i) for i in range(7)]
    qrels = {str(i): {str(i): 1, str((i + 3) % 7): 2} for i in range(n_queries)}
    return BeirSet([str(i) for i in range(n_queries)], [f"q{i}" for i in range(n_queries)], ids, ids, qrels)


def _queries() -> torch.Tensor:
    g = torch.Generator().manual_seed(9)
    return F.normalize(torch.randn(5, 4, DIM, generator=g, dtype=torch.float64), dim=-1).flatten(1)


def _evaluate(rank: int = 0, world: int = 1, **pooling) -> dict[str, float]:
    from titan_contrastive.components.beir_eval import evaluate_beir

    docs, queries = _documents(), _queries()
    embed_q = lambda texts: queries[[int(t[1:]) for t in texts]]  # noqa: E731
    embed_d = lambda texts: docs[[int(t) for t in texts]]  # noqa: E731
    sizes = {"batch_size": 2, "rank": rank, "world_size": world, "token_dim": DIM, "dims": (4,)}
    return evaluate_beir(_beir(), embed_q, embed_d, **sizes, **pooling)


def test_beir_ranks_by_maxsim_over_the_pooled_documents() -> None:
    from tests.test_page_retrieval import definition
    from titan_contrastive.losses.matryoshka import prefix

    results = _evaluate(pool_factor=2, pool_protected=1)
    docs = [ward_pooled(d.view(-1, DIM), 2, 1) for d in _documents()]
    queries = _queries().view(5, -1, DIM)
    for cut, q, d in (
        ("", queries, docs),
        (
            "dim4/",
            prefix(queries.flatten(1), 4, DIM).view(5, -1, 4),
            [prefix(x.flatten(), 4, DIM).view(-1, 4) for x in docs],
        ),
    ):
        want = definition(_maxsim(q, d), _beir(), graded=False)
        for name, value in want.items():
            assert results[f"{cut}beir/{name}"] == pytest.approx(value, abs=1e-12), (cut, name)
    assert results["beir/corpus_tokens"] == sum(len(d) for d in docs) / 7
    whole = _evaluate()
    assert whole["beir/corpus_tokens"] == 44 / 7 > results["beir/corpus_tokens"]  # 10 + 7 + 2 + 1 + 0 + 12 + 12
    assert whole["beir/ndcg@10"] != results["beir/ndcg@10"]


def _two_ranks(tmp: str) -> None:
    dist.init_process_group("gloo")
    torch.save(_evaluate(dist.get_rank(), 2, pool_factor=3, pool_protected=0), Path(tmp) / f"r{dist.get_rank()}.pt")


def test_two_processes_pool_as_one(tmp_path: Path) -> None:
    """Each rank pools its shard of the corpus (7 documents, batches of 2); the metrics are the single process's."""
    one = _evaluate(pool_factor=3, pool_protected=0)
    run_distributed(_two_ranks, 2, str(tmp_path))
    for rank in range(2):
        assert torch.load(tmp_path / f"r{rank}.pt") == one


def test_the_command_pools_a_colbert_folders_documents(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`evaluate --pool-factor 2` on a PyLate folder: its metrics are MaxSim's over each document's pooled tokens (the
    model's own token vectors, pooled by the definition); a single-vector model and a factor below 1 are refused."""
    from tests.colbert_folders import colbert_encoder, pylate_folder
    from tests.hf_folders import encoder_folder
    from tests.test_page_retrieval import definition
    from tests.test_retrieval_metrics import write_beir
    from titan_contrastive.components.beir_eval import pair_embedders
    from titan_contrastive.datasets.beir_folder import read_beir
    from titan_contrastive.evaluate import load_text_model, main
    from titan_contrastive.models.bi_encoder import build_tokenizer

    folder, beir_dir = pylate_folder(colbert_encoder(tmp_path), DIM), write_beir(tmp_path / "beir")
    out = tmp_path / "m.json"
    assert main([str(folder), "--beir", str(beir_dir), "--pool-factor", "2", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    args, model = load_text_model(str(folder), 0, 0)
    beir = read_beir(beir_dir)
    embed_q, embed_d = pair_embedders(lambda b: model(b["query"], b["doc"]), build_tokenizer(args), args.query_length)
    with torch.no_grad():
        queries = [embed_q([t]).view(-1, DIM).double() for t in beir.queries]
        docs = [ward_pooled(embed_d([t]).view(-1, DIM).double(), 2, 1) for t in beir.corpus]
    queries = [q[(q != 0).any(-1)] for q in queries]
    want = definition(torch.stack([_maxsim(q[None], docs)[0] for q in queries]), beir, graded=False)
    for name, value in want.items():
        assert got[name] == pytest.approx(value, abs=1e-6), name
    assert got["corpus_tokens"] == pytest.approx(sum(len(d) for d in docs) / len(docs))
    capsys.readouterr()
    assert main([str(folder), "--beir", str(beir_dir), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["corpus_tokens"] > got["corpus_tokens"]
    capsys.readouterr()
    single = encoder_folder(tmp_path)
    for argv, message in (
        ([str(single), "--pool-factor", "2"], "--pool-factor 2.0: pools a late-interaction model's document tokens"),
        ([str(folder), "--pool-factor", "0.5"], "--pool-factor 0.5 --pool-protected 1: use a factor >= 1"),
    ):
        assert main([*argv, "--beir", str(beir_dir)]) == 2
        (line,) = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert message in line, line


def test_a_run_refuses_a_pool_factor_it_cannot_use() -> None:
    from titan_contrastive.components.text_evals import TextEvals
    from titan_contrastive.config import ConfigError, parse_args

    for argv, message in (
        (["--eval.beir_pool_factor=0.5"], "eval.beir_pool_factor=0.5 is out of range: expected a number >= 1"),
        (["--eval.beir_pool_factor=2"], "eval.beir_pool_factor=2.0 pools the documents of eval.beir_path, and this"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_args(argv)
    cfg = parse_args(["--eval.beir_pool_factor=2", "--eval.beir_path=bundled"])
    with pytest.raises(ConfigError, match="this model embeds a text as one vector; set model.pooling='colbert'"):
        TextEvals.from_config(cfg.eval, lambda batch: None, None, object())
