"""SPLADE (`[model] pooling = "splade"` on a masked LM, `[loss] flops_query_weight` / `flops_doc_weight`): the
embeddings equal sentence-transformers' SparseEncoder on the same folder; the FLOPS term in every form equals its
definition written out (float64 <= 1e-10; 1, 2 and 4 gloo processes, beside clip both ways and siglip, hard
negatives) and sentence-transformers' SpladeLoss; GradCache and global negatives through the trainer equal the
dense objective, and GradCache replays the dropout; the exports load back as a SparseEncoder and a masked LM;
BEIR ranks by the embeddings' dot product; what SPLADE cannot take is a one-line error."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import TWO_AND_FOUR, run_distributed
from tests.hf_folders import architecture_folder, decoder_folder
from tests.needs import needs
from tests.objective_forms import assert_distributed_forms, assert_forms, wanted
from tests.sparse_folders import sparse_folder
from tests.test_hf_text import PAIRS, folder_run
from tests.test_objectives import CASES, D, N, _close, leaves, objective_of, reference
from tests.test_trainer import full
from titan_contrastive.losses import Flops, InfoNCE, build_objective

BASE = {c["name"]: c for c in CASES}
FCASES = [  # the contrastive objective, hard negatives, the queries' and the documents' weights and thresholds
    ("clip-sym-k0-none-full", 0, 0.5, 0.0, 0, 0),
    ("clip-oneway-k2-none-full", 2, 0.3, 0.7, 0, 0),
    ("siglip-sym-k0-none-full", 0, 0.0, 1.0, 0, 0),
    ("clip-oneway-k2-none-full", 2, 0.3, 0.7, 2, 3),
]
FPAIRS = [
    (dict(BASE[name], k=k), dict(q=wq, d=wd, tq=tq, td=td, name=f"{name}-q{wq}-d{wd}-t{tq}-{td}"))
    for name, k, wq, wd, tq, td in FCASES
]
SPLADE = "--model.pooling=splade"
PROMPTS = {"query": "query ", "document": "represent the passage "}


def sparse_problem(case: dict, seed: int = 0):
    """Non-negative embeddings, not unit length, most entries 0, as SPLADE's are; the scale t = 1."""
    gen = torch.Generator().manual_seed(80 + seed)

    def draw(n: int) -> torch.Tensor:
        return torch.relu(torch.randn(n, D, generator=gen, dtype=torch.float64) - 0.5)

    k = case["k"]
    q, p, n = draw(N), draw(N), draw(N * k) if k else None
    ids = torch.arange(N * (1 + k))
    return q, p, n, torch.tensor(1.0, dtype=torch.float64), torch.tensor(-2.0, dtype=torch.float64), ids


def reference_flops(fcase: dict, q, p, n) -> torch.Tensor:
    """w_q sum_j (mean_i q_ij)^2 + w_d sum_j (mean over every document of d_j)^2, dimension by dimension; with a
    side's threshold T its sums count only the rows with more than T non-zero entries (the means still over all)."""
    docs = p if n is None else torch.cat([p, n])

    def counted(x: torch.Tensor, threshold: int) -> list[int]:
        return [i for i in range(len(x)) if not threshold or sum(int(v != 0) for v in x[i]) > threshold]

    rows, cols = counted(q, fcase["tq"]), counted(docs, fcase["td"])
    total = 0.0
    for j in range(q.shape[1]):
        total = total + fcase["q"] * (sum(q[i, j] for i in rows) / len(q)) ** 2
        total = total + fcase["d"] * (sum(docs[c, j] for c in cols) / len(docs)) ** 2
    return total


def flops_of(case: dict, fcase: dict) -> Flops:
    return Flops(objective_of(case), fcase["q"], fcase["d"], query_threshold=fcase["tq"], doc_threshold=fcase["td"])


def test_the_term_moves_the_loss() -> None:
    case, fcase = FPAIRS[1]
    q, p, n, *_ = sparse_problem(case)
    assert reference_flops(fcase, q, p, n) > 0.05


def test_the_thresholds_count_some_rows_and_not_others() -> None:
    """The thresholded case's problem has rows on both sides of each threshold, and the term differs."""
    case, fcase = FPAIRS[3]
    for seed in (0, 1):
        q, p, n, *_ = sparse_problem(case, seed)
        for x, threshold in ((q, fcase["tq"]), (torch.cat([p, n]), fcase["td"])):
            counts = (x != 0).sum(1)
            assert (counts > threshold).any() and (counts <= threshold).any()
        assert abs(reference_flops(fcase, q, p, n) - reference_flops(dict(fcase, tq=0, td=0), q, p, n)) > 1e-3


@pytest.mark.parametrize("pair", FPAIRS, ids=[f["name"] for _, f in FPAIRS])
def test_dense_streamed_and_microbatch_match_the_definition(pair) -> None:
    case, fcase = pair
    problem = sparse_problem(case)
    rq, rp, rn, rs, rb = leaves(*problem[:5])
    want_loss = reference(case, rq, rp, rn, rs, rb, problem[5]) + reference_flops(fcase, rq, rp, rn)
    assert_forms(flops_of(case, fcase), problem, (want_loss.detach(), *wanted(want_loss, rq, rp, rn, rs)))


def _distributed() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for case, fcase in FPAIRS:
        problem = sparse_problem(case, seed=1)
        rq, rp, rn, rs, rb = leaves(*problem[:5])
        want_loss = reference(case, rq, rp, rn, rs, rb, problem[5]) + reference_flops(fcase, rq, rp, rn)
        want = (want_loss.detach(), *wanted(want_loss, rq, rp, rn, rs))
        assert_distributed_forms(flops_of(case, fcase), problem, want, fcase["name"])


@pytest.mark.parametrize("world", TWO_AND_FOUR)
def test_distributed_forms_match_the_definition(world: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_distributed(_distributed, world)


def assert_equals_splade_loss(model, zq, zd, weights: tuple[float, float], thresholds: tuple[int, int] = (0, 0)):
    """One-way InfoNCE at t = 1 plus FLOPS with the queries' and documents' `weights` and `thresholds` on the
    embeddings `zq`, `zd` (in float64) equals SpladeLoss around SparseMultipleNegativesRankingLoss (scale 1) of the
    SparseEncoder `model` (a weight of 0: no regularizer, as inference-free SPLADE's queries): loss and gradients."""
    from sentence_transformers.sparse_encoder.losses import FlopsLoss, SparseMultipleNegativesRankingLoss

    ours_a, ours_b, theirs_a, theirs_b = leaves(zq.double(), zd.double(), zq.double(), zd.double())
    want = SparseMultipleNegativesRankingLoss(model, scale=1.0).compute_loss_from_embeddings([theirs_a, theirs_b], None)
    for weight, threshold, side in zip(weights, thresholds, (theirs_a, theirs_b), strict=True):
        if weight:
            want = want + weight * FlopsLoss(model, threshold=threshold or None).compute_loss_from_embeddings(side)
    flops = Flops(InfoNCE(False), *weights, query_threshold=thresholds[0], doc_threshold=thresholds[1])
    got = flops.dense(ours_a, ours_b, torch.tensor(1.0, dtype=torch.float64))
    want.backward()
    got.backward()
    _close(got.detach(), want.detach(), "loss")
    _close(ours_a.grad, theirs_a.grad, "d queries")
    _close(ours_b.grad, theirs_b.grad, "d documents")


@needs("hf")
@pytest.mark.parametrize("variant", [("max", "relu", False), ("sum", "log1p_relu", True)], ids=["v2", "v1-log1p-l0"])
def test_embeddings_and_loss_equal_sentence_transformers(tmp_path: Path, variant: tuple[str, str, bool]) -> None:
    """A SparseEncoder folder (fill-mask Transformer, SpladePooling max/relu, or sum/log1p_relu): our query and
    document embeddings equal its `encode` with its prompts; one-way InfoNCE at t = 1 plus FLOPS on them (with
    thresholds at each side's least count of non-zero dimensions, which rows fall both sides of) equals SpladeLoss
    around SparseMultipleNegativesRankingLoss (scale 1), loss and gradients."""
    from sentence_transformers.sparse_encoder import SparseEncoder

    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs, build_tokenizer

    strategy, activation, thresholds = variant
    folder = sparse_folder(architecture_folder(tmp_path, "bert-mlm", 0.0), PROMPTS, strategy, activation)
    args = BiEncoderArgs(path=str(folder), query_length=24).resolve(doc_length=24)
    assert (args.pooling, args.query_prompt, args.doc_prompt) == ("splade", *PROMPTS.values())
    assert (args.splade_pooling, args.splade_activation) == (strategy, activation)
    tokenizer, ours = build_tokenizer(args), BiEncoder(args).eval()
    texts = [q for q, _ in PAIRS[:6]]
    with torch.no_grad():
        zq, zd, _ = ours(tokenizer.encode_queries(texts, 24), tokenizer.encode_docs(texts))
    theirs = SparseEncoder(str(folder), device="cpu")
    for got, name in ((zq, "query"), (zd, "document")):
        want = theirs.encode(texts, prompt_name=name, convert_to_tensor=True, convert_to_sparse_tensor=False)
        assert (got - want).abs().max() <= 1e-5 * max(want.abs().max().item(), 1.0) and (got == 0).any()  # relu's 0s
    limits = [int((z != 0).sum(1).min()) if thresholds else 0 for z in (zq, zd)]
    if thresholds:
        assert all(((z != 0).sum(1) > t).any() and ((z != 0).sum(1) <= t).any() for z, t in zip((zq, zd), limits))
    assert_equals_splade_loss(theirs, zq, zd, (0.05, 0.03), tuple(limits))


@needs("hf")
@pytest.mark.parametrize("kind", ["margin_mse", "kl"])
def test_distillation_on_sparse_vectors_equals_sentence_transformers(tmp_path: Path, kind: str) -> None:
    """SPLADE++'s training from a cross-encoder's scores: our distillation term (margin_mse at t = 1; kl at t = 1/T,
    tau = T, weighted T^2) plus FLOPS on the sparse embeddings of queries, positives and two hard negatives equals
    SpladeLoss around SparseMarginMSELoss / SparseDistillKLDivLoss (their dot product; T = 2, their default)."""
    from sentence_transformers.sparse_encoder import SparseEncoder
    from sentence_transformers.sparse_encoder.losses import FlopsLoss, SparseDistillKLDivLoss, SparseMarginMSELoss

    from titan_contrastive.losses import Distillation, Distilled
    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs, build_tokenizer

    folder = sparse_folder(architecture_folder(tmp_path, "bert-mlm", 0.0), {})
    args = BiEncoderArgs(path=str(folder), query_length=24).resolve(doc_length=24)
    tokenizer, ours = build_tokenizer(args), BiEncoder(args).eval()
    texts = [[pair[i] for pair in PAIRS[j : j + 4]] for i, j in ((0, 0), (1, 0), (1, 4), (1, 8))]
    with torch.no_grad():
        zq, zp, _ = ours(tokenizer.encode_queries(texts[0], 24), tokenizer.encode_docs(texts[1]))
        zn = [ours(tokenizer.encode_queries(texts[0][:1], 24), tokenizer.encode_docs(t))[1] for t in texts[2:]]
    teacher = torch.tensor([[6.0, 1.5, 2.5], [4.0, -1.0, 5.0], [3.0, 2.0, -2.0], [7.5, 0.5, 1.0]], dtype=torch.float64)
    mine, theirs = (
        leaves(zq.double(), zp.double(), *(z.double() for z in zn)),
        leaves(zq.double(), zp.double(), *(z.double() for z in zn)),
    )
    model = SparseEncoder(str(folder), device="cpu")
    temperature = 2.0
    if kind == "margin_mse":
        term, distillation, scale = SparseMarginMSELoss(model), Distillation("margin_mse"), 1.0
    else:
        term = SparseDistillKLDivLoss(model, temperature=temperature)
        distillation, scale = Distillation("kl", temperature**2, temperature), 1 / temperature
    flops = FlopsLoss(model)
    want = (
        term.compute_loss_from_embeddings(list(theirs), teacher)
        + 0.03 * flops.compute_loss_from_embeddings(torch.cat(theirs[1:]))
        + 0.05 * flops.compute_loss_from_embeddings(theirs[0])
    )
    objective = Flops(Distilled(InfoNCE(False), distillation, 0.0), 0.05, 0.03).with_teacher(teacher)
    q, p, n1, n2 = mine
    docs = torch.cat([p, torch.stack([n1, n2], 1).flatten(0, 1)])  # negatives query-major, as the columns hold them
    got = objective.dense(q, docs, torch.tensor(scale, dtype=torch.float64))
    want.backward()
    got.backward()
    _close(got.detach(), want.detach(), "loss")
    for a, b, name in zip(mine, theirs, ("query", "positive", "negative 1", "negative 2"), strict=True):
        _close(a.grad, b.grad, f"d {name}")


def _step(tmp: Path, kind: str, *more: str, at: int = 0, weights: tuple[float, float] = (0.05, 0.03)):
    """One step of SPLADE with FLOPS (dropout off: the model in eval mode), computed as optimizer step `at`,
    against the dense objective over the whole batch in float64 with the FLOPS `weights`: GradCache chunks of 4
    over 6, or global negatives GA 2 of 3. Returns the trainer."""
    local, ga, extra = {
        "gradcache": (6, 1, ["--gradcache.enabled=true", "--gradcache.chunk_sizes=4"]),
        "global": (3, 2, ["--loss.negatives=global", "--loss.stream_chunk_size=2"]),
    }[kind]
    trainer = folder_run(
        tmp, "bert-mlm", SPLADE, "--loss.flops_query_weight=0.05", "--loss.flops_doc_weight=0.03",
        f"--training.local_batch_size={local}", f"--training.global_batch_size={local * ga}", *extra, *more,
    )  # fmt: skip
    assert trainer.model.logit_scale.exp().item() == pytest.approx(1.0)
    assert "FLOPS (0.05 x the queries', 0.03 x the documents'" in trainer.gradient_step.describe()
    trainer.train_state.step = at
    trainer.model.eval()
    data = trainer.train_set
    steps = [data.__getitems__(list(range(j * local, (j + 1) * local))) for j in range(ga)]
    every = {key: torch.cat([s[key] for s in steps]) for key in steps[0]}
    model = trainer.spec.build_model(trainer.model_args).double()
    model.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    model.eval()
    q, d, scale = model(every["query"], every["doc"])
    assert q.shape[1] == model.query_tower.config.vocab_size and (q >= 0).all()
    for x, threshold in ((q, written_threshold(trainer, "query")), (d, written_threshold(trainer, "doc"))):
        counts = (x.flatten(0, -2) != 0).sum(1)
        assert not threshold or ((counts > threshold).any() and (counts <= threshold).any())  # rows both sides
    written = dataclasses.replace(
        trainer.cfg.loss, flops_query_weight=weights[0], flops_doc_weight=weights[1], flops_warmup_steps=0
    )
    want_loss = build_objective(written).dense(q, d, scale)
    want_loss.backward()
    want = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    out = trainer.train_step(steps)
    for name, grad in want.items():
        got = full(dict(trainer.model.named_parameters())[name].grad)
        assert (got - grad).abs().max() <= 1e-10 * max(grad.abs().max().item(), 1.0), name
    assert abs(out["loss"] - want_loss.item()) <= 1e-10 * want_loss.item()
    trainer.metrics.close()
    return trainer


@needs("hf")
@pytest.mark.parametrize("kind", ["gradcache", "global"])
def test_every_step_kind_equals_the_dense_objective(tmp_path: Path, kind: str) -> None:
    _step(tmp_path, kind)


@needs("hf")
@pytest.mark.parametrize("kind", ["gradcache", "global"])
def test_the_warmup_weighs_the_term_by_the_step(tmp_path: Path, kind: str) -> None:
    """`flops_warmup_steps = 4`: the step computed as optimizer step 2 carries (2/4)^2 of the weights, equal to
    the dense objective with a quarter of them written out; at step 0, none."""
    warmup = "--loss.flops_warmup_steps=4"
    _step(tmp_path, kind, warmup, at=2, weights=(0.05 / 4, 0.03 / 4))
    _step(tmp_path / "first", kind, warmup, at=0, weights=(0.0, 0.0))


def written_threshold(trainer, side: str) -> int:
    return getattr(trainer.cfg.loss, f"flops_{side}_threshold")


def least_thresholds(tmp: Path, *more: str) -> list[str]:
    """FLOPS thresholds at each side's least count of non-zero dimensions over the first 6 pairs, as the model
    of `folder_run(tmp, "bert-mlm", SPLADE, *more)` embeds them in eval mode: the rows at it are left out, the
    others counted (`_step` asserts there are both)."""
    probe = folder_run(tmp, "bert-mlm", SPLADE, *more, "--training.local_batch_size=6")
    probe.model.eval()
    batch = probe.train_set.__getitems__(list(range(6)))
    with torch.no_grad():
        q, d, _ = probe.model(batch["query"], batch["doc"])
    probe.metrics.close()
    return [f"--loss.flops_{side}_threshold={int((x != 0).sum(1).min())}" for side, x in (("query", q), ("doc", d))]


@needs("hf")
@pytest.mark.parametrize("kind", ["gradcache", "global"])
def test_splade_v1_with_thresholds_equals_the_dense_objective(tmp_path: Path, kind: str) -> None:
    """Sum pooling, the log1p_relu activation and FLOPS thresholds (each counting some rows and not others)."""
    variant = ("--model.splade_pooling=sum", "--model.splade_activation=log1p_relu")
    trainer = _step(tmp_path, kind, *variant, *least_thresholds(tmp_path, *variant))
    args = trainer.model_args
    assert (args.splade_pooling, args.splade_activation) == ("sum", "log1p_relu")
    assert "counting queries over" in trainer.gradient_step.describe()


def test_a_wrapped_term_is_weighed_through_its_wrappers() -> None:
    from titan_contrastive.losses import Matryoshka, Spread
    from titan_contrastive.losses.base import at_step

    wrapped = Matryoshka(Spread(Flops(InfoNCE(), 1.0, 2.0, warmup_steps=4)), (8, 4), (1.0, 1.0))
    assert at_step(wrapped, 1).inner.inner.factor == 1 / 16
    assert at_step(wrapped, 4).inner.inner.factor == at_step(wrapped, 9).inner.inner.factor == 1.0
    assert at_step(wrapped, None) is wrapped and at_step(InfoNCE(), 3) == InfoNCE()


@needs("hf")
def test_global_negatives_on_two_ranks_under_fsdp2(tmp_path: Path) -> None:
    """The masked LM (its head's weight tied to the input embeddings) sharded per layer on 2 gloo processes:
    the step equals the dense objective over the whole batch."""
    from tests.test_hf_text import _step_distributed

    architecture_folder(tmp_path, "bert-mlm")
    run_distributed(_step_distributed, 2, str(tmp_path), "bert-mlm", False, SPLADE)


@needs("hf")
def test_the_counts_include_the_head(tmp_path: Path) -> None:
    """The parameters (the head's weight tied to the input embeddings, counted once) and the head's FLOPs at
    every token, for the MFU."""
    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs

    folder = str(architecture_folder(tmp_path, "bert-mlm"))
    args = BiEncoderArgs(path=folder, pooling="splade").resolve()
    assert args.num_params() == sum(p.numel() for p in BiEncoder(args).parameters())
    plain = BiEncoderArgs(path=folder, pooling="mean").resolve()
    tokens, config = args.query_length + args.doc_length, args.config
    assert args.flops_per_sample() - plain.flops_per_sample() == 6 * config.vocab_size * config.hidden_size * tokens


@needs("hf")
def test_gradcache_replays_the_dropout(tmp_path: Path) -> None:
    """Training mode (BERT's dropout on): GradCache chunks of 4 over 6 equal the dense objective over the same
    forwards."""
    from tests.test_hard_negatives import assert_step_equals_its_forwards

    trainer = folder_run(
        tmp_path, "bert-mlm", SPLADE, "--loss.flops_query_weight=0.05", "--loss.flops_doc_weight=0.03",
        "--training.local_batch_size=6", "--gradcache.enabled=true", "--gradcache.chunk_sizes=4",
    )  # fmt: skip
    assert trainer.model.training
    batch = trainer.train_set.__getitems__(list(range(6)))
    chunks = [{k: v[s] for k, v in batch.items()} for s in (slice(0, 4), slice(4, 6))]
    assert_step_equals_its_forwards(trainer, [batch], chunks, seed=5, objective=build_objective(trainer.cfg.loss))
    trainer.metrics.close()


@needs("hf")
def test_exports_load_back_as_a_sparse_encoder_and_a_masked_lm(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A step's sentence-transformers folder is a SparseEncoder and its transformers folder a masked LM, each
    embedding as the run does (the exporter checks; SPLADE v1's sum over log1p_relu here); a run from the first pools
    as SPLADE the same way; the miner, whose
    ranking is dense, refuses the step in one line."""
    from titan_contrastive.export import main as export_main
    from titan_contrastive.models.bi_encoder import BiEncoderArgs

    run = folder_run(
        tmp_path, "bert-mlm", SPLADE, "--loss.flops_doc_weight=0.03", "--training.local_batch_size=6",
        "--training.steps=1", "--checkpoint.enable=true", "--model.splade_pooling=sum",
        "--model.splade_activation=log1p_relu",
    )  # fmt: skip
    run.train()
    run.metrics.close()
    step = tmp_path / "run-bert-mlm" / "checkpoint" / "step-1"
    for to in ("sentence-transformers", "hf"):
        assert export_main([str(step), "--to", to, "--out", str(tmp_path / to)]) == 0, to
    modules = json.loads((tmp_path / "sentence-transformers" / "modules.json").read_text())
    assert modules[-1]["type"].endswith("SpladePooling")
    pooling = json.loads((tmp_path / "sentence-transformers" / modules[-1]["path"] / "config.json").read_text())
    assert (pooling["pooling_strategy"], pooling["activation_function"]) == ("sum", "log1p_relu")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]
    args = BiEncoderArgs(path=str(tmp_path / "sentence-transformers")).resolve()
    assert (args.pooling, args.splade_pooling, args.splade_activation) == ("splade", "sum", "log1p_relu")
    from titan_contrastive.mine import main as mine_main

    capsys.readouterr()
    assert mine_main([str(tmp_path / "pairs.jsonl"), "--model", str(step), "--out", str(tmp_path / "m.jsonl")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "a splade run (model.pooling='splade'), and sentence-transformers' miner ranks dense" in line


def test_beir_ranks_by_the_dot_product() -> None:
    """Two documents: the relevant one has the larger dot product with the query and the smaller cosine; sparse
    embeddings also report their mean count of non-zero dimensions per side."""
    from titan_contrastive.components.beir_eval import evaluate_beir
    from titan_contrastive.datasets.beir_folder import BeirSet

    vectors = {"q": [1.0, 0.0], "long": [10.0, 10.0], "near": [1.0, 0.1]}
    beir = BeirSet(["0"], ["q"], ["a", "b"], ["long", "near"], {"0": {"a": 1}})

    def embed(texts: list[str]) -> torch.Tensor:
        return torch.tensor([vectors[t] for t in texts])

    results = evaluate_beir(beir, embed, embed, batch_size=2, dims=(1,))
    assert results["beir/mrr@10"] == 1.0  # by the dot product
    assert results["dim1/beir/mrr@10"] == 1.0  # a cut is by cosine: [1] against [10] and [1], a tie to the first
    assert "beir/query_active_dims" not in results
    sparse = evaluate_beir(beir, embed, embed, batch_size=2, sparse=True)
    assert (sparse["beir/query_active_dims"], sparse["beir/corpus_active_dims"]) == (1.0, 2.0)


@needs("hf")
def test_training_reports_the_active_dimensions(tmp_path: Path) -> None:
    """A SPLADE run's BEIR evaluation logs each side's mean count of non-zero dimensions beside its metrics."""
    from tests.test_retrieval_metrics import write_beir

    trainer = folder_run(
        tmp_path, "bert-mlm", SPLADE, "--training.local_batch_size=6", "--training.steps=1", "--eval.enable=true",
        f"--eval.beir_path={write_beir(tmp_path / 'beir')}",
    )  # fmt: skip
    trainer.train()
    trainer.metrics.close()
    rows = [json.loads(line) for line in (tmp_path / "run-bert-mlm" / "metrics.jsonl").read_text().splitlines()]
    (evaluated,) = [row for row in rows if row.get("kind") == "eval"]
    vocab = trainer.model_args.config.vocab_size
    assert 0 < evaluated["beir/query_active_dims"] <= vocab and 0 < evaluated["beir/corpus_active_dims"] <= vocab
    assert 0 <= evaluated["beir/ndcg@10"] <= 1


@needs("hf")
def test_what_splade_cannot_take_is_a_one_line_error(tmp_path: Path) -> None:
    from titan_contrastive.config import ConfigError

    model = architecture_folder(tmp_path, "bert-mlm")
    for extra, message in [
        ([f"--model.path={decoder_folder(tmp_path)}"], "transformers knows none for 'qwen3'"),
        (["--loss.matryoshka_dims=8"], r"loss.matryoshka_dims=\[8\]: model.pooling='splade' embeds over the voc"),
        (["--model.include_prompt=false"], "takes no Dense modules and pools every token"),
        (["--model.pooling=mean", "--model.splade_pooling=sum"], "model.splade_pooling=sum: model.pooling is 'mean'"),
        (["--loss.flops_doc_threshold=3"], "loss.flops_doc_threshold=3 picks the rows of a FLOPS term, and loss.flo"),
    ]:
        with pytest.raises(ConfigError, match=message):
            folder_run(tmp_path / "bad", "bert-mlm", SPLADE, f"--model.path={model}", *extra)
    odd = sparse_folder(model, {})
    modules = json.loads((odd / "modules.json").read_text())
    (odd / modules[-1]["path"] / "config.json").write_text(json.dumps({"pooling_strategy": "mean"}))
    with pytest.raises(ConfigError, match="SpladePooling with pooling_strategy='mean', activation_function='relu'; m"):
        folder_run(tmp_path / "odd", "bert-mlm", f"--model.path={odd}")
    (odd / modules[-1]["path"] / "config.json").write_text(json.dumps({"pooling_strategy": "max"}))
    guide = f"--loss.guide_model={odd}"
    with pytest.raises(ConfigError, match="a splade folder, whose vectors have no cosine to compare"):
        folder_run(tmp_path / "guide", "encoder", guide, "--loss.mask_margin=0.1", "--training.local_batch_size=6")
