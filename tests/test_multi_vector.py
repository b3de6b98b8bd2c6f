"""sentence-transformers' MultiVectorEncoder (its ColBERT models, `models/bi_encoder/multi_vector.py`): a folder built
and saved by sentence-transformers read by our bi_encoder gives its tokens to the bit in float64 (query expansion
attended or not, none, prompts, a skiplist); a run trains from one exactly; a run exports `--to sentence-transformers`
as one that sentence-transformers reads back with the run's tokens, and so does a run from a PyLate folder; what
the bi_encoder does not compute is refused in one line. And sentence-transformers' multi-vector losses
(MultipleNegativesRankingLoss and its cached form with hard negatives, DistillKLDivLoss at two temperatures,
MarginMSELoss) against our objectives on its own token embeddings: the same loss and every parameter's gradient, to
float32 rounding (1e-5: its MaxSim scores are float32 whatever the embeddings' dtype)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.colbert_folders import colbert_encoder, multi_vector_folder, pylate_folder
from tests.needs import require
from tests.test_colbert import COLBERT, KINDS, _dense
from tests.test_hard_negatives import make_trainer, pairs_file, step_against
from tests.test_objectives_vs_sentence_transformers import NEGATIVES, POSITIVES, _assert_same, _grads
from titan_contrastive.config import ConfigError
from titan_contrastive.losses import Distillation, Distilled, InfoNCE
from titan_contrastive.losses.late_interaction import LateInteraction, late_interaction
from titan_contrastive.models.bi_encoder.folder import read_text_folder

require("hf")

DIM = 8
TEXTS = [
    "a small domesticated feline, kept as a pet.",
    "What is the capital of France?",
    "Two dogs, playing in the snow at night! " * 6,
    "ice",
]
ST_REL = 1e-5  # its MaxSim returns float32 scores from float64 embeddings
QUERIES = ["a small domesticated feline", "frozen water", "the season after summer", "a tool for cutting paper"]


def _minilm_mve(tmp: Path, **settings) -> Path:
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    base = tmp / "minilm"
    if not base.exists():
        import shutil

        shutil.copytree(bundled_minilm(), base)
    return multi_vector_folder(base, DIM, **settings)


SETTINGS = {
    "expanded": {"expansion": {"strategy": "fixed", "length": 12}, "prompts": {"query": "query: ", "document": "d: "}},
    "attended": {"expansion": {"strategy": "fixed", "length": 12, "attend": True}},
    "plain": {"expansion": None, "skiplist_words": ["!", ",", "."]},
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_our_tokens_are_sentence_transformers(tmp_path: Path, name: str) -> None:
    """Each text's tokens as ours (without the zero tokens) equal MultiVectorEncoder's encode, float64."""
    from sentence_transformers import MultiVectorEncoder

    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs, build_tokenizer

    folder = _minilm_mve(tmp_path, **SETTINGS[name])
    theirs = MultiVectorEncoder(str(folder), device="cpu", local_files_only=True).double().eval()
    args = BiEncoderArgs(path=str(folder), query_length=12).resolve()  # a run's: data.context_length = 0
    assert (args.pooling, args.colbert_dim, args.doc_length) == ("colbert", DIM, 10)
    assert read_text_folder(str(folder)).colbert.query_length == 12
    assert args.query_expansion == (name != "plain")
    ours, tokenizer = BiEncoder(args).double().eval(), build_tokenizer(args)
    with torch.no_grad():
        for side, ids, want in (
            ("query", tokenizer.encode_queries(TEXTS, args.query_length), theirs.encode_query(TEXTS)),
            ("doc", tokenizer.encode_docs(TEXTS), theirs.encode_document(TEXTS)),
        ):
            for i, row in enumerate(ours.embed_side(side, ids)):
                tokens = row.view(-1, DIM)
                kept = tokens[(tokens != 0).any(1)]
                assert kept.shape == want[i].shape, (side, i)
                assert (kept - want[i]).abs().max() < 1e-12, (side, i)
    if name == "plain":  # the skiplist left something out of a document, and queries kept their punctuation
        assert len(want[2]) < 10 and len(theirs.encode_query(TEXTS)[2]) == 12


def test_a_step_from_a_multi_vector_encoder_equals_the_definition(tmp_path: Path) -> None:
    """GradCache from a MultiVectorEncoder folder of the tiny encoder (its projection read): InfoNCE over MaxSim."""
    folder = multi_vector_folder(colbert_encoder(tmp_path), DIM, expansion={"strategy": "fixed", "length": 12})
    pairs_file(tmp_path)
    step_against(tmp_path, KINDS["gradcache"], *COLBERT, f"--model.path={folder}", reference=_dense)
    from safetensors.torch import load_file

    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs

    head = BiEncoder(BiEncoderArgs(path=str(folder))).query_head.weight.detach()
    assert torch.equal(head, load_file(str(folder / "1_Dense" / "model.safetensors"))["linear.weight"])


def _one_step(tmp: Path, *options: str) -> Path:
    pairs_file(tmp)
    run = make_trainer(
        tmp, "--training.local_batch_size=6", "--training.steps=1", "--checkpoint.enable=true",
        "--data.context_length=0", *options,
    )  # fmt: skip
    run.train()
    run.metrics.close()
    return tmp / "run" / "checkpoint" / "step-1"


def test_runs_export_as_multi_vector_encoders(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """From a MultiVectorEncoder, a PyLate folder (prefix tokens, expansion attended, a skiplist) and a plain encoder
    (a new projection): `--to sentence-transformers` writes a MultiVectorEncoder whose tokens of both sides are the
    run's (the exporter checks, and refuses otherwise), with the run's settings; ours reads it back as it was."""
    from titan_contrastive.export import main as export_main
    from titan_contrastive.models.bi_encoder import BiEncoderArgs

    encoder = colbert_encoder(tmp_path)
    starts = {
        "mve": (f"--model.path={multi_vector_folder(encoder, DIM, expansion={'strategy': 'fixed', 'length': 12})}",),
        "pylate": (f"--model.path={pylate_folder(encoder, DIM, attend_to_expansion_tokens=True)}",),
        "new": (f"--model.path={encoder}", *COLBERT, "--data.context_length=12"),
    }
    for name, options in starts.items():
        (tmp_path / name).mkdir()
        step = _one_step(tmp_path / name, *options)
        out = tmp_path / f"{name}-st"
        assert export_main([str(step), "--to", "sentence-transformers", "--out", str(out)]) == 0, name
        modules = [m["type"].rsplit(".", 1)[-1] for m in json.loads((out / "modules.json").read_text())]
        assert modules == ["Transformer", "Dense", "MultiVectorMask", "Normalize"]
        bert = json.loads((out / "sentence_bert_config.json").read_text())
        assert bert["query_expansion"]["attend"] == (name == "pylate") and bert["query_length"] == 12
        prompts = json.loads((out / "config_sentence_transformers.json").read_text())["prompts"]
        assert prompts == ({"query": "[Q] ", "document": "[D] "} if name == "pylate" else {"query": "", "document": ""})
        skiplist = json.loads((out / "2_MultiVectorMask" / "config.json").read_text())["skiplist_words"]
        if name == "new":  # PyLate's default skiplist, whose words outside the tiny vocabulary skipped [UNK]
            assert skiplist[-1] == "[UNK]" and {".", ",", "!"} < set(skiplist)
        else:  # the folder's ("!" is outside the vocabulary: PyLate's [UNK])
            assert skiplist == ([".", ",", "!", "[UNK]"] if name == "pylate" else [".", ","])
        args = BiEncoderArgs(path=str(out)).resolve()
        assert (args.pooling, args.colbert_dim, args.doc_length) == ("colbert", DIM, 12 if name == "new" else 10)
        assert read_text_folder(str(out)).colbert.query_length == 12
    capsys.readouterr()
    assert export_main([str(step), "--to", "hf", "--out", str(tmp_path / "hf")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--to hf: this run is a ColBERT model (model.pooling='colbert'), whose projection a transformers" in line


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"keep_only_token_ids": [5]}, r"2_MultiVectorMask/config.json: keep_only_token_ids=\[5\]; the skiplist is"),
        ({"skiplist_tasks": ["query", "document"]}, r"skiplist_tasks=\['query', 'document'\]; the skiplist is appl"),
        ({"expansion": {"strategy": "min", "length": 12}}, r"query_expansion strategy 'min' lets a long query through"),
        ({"dense_activation": torch.nn.Tanh()}, r"1_Dense: a Dense with torch.nn.modules.activation.Tanh projects"),
        ({"modules": ["transformer", "dense", "mask"]}, r"a MultiVectorEncoder with modules \['Transformer', 'Dense',"),
    ],
    ids=["allowlist", "query-skiplist", "min-expansion", "tanh", "no-normalize"],
)
def test_what_we_do_not_compute_is_one_line(tmp_path: Path, settings: dict, message: str) -> None:
    from titan_contrastive.models.bi_encoder import BiEncoderArgs

    folder = multi_vector_folder(colbert_encoder(tmp_path), DIM, **settings)
    with pytest.raises(ConfigError, match=message):
        BiEncoderArgs(path=str(folder)).resolve()


# ------------------------------------------------------------------ its losses against our objectives


def _model(tmp: Path):
    from sentence_transformers import MultiVectorEncoder

    folder = _minilm_mve(tmp, expansion={"strategy": "fixed", "length": 12})
    return MultiVectorEncoder(str(folder), device="cpu", local_files_only=True).double().eval()


def _features(model, k: int) -> list[dict]:
    """query, positive, negative columns, tokenized and stamped with their task as its collator does."""
    columns = [QUERIES, POSITIVES, *([n[j] for n in NEGATIVES] for j in range(k))]
    features = []
    for i, texts in enumerate(columns):
        task = "query" if i == 0 else "document"
        features.append({**model.preprocess(texts, task=task), "task": task})
    return features


def _rows(model, features: dict) -> torch.Tensor:
    """Its token embeddings as our rows [B, L * d]: a token its scoring mask leaves out is the zero vector."""
    out = model(dict(features), task=features["task"])
    tokens = out["token_embeddings"] * out["attention_mask"].bool()[..., None]
    return tokens.flatten(1)


def _ours(model, objective, k: int, teacher: torch.Tensor | None = None, scale: float = 1.0):
    q, p, *negs = (_rows(model, f) for f in _features(model, k))
    width = max(r.shape[1] for r in (p, *negs))  # the columns padded to one length with zero tokens
    p, *negs = (torch.nn.functional.pad(r, (0, width - r.shape[1])) for r in (p, *negs))
    cols = torch.cat([p, torch.stack(negs, 1).flatten(0, 1)]) if negs else p
    if teacher is not None:
        objective = objective.with_teacher(teacher)
    loss = objective.dense(q, cols, torch.tensor(scale, dtype=torch.float64))
    loss.backward()
    return loss.item(), _grads(model)


def _theirs(model, loss, k: int, labels=None, factor: float = 1.0):
    value = loss(_features(model, k), labels) * factor
    value.backward()
    return value.item(), _grads(model)


TEACHER = torch.tensor([[9.5, 6.0, 1.5], [8.0, 5.5, 2.0], [9.0, 7.0, 3.5], [7.5, 1.0, 6.5]], dtype=torch.float64)


@pytest.mark.parametrize("cached", [False, True])
def test_multiple_negatives_ranking_is_one_way_infonce_over_maxsim(tmp_path: Path, cached: bool) -> None:
    """With two hard negatives each (its query-major columns against our positives-first; the cached form in
    mini-batches of 3 that divide nothing): the same loss and gradients."""
    from sentence_transformers.multi_vector_encoder import losses

    model = _model(tmp_path)
    if cached:
        st = losses.CachedMultiVectorMultipleNegativesRankingLoss(model, mini_batch_size=3)
    else:
        st = losses.MultiVectorMultipleNegativesRankingLoss(model)
    want = _theirs(model, st, 2)
    _assert_same(_ours(model, LateInteraction(DIM), 2), want, ST_REL)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_distill_kl_div_is_our_kl_over_maxsim(tmp_path: Path, temperature: float) -> None:
    """Its KL at temperature T, over T² (our KL has no T² factor), is ours with t = 1 / T and tau = T, alone."""
    from sentence_transformers.multi_vector_encoder import losses

    model = _model(tmp_path)
    want = _theirs(
        model, losses.MultiVectorDistillKLDivLoss(model, temperature=temperature), 2, TEACHER, temperature**-2
    )
    ours = late_interaction(Distilled(InfoNCE(False), Distillation("kl", temperature=temperature), 0.0), DIM)
    _assert_same(_ours(model, ours, 2, TEACHER, 1 / temperature), want, ST_REL)


def test_margin_mse_is_our_margin_mse_over_maxsim(tmp_path: Path) -> None:
    from sentence_transformers.multi_vector_encoder import losses

    model = _model(tmp_path)
    want = _theirs(model, losses.MultiVectorMarginMSELoss(model), 2, TEACHER)
    ours = late_interaction(Distilled(InfoNCE(False), Distillation("margin_mse"), 0.0), DIM)
    _assert_same(_ours(model, ours, 2, TEACHER), want, ST_REL)
