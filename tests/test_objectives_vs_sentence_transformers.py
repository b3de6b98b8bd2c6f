"""Our objectives against sentence-transformers' own losses on all-MiniLM-L6-v2 (float64, the
bundled offline weights), each difference in definition stated where it is mapped:
MultipleNegativesRankingLoss and CachedMultipleNegativesRankingLoss with hard negatives are
one-way InfoNCE over the positives and negatives as columns (with both directions, per-direction
softmaxes: symmetric InfoNCE), MatryoshkaLoss around it is our Matryoshka (truncation then cosine
similarity: the prefixes renormalized), MNRL with more directions in one joint softmax is our
joint directions, and GISTEmbedLoss with the model as its own guide is our margin and relative
masks (with its anchor-anchor and positive-positive terms: joint directions with the mask), with
another guide our masks on that guide's cosines. The same loss and the same gradient of every
parameter."""

from __future__ import annotations

import pytest
import torch

from tests.needs import needs
from titan_contrastive.losses import Distillation, Distilled, FalseNegatives, Hardness, InfoNCE, Matryoshka
from titan_contrastive.losses.guide import Guide

REL = 1e-10
ANCHORS = ["a small domesticated feline", "frozen water", "the season after summer", "a tool for cutting paper"]
POSITIVES = ["cat", "ice", "autumn", "scissors"]
NEGATIVES = [["dog", "tiger"], ["steam", "snow"], ["winter", "spring"], ["knife", "stapler"]]
SCALE = 20.0  # MultipleNegativesRankingLoss's default


def _model():
    from sentence_transformers import SentenceTransformer

    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    torch.manual_seed(0)
    return SentenceTransformer(str(bundled_minilm()), device="cpu", local_files_only=True).double().eval()


def perturbed(model):
    """`model` with every weight moved by a third of its spread: a guide with the same tokenizer and other cosines."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > 1:
                p.add_(p.std() * torch.randn(p.shape, generator=gen, dtype=p.dtype) / 3)
    return model


def _features(model) -> list[dict]:
    """anchor, positive, negative_1, negative_2 columns, as sentence-transformers' trainer passes them."""
    columns = [ANCHORS, POSITIVES, [n[0] for n in NEGATIVES], [n[1] for n in NEGATIVES]]
    return [model.tokenize(texts) for texts in columns]


def _st_losses():  # noqa: ANN202 - sentence_transformers' losses module, wherever this version keeps it
    try:
        from sentence_transformers.sentence_transformer import losses
    except ImportError:  # before 6.x
        from sentence_transformers import losses
    return losses


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def _ours(model, objective, k: int = 2, scale: float = SCALE) -> tuple[float, dict[str, torch.Tensor]]:
    q, p, *negs = (model(dict(f))["sentence_embedding"] for f in _features(model)[: 2 + k])
    cols = (
        torch.cat([p, torch.stack(negs, 1).flatten(0, 1)]) if negs else p
    )  # negatives query-major: n_11, n_12, n_21, ...
    if hasattr(objective, "false_negatives") and objective.false_negatives.enabled:
        assert objective.false_negatives.dense(q, cols, None).any()  # the mask takes part
    loss = objective.dense(q, cols, torch.tensor(scale, dtype=torch.float64))
    loss.backward()
    return loss.item(), _grads(model)


def _assert_same(got: tuple, want: tuple, rel: float = REL) -> None:
    assert abs(got[0] - want[0]) <= rel * want[0]
    assert got[1].keys() == want[1].keys() and got[1]
    total = torch.stack([w.norm() for w in want[1].values()]).norm()
    for name, w in want[1].items():
        err = (got[1][name] - w).norm() / torch.maximum(w.norm(), 1e-6 * total)
        assert err <= rel, f"{name}: {err:.2e}"


@needs("hf")
def test_one_way_infonce_with_hard_negatives_is_multiple_negatives_ranking_loss() -> None:
    losses = _st_losses()
    model = _model()
    st = losses.MultipleNegativesRankingLoss(model, scale=SCALE)
    value = st(_features(model), None)
    value.backward()
    want = (value.item(), _grads(model))
    _assert_same(_ours(model, InfoNCE(symmetric=False)), want)


@needs("hf")
@pytest.mark.parametrize("mini_batch_size", [3, 16])
def test_gradcache_objective_is_cached_multiple_negatives_ranking_loss(mini_batch_size: int) -> None:
    """CachedMNRL (sentence-transformers' GradCache) with hard negatives, mini-batches of 3 that
    divide nothing: the one-way objective's loss and gradients."""
    losses = _st_losses()
    model = _model()
    st = losses.CachedMultipleNegativesRankingLoss(model, scale=SCALE, mini_batch_size=mini_batch_size)
    value = st(_features(model), None)
    value.backward()
    want = (value.item(), _grads(model))
    _assert_same(_ours(model, InfoNCE(symmetric=False)), want)


@needs("hf")
def test_symmetric_infonce_is_both_directions_per_direction() -> None:
    """MNRL with directions query_to_doc and doc_to_query, each its own softmax, averaged: our
    symmetric InfoNCE (the document -> query direction over the positives)."""
    losses = _st_losses()
    model = _model()
    st = losses.MultipleNegativesRankingLoss(
        model, scale=SCALE, directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"
    )
    value = st(_features(model), None)
    value.backward()
    want = (value.item(), _grads(model))
    _assert_same(_ours(model, InfoNCE(symmetric=True)), want)


@needs("hf")
@pytest.mark.parametrize(
    "directions",
    [
        ("query_to_query", "doc_to_query", "doc_to_doc"),
        pytest.param(("query_to_query", "doc_to_doc"), marks=pytest.mark.slow),  # ~10 s each: the default suite's time
        pytest.param(("doc_to_doc",), marks=pytest.mark.slow),
    ],
    ids=["gte", "qwen3", "doc_to_doc"],
)
def test_joint_directions_are_multiple_negatives_ranking_loss_joint(directions: tuple[str, ...]) -> None:
    """MNRL with more directions and partition_mode "joint" (GTE's improved contrastive loss with
    all of them), two hard negatives per query: our one-way InfoNCE with the same joint directions."""
    losses = _st_losses()
    model = _model()
    st = losses.MultipleNegativesRankingLoss(
        model, scale=SCALE, directions=("query_to_doc", *directions), partition_mode="joint"
    )
    value = st(_features(model), None)
    value.backward()
    want = (value.item(), _grads(model))
    _assert_same(_ours(model, InfoNCE(symmetric=False, directions=directions)), want)


GTE = ("query_to_query", "doc_to_query", "doc_to_doc")


@needs("hf")
@pytest.mark.parametrize(
    "mode, directions",
    [
        ("in_batch_negatives", ()),
        pytest.param("hard_negatives", (), marks=pytest.mark.slow),  # ~10 s each: the default suite's time
        pytest.param("all_negatives", (), marks=pytest.mark.slow),
        pytest.param("all_negatives", GTE, marks=pytest.mark.slow),
    ],
    ids=["in_batch", "hard", "all", "all-gte"],
)
def test_hardness_weighting_is_multiple_negatives_ranking_loss_hardness(mode: str, directions: tuple) -> None:
    """MNRL with hardness_mode and hardness_strength (LLaVE's alpha 9), two hard negatives per query
    (with GTE's joint directions: the weighting on the query -> document logits only): ours."""
    losses = _st_losses()
    model = _model()
    st = losses.MultipleNegativesRankingLoss(
        model, scale=SCALE, directions=("query_to_doc", *directions), hardness_mode=mode, hardness_strength=9.0
    )
    value = st(_features(model), None)
    value.backward()
    want = (value.item(), _grads(model))
    _assert_same(_ours(model, InfoNCE(False, directions=directions, hardness=Hardness(mode, 9.0))), want)


@needs("hf")
def test_gist_embed_loss_with_its_anchor_and_positive_terms_is_joint_directions_with_the_mask() -> None:
    """GISTEmbedLoss's defaults (anchor-anchor and positive-positive terms) with the model as its
    own guide, on pairs: joint query_to_query and doc_to_doc, every term masked by the margin (GIST
    masks each anchor and positive against itself by the same rule; ours leaves them out). The
    margin masks some candidates of every term, and all of doc_to_doc's for some queries."""
    from titan_contrastive.losses.directions import terms

    losses = _st_losses()
    model = _model()
    st = losses.GISTEmbedLoss(model, model, margin_strategy="absolute", margin=0.42)
    value = st(_features(model)[:2], None)
    value.backward()
    want = (value.item(), _grads(model))
    objective = InfoNCE(False, FalseNegatives(margin=-0.42), ("query_to_query", "doc_to_doc"))
    with torch.no_grad():
        q, p = (
            torch.nn.functional.normalize(model(dict(f))["sentence_embedding"], dim=1) for f in _features(model)[:2]
        )
    for term in terms(objective.directions, objective.false_negatives, q, q, p, 1.0, 0, len(q), None):
        masked = term.mask(term.rows @ term.keys.T, 0)
        assert masked.sum() > (0 if term.direction == "query_to_doc" else len(q)), term.direction  # beyond itself
    assert masked.all(1).any()  # doc_to_doc: a query left with none of its candidates
    _assert_same(_ours(model, objective, k=0, scale=100.0), want)


@needs("hf")
def test_gist_embed_loss_with_another_guide_is_the_mask_on_that_guides_cosines() -> None:
    """GISTEmbedLoss with a guide other than the model (the same tokenizer: GIST does not retokenize)
    and its anchor-anchor and positive-positive terms, on pairs: ours with the same joint directions and
    margin, its masks on the guide's cosines (`losses/guide.py`), which here keep other candidates than
    the model's own would."""
    from titan_contrastive.losses.directions import terms

    losses = _st_losses()
    model, guide = _model(), perturbed(_model())
    st = losses.GISTEmbedLoss(model, guide, margin_strategy="absolute", margin=0.2)
    value = st(_features(model)[:2], None)
    value.backward()
    want = (value.item(), _grads(model))
    with torch.no_grad():
        gq, gp = (guide(dict(f))["sentence_embedding"] for f in _features(guide)[:2])
        q, p = (model(dict(f))["sentence_embedding"] for f in _features(model)[:2])
    objective = InfoNCE(False, FalseNegatives(margin=-0.2), ("query_to_query", "doc_to_doc"))
    guided = objective.with_guide(Guide(gq, gp))
    masks = [
        [t.mask(t.rows @ t.keys.T, 0) for t in terms(o.directions, o.false_negatives, q, q, p, 1.0, 0, len(q), None)]
        for o in (objective, guided)
    ]
    assert any((ours != its).any() for ours, its in zip(*masks))  # the guide decides
    _assert_same(_ours(model, guided, k=0, scale=100.0), want)


@needs("hf")
def test_a_guide_with_another_tokenizer_reads_the_text_as_gist_embed_loss_does(tmp_path) -> None:
    """GISTEmbedLoss re-tokenizes for a guide with another vocabulary: it decodes the model's token
    ids to text (special tokens skipped) and tokenizes that with the guide's tokenizer. Our guide
    built for such a pair (`BiEncoderArgs.as_guide`: a tiny word-level BERT trains, MiniLM guides)
    embeds the model's token ids the same way: the same loss and gradients with its masks."""
    from sentence_transformers import SentenceTransformer

    from tests.hf_folders import encoder_folder, st_folder
    from titan_contrastive.losses.directions import terms
    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs, build_tokenizer
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    anchors = [
        "a small animal kept as pet",
        "frozen water",
        "the season after summer",
        "a person who flies an aircraft",
    ]
    positives = ["cat", "ice", "autumn", "pilot"]
    folder = st_folder(encoder_folder(tmp_path, dropout=0.0), "mean", {})
    torch.manual_seed(0)
    model = SentenceTransformer(str(folder), device="cpu", local_files_only=True).double().eval()
    guide_st = _model()
    losses = _st_losses()
    st = losses.GISTEmbedLoss(model, guide_st, margin_strategy="absolute", margin=0.1)
    features = [model.tokenize(anchors), model.tokenize(positives)]
    value = st(features, None)
    value.backward()
    want = (value.item(), _grads(model))

    args = BiEncoderArgs(path=str(folder)).resolve()
    guide_args = args.as_guide(str(bundled_minilm()))
    assert guide_args.retokenize_from == args.model_dir
    guide = BiEncoder(guide_args).double().eval()
    tokens = build_tokenizer(args)
    with torch.no_grad():
        gq, gp = guide(tokens.encode_queries(anchors, args.query_length), tokens.encode_docs(positives))[:2]
        for ours, f in ((gq, features[0]), (gp, features[1])):  # GIST's own re-tokenized guide embeddings
            text = model.tokenizer.batch_decode(f["input_ids"], skip_special_tokens=True)
            assert (ours - guide_st(dict(guide_st.tokenize(text)))["sentence_embedding"]).abs().max() <= REL
    q, p = (model(dict(f))["sentence_embedding"] for f in features)
    objective = InfoNCE(False, FalseNegatives(margin=-0.1), ("query_to_query", "doc_to_doc")).with_guide(Guide(gq, gp))
    parts = terms(objective.directions, objective.false_negatives, q.detach(), q.detach(), p.detach(), 1.0, 0, 4, None)
    assert sum(int(t.mask(t.rows @ t.keys.T, 0).sum()) for t in parts) > 2 * len(q)  # beyond their own keys
    loss = objective.dense(q, p, torch.tensor(100.0, dtype=torch.float64))
    loss.backward()
    _assert_same((loss.item(), _grads(model)), want)


@needs("hf")
@pytest.mark.parametrize(
    "strategy, margin, ours",
    [("absolute", 0.05, FalseNegatives(margin=-0.05)), ("relative", 0.1, FalseNegatives(relative=0.9))],
)
def test_margin_masks_are_gist_embed_loss_with_the_model_as_its_guide(strategy: str, margin: float, ours) -> None:
    """GISTEmbedLoss with the model as its own guide, without its anchor-anchor and
    positive-positive terms, one hard negative: GIST masks a column whose similarity exceeds the
    positive's minus `margin` (absolute) or the positive's times 1 - margin (relative), which is
    ours with mask_margin = -margin and mask_relative = 1 - margin; its temperature 0.01 is t = 100."""
    losses = _st_losses()
    model = _model()
    st = losses.GISTEmbedLoss(
        model, model, margin_strategy=strategy, margin=margin, contrast_anchors=False, contrast_positives=False
    )
    value = st(_features(model)[:3], None)
    value.backward()
    want = (value.item(), _grads(model))
    _assert_same(_ours(model, InfoNCE(symmetric=False, false_negatives=ours), k=1, scale=100.0), want)


@needs("hf")
@pytest.mark.parametrize("weights", [(1.0, 1.0, 1.0), (1.0, 0.5, 0.25)])
def test_matryoshka_is_sentence_transformers_matryoshka_loss(weights: tuple[float, ...]) -> None:
    losses = _st_losses()
    dims = (384, 128, 32)
    model = _model()
    inner = losses.MultipleNegativesRankingLoss(model, scale=SCALE)
    st = losses.MatryoshkaLoss(model, inner, matryoshka_dims=list(dims), matryoshka_weights=list(weights))
    value = st(_features(model), None)
    value.backward()
    want = (value.item(), _grads(model))
    _assert_same(_ours(model, Matryoshka(InfoNCE(symmetric=False), dims, weights)), want)


TEACHER = torch.tensor([[6.0, 1.5, 2.5], [4.0, -1.0, 5.0], [3.0, 2.0, -2.0], [7.5, 0.5, 1.0]], dtype=torch.float64)
"""A cross-encoder's scores of each anchor's positive and two negatives (one row ranks a negative first)."""


@needs("hf")
@pytest.mark.parametrize("temperature", [1.0, 0.25])
def test_kl_distillation_is_distill_kl_div_loss(temperature: float) -> None:
    """DistillKLDivLoss(temperature=T) on a normalizing model: our kl term at t = 1/T, tau = T, times T^2
    (their factor; ours leaves it out so that a learned temperature does not scale the gradient)."""
    losses = _st_losses()
    model = _model()
    value = losses.DistillKLDivLoss(model, temperature=temperature)(_features(model), TEACHER)
    value.backward()
    want = (value.item(), _grads(model))
    objective = Distilled(InfoNCE(symmetric=False), Distillation("kl", temperature**2, temperature), 0.0)
    _assert_same(_ours(model, objective.with_teacher(TEACHER), scale=1 / temperature), want)


@needs("hf")
@pytest.mark.parametrize("matryoshka", [False, True])
def test_margin_mse_distillation_is_margin_mse_loss(matryoshka: bool) -> None:
    """MarginMSELoss with the scores of the positive and both negatives (also under MatryoshkaLoss):
    our margin_mse term alone at t = 1."""
    losses = _st_losses()
    model = _model()
    dims, weights = (384, 64), (1.0, 0.5)
    st = losses.MarginMSELoss(model)
    if matryoshka:
        st = losses.MatryoshkaLoss(model, st, matryoshka_dims=list(dims), matryoshka_weights=list(weights))
    value = st(_features(model), TEACHER)
    value.backward()
    want = (value.item(), _grads(model))
    objective = Distilled(InfoNCE(symmetric=False), Distillation("margin_mse"), 0.0)
    objective = Matryoshka(objective, dims, weights) if matryoshka else objective
    _assert_same(_ours(model, objective.with_teacher(TEACHER), scale=1.0), want)


@needs("hf")
def test_infonce_plus_distillation_is_the_sum_of_the_two_losses() -> None:
    """MultipleNegativesRankingLoss + 0.5 x MarginMSELoss (two losses on one batch, summed) is our
    objective with the term weighted 0.5, at t = 20 for both (MarginMSE's dot product scaled by 20)."""
    losses = _st_losses()
    model = _model()
    value = losses.MultipleNegativesRankingLoss(model, scale=SCALE)(_features(model), None)
    value = value + 0.5 * losses.MarginMSELoss(model)(_features(model), TEACHER / SCALE) * SCALE**2
    value.backward()
    want = (value.item(), _grads(model))
    objective = Distilled(InfoNCE(symmetric=False), Distillation("margin_mse", 0.5), 1.0)
    _assert_same(_ours(model, objective.with_teacher(TEACHER)), want)
