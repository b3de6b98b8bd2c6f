"""ColBERT (`[model] pooling = "colbert"`, `models/bi_encoder/colbert.py`): the token embeddings of a PyLate folder
against PyLate's computation written here from its code (its tokenize's prefix insertion and query expansion, its
Dense, its skiplist), in float64; every step kind's loss and parameter gradients against InfoNCE over MaxSim written
from the definition (`tests/test_late_interaction.py`), with hard negatives, dropout on, under FSDP2 on two
ranks; the settings ColBERT cannot take refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.colbert_folders import colbert_encoder, pylate_folder
from tests.dist_utils import run_distributed
from tests.needs import needs
from tests.test_hard_negatives import assert_step_equals_its_forwards, make_trainer, pairs_file, step_against
from tests.test_late_interaction import reference
from tests.test_late_masks import reference as masked_reference
from tests.test_trainer import full, grads

DIM = 8
TEXTS = ["a cat , kept as pet .", "the dog . a wolf !", "ice", "water is frozen in winter after the autumn season"]


def _pylate_tokens(folder: Path, texts: list[str], is_query: bool) -> torch.Tensor:
    """[B, L, dim]: PyLate's ColBERT.encode of `texts` before its per-text filtering, a left-out token zero."""
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoTokenizer

    config = json.loads((folder / "config_sentence_transformers.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.pad_token = tokenizer.mask_token  # PyLate pads with the mask token
    length = config["query_length" if is_query else "document_length"]
    expand = is_query and config["do_query_expansion"]
    enc = tokenizer(
        texts, truncation=True, max_length=length - 1, padding="max_length" if expand else True, return_tensors="pt"
    )
    prefix = tokenizer.convert_tokens_to_ids(config["query_prefix" if is_query else "document_prefix"])
    ids, attention = (torch.cat([t[:, :1], torch.full_like(t[:, :1], v), t[:, 1:]], 1) for t, v in
                      ((enc["input_ids"], prefix), (enc["attention_mask"], 1)))  # fmt: skip
    if is_query and config["attend_to_expansion_tokens"]:
        attention.fill_(1)
    model = AutoModel.from_pretrained(folder).double().eval()
    hidden = model(input_ids=ids, attention_mask=attention).last_hidden_state
    weight = load_file(str(folder / "1_Dense" / "model.safetensors"))["linear.weight"].double()
    tokens = F.normalize(hidden @ weight.T, dim=-1)
    if is_query:
        keep = torch.ones_like(attention) if expand else attention
    else:
        skip = torch.tensor(tokenizer.convert_tokens_to_ids(config["skiplist_words"]))
        keep = attention.bool() & ~torch.isin(ids, skip)
    return tokens * keep[..., None]


def _ours(folder: Path, texts: list[str], is_query: bool) -> torch.Tensor:
    import dataclasses

    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs, build_tokenizer

    config = json.loads((folder / "config_sentence_transformers.json").read_text())
    args = dataclasses.replace(BiEncoderArgs(path=str(folder)).resolve(), query_length=config["query_length"])
    assert (args.pooling, args.colbert_dim, args.doc_length) == ("colbert", DIM, config["document_length"])
    tokenizer = build_tokenizer(args)
    ids = tokenizer.encode_queries(texts, args.query_length) if is_query else tokenizer.encode_docs(texts)
    model = BiEncoder(args).double().eval()
    with torch.no_grad():
        return model.embed_side("query" if is_query else "doc", ids).view(len(texts), -1, DIM)


@needs("hf")
@pytest.mark.parametrize(
    "settings",
    [{}, {"do_query_expansion": False}, {"attend_to_expansion_tokens": True}],
    ids=["expansion", "no-expansion", "attend-expansion"],
)
def test_embeddings_follow_pylate(tmp_path: Path, settings: dict) -> None:
    """Queries (the [Q] prefix, padding by [MASK] tokens that are scored) and documents (the [D] prefix, the
    skiplist's punctuation and [UNK], PyLate's id for "!", left out) equal PyLate's tokens within 1e-12."""
    folder = pylate_folder(colbert_encoder(tmp_path), DIM, **settings)
    for is_query in (True, False):
        want = _pylate_tokens(folder, TEXTS, is_query)
        got = _ours(folder, TEXTS, is_query)
        want = F.pad(want, (0, 0, 0, got.shape[1] - want.shape[1]))
        assert (got - want).abs().max() < 1e-12
    zero = [row.nonzero()[:, 0].tolist() for row in (got == 0).all(-1)]  # [CLS] [D] text [SEP], padded to 10
    assert zero[:3] == [[4, 8], [4, 7, 9], [4, 5, 6, 7, 8, 9]]  # "," "." "!" (as [UNK]); padding


def dense_with(trainer, every: dict, loss_of) -> tuple[float, dict[str, torch.Tensor]]:
    """`loss_of(q, p, n, scale)` (`loss_of(q, p, n, scale, bias)` for a model with a bias) over all samples (two hard
    negatives each) on a float64 copy of the model in the trainer's mode: the loss and every parameter gradient."""
    from titan_contrastive.batching import with_negatives
    from titan_contrastive.losses import split_documents

    model = trainer.spec.build_model(trainer.model_args).double()
    model.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    model.train(trainer.model.training)
    q, d, *temperature = model(every["query"], with_negatives(every["doc"], every["neg"], model.pad_id))
    loss = loss_of(q, *split_documents(d.reshape(len(q), 3, -1)), *temperature)
    loss.backward()
    return loss.item(), grads(model)


def _dense(trainer, every: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """InfoNCE over MaxSim from the definition over all samples, on a copy of the model in the trainer's mode."""
    return dense_with(trainer, every, lambda q, p, n, s: reference(q, p, n, s, trainer.cfg.loss.symmetric, DIM))


KINDS = {  # local batch, accumulation steps, options
    "accumulate": (6, 1, []),
    "gradcache": (6, 1, ["--gradcache.enabled=true", "--gradcache.chunk_sizes=4"]),
    "global": (3, 2, ["--loss.negatives=global", "--loss.stream_chunk_size=5", "--loss.symmetric=false"]),
}
COLBERT = ["--model.pooling=colbert", f"--model.colbert_dim={DIM}", "--data.doc_context_length=12"]


def _step(tmp: Path, kind: str) -> None:
    trainer = step_against(tmp, KINDS[kind], *COLBERT, reference=_dense)
    assert "late interaction" in trainer.gradient_step.describe()


@needs("hf")
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_step_kind_equals_the_definition(tmp_path: Path, kind: str) -> None:
    """MiniLM as ColBERT (a new 8-wide projection; queries 16 tokens, documents 12), two hard negatives per row."""
    pairs_file(tmp_path)
    _step(tmp_path, kind)


MASKED = ["--loss.mask_relative=0.9", "--loss.mask_duplicates=true", "--loss.hardness_strength=2"]


def _dense_masked(trainer, every: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """The masked and weighted InfoNCE over MaxSim of tests/test_late_masks.py over all samples, the documents' ids
    equal where their token ids are; asserts the mask removes something."""
    from titan_contrastive.batching import with_negatives
    from titan_contrastive.losses import FalseNegatives, Hardness

    rows = with_negatives(every["doc"], every["neg"], trainer.model.pad_id).view(len(every["doc"]), 3, -1)
    ids = torch.unique(torch.cat([rows[:, 0], rows[:, 1:].flatten(0, 1)]), dim=0, return_inverse=True)[1]
    masking, hardness = FalseNegatives(duplicates=True, relative=0.9), Hardness(strength=2.0)

    def loss_of(q, p, n, s, masking=masking):
        return masked_reference(q, p, n, s, ids, False, masking, hardness, False, dim=DIM)

    unmasked = dense_with(trainer, every, lambda *z: loss_of(*z, masking=FalseNegatives()))[0]
    loss, want = dense_with(trainer, every, loss_of)
    assert abs(loss - unmasked) > 1e-3, "the mask removes nothing here"
    return loss, want


@needs("hf")
@pytest.mark.parametrize("kind", list(KINDS))
def test_masks_and_hardness_in_every_step_kind(tmp_path: Path, kind: str) -> None:
    """colpali-engine's positive-aware negative filtering as NV-Retriever's rule, and LLaVE's hardness weighting."""
    pairs_file(tmp_path)
    trainer = step_against(tmp_path, KINDS[kind], *COLBERT, *MASKED, "--loss.symmetric=false", reference=_dense_masked)
    assert "false negatives masked (duplicate ids or MaxSim > 0.9 x positive)" in trainer.gradient_step.describe()


def _dense_guided(trainer, every: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """tests/test_late_masks.py's reference over all samples, the frozen guide's cosines deciding the masks; asserts
    they decide otherwise than the model's MaxSim."""
    from titan_contrastive.batching import with_negatives
    from titan_contrastive.losses import FalseNegatives, Hardness

    docs = with_negatives(every["doc"], every["neg"], trainer.model.pad_id)
    with torch.no_grad():
        gq, gd = trainer.step_context.guide(every["query"], docs)[:2]
    gd = gd.double().view(len(gq), 3, -1)
    guide = (gq.double(), gd[:, 0], gd[:, 1:].flatten(0, 1))
    ids, masking = torch.arange(len(docs)), FalseNegatives(relative=0.9)

    def loss_of(q, p, n, s, guide=guide):
        return masked_reference(q, p, n, s, ids, True, masking, Hardness(), False, guide, dim=DIM)

    by_model = dense_with(trainer, every, lambda *z: loss_of(*z, guide=None))[0]
    loss, want = dense_with(trainer, every, loss_of)
    assert abs(loss - by_model) > 1e-3, "the guide masks what the model would"
    return loss, want


@needs("hf")
def test_a_guide_decides_the_masks(tmp_path: Path, guide_dir: Path) -> None:
    """GISTEmbed with a ColBERT student: a frozen single-vector guide's cosines decide which columns leave."""
    pairs_file(tmp_path)
    options = [f"--loss.guide_model={guide_dir}", "--loss.mask_relative=0.9"]
    trainer = step_against(tmp_path, KINDS["gradcache"], *COLBERT, *options, reference=_dense_guided)
    assert "the frozen guide's cosines" in trainer.gradient_step.describe()


@needs("hf", "data")
def test_a_guide_written_ahead_decides_the_masks(tmp_path: Path) -> None:
    """The same with a guide's embeddings read from a file (`loss.guide_embeddings`): random vectors per text."""
    from tests.test_frozen_embeddings import _records, _write
    from tests.test_hard_negatives import WORDS
    from titan_contrastive.losses import FalseNegatives, Hardness

    pairs_file(tmp_path)
    records = _records([tuple(row) for row in WORDS], width=6)
    vectors = {(r["side"], r["text"]): F.normalize(torch.tensor(r["embedding"]), dim=0) for r in records}
    file = _write(tmp_path / "guide.parquet", records)

    def reference(trainer, every: dict) -> tuple[float, dict[str, torch.Tensor]]:
        rows = [WORDS[r] for r in trainer.train_set.rows(every["index"].tolist())]  # the file's rows, in its order
        gq = torch.stack([vectors["query", r[0]] for r in rows]).double()
        gp = torch.stack([vectors["document", r[1]] for r in rows]).double()
        gn = torch.stack([vectors["document", t] for r in rows for t in r[2:4]]).double()
        ids, masking = torch.arange(3 * len(rows)), FalseNegatives(relative=0.5)

        def loss_of(q, p, n, s, guide=(gq, gp, gn)):
            return masked_reference(q, p, n, s, ids, True, masking, Hardness(), False, guide, dim=DIM)

        by_model = dense_with(trainer, every, lambda *z: loss_of(*z, guide=None))[0]
        loss, want = dense_with(trainer, every, loss_of)
        assert abs(loss - by_model) > 1e-3, "the file's guide masks what the model would"
        return loss, want

    options = [f"--loss.guide_embeddings={file}", "--loss.mask_relative=0.5"]
    trainer = step_against(tmp_path, KINDS["gradcache"], *COLBERT, *options, reference=reference)
    assert "the frozen guide's cosines (embedded ahead, from the data)" in trainer.gradient_step.describe()


def _step_distributed(tmp: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    _step(Path(tmp), "global")


@needs("hf")
@pytest.mark.slow  # 15 s; the objective's forms run on 2 and 4 processes in test_late_interaction.py
def test_global_negatives_on_two_ranks(tmp_path: Path) -> None:
    pairs_file(tmp_path)
    run_distributed(_step_distributed, 2, str(tmp_path))


@needs("hf")
def test_gradcache_with_dropout_on(tmp_path: Path) -> None:
    """GradCache's re-forward replays each chunk's dropout: the step equals the objective over the same forwards."""
    pairs_file(tmp_path)
    trainer = make_trainer(tmp_path, "--training.local_batch_size=6", *COLBERT, *KINDS["gradcache"][2])
    assert trainer.model.training
    batch = trainer.train_set.__getitems__(list(range(6)))
    chunks = [{k: v[i : i + 4] for k, v in batch.items()} for i in (0, 4)]
    assert_step_equals_its_forwards(trainer, [batch], chunks, seed=5, objective=trainer.objective)
    trainer.metrics.close()


def _configured(*argv: str):
    from titan_contrastive import models
    from titan_contrastive.config import parse_args
    from titan_contrastive.models.build import run_objectives

    cfg = parse_args(["--model.name=bi_encoder", *argv])
    spec = models.get_model_spec("bi_encoder")
    args = models.configured(models.resolve_model_args("bi_encoder", "shared")[0], cfg, spec)
    return args, run_objectives(spec, cfg, args)


@needs("hf")
def test_settings_colbert_cannot_take_are_one_line(tmp_path: Path) -> None:
    from titan_contrastive.config import ConfigError

    args, (objective, _) = _configured("--model.pooling=colbert")
    assert (args.colbert_dim, args.query_expansion, args.init_scale) == (128, True, 1.0)
    assert objective.describe() == "clip loss (InfoNCE over late interaction, MaxSim of 128-wide tokens, symmetric)"
    folder = pylate_folder(colbert_encoder(tmp_path), DIM)
    cases = {
        ("--model.colbert_dim=8",): r"^model.colbert_dim=8: model.pooling is 'mean'; it applies to model.pooling='c",
        ("--model.query_expansion=false",): r"^model.query_expansion=false: model.pooling is 'mean'",
        (
            "--model.pooling=colbert",
            "--loss.matryoshka_dims=256",
        ): r"^loss.matryoshka_dims=\[256\]: the tokens have 128",
        ("--model.pooling=colbert", "--loss.symmetric=false", "--loss.joint_directions=doc_to_doc"): r"^model.po",
        (f"--model.path={folder}", "--model.colbert_dim=4"): r"^model.colbert_dim=4: the PyLate folder projects tok",
        (f"--model.path={folder}", "--model.pooling=mean"): r"^model.pooling='mean' with .*: a PyLate folder embeds",
        ("--model.pooling=colbert", "--model.freeze=query"): r"^model.freeze=\['query'\]: a locked tower runs without",
        ("--model.pooling=colbert", "--eval.reranking_path=r.jsonl"): r"^eval.reranking_path=r.jsonl: model.pool",
        ("--model.pooling=colbert", "--eval.clustering_path=c.jsonl"): r"^eval.clustering_path=c.jsonl: model.poo",
        ("--model.pooling=colbert", "--eval.pair_classification_path=p.jsonl"): r"^eval.pair_classification_path=p",
        ("--model.pooling=colbert", "--eval.triplet_path=t.jsonl"): r"^eval.triplet_path=t.jsonl: model.pooling=",
        ("--model.pooling=colbert", "--eval.mmeb_path=m"): r"^eval.mmeb_path=m: model.pooling='colbert' embeds",
        ("--model.pooling=colbert", "--eval.classification_path=c"): r"^eval.classification_path=c: model.pooling=",
    }
    for argv, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            _configured(*argv)
    args, _ = _configured(f"--model.path={folder}")
    assert (args.pooling, args.colbert_dim, args.query_prompt, args.doc_prompt) == ("colbert", DIM, "[Q] ", "[D] ")


def test_beir_top_k_scores_by_late_interaction() -> None:
    """Retrieval's running top-k over corpus chunks that divide nothing, scored by MaxSim, equals the top-k of the
    scores written from the definition."""
    from tests.test_late_interaction import maxsim, problem
    from titan_contrastive.components.retrieval_metrics import top_k
    from titan_contrastive.losses.late_interaction import LateInteraction

    q, p, n, *_ = problem(2, seed=4)
    corpus = torch.cat([p, n])
    want = torch.tensor([[float(maxsim(qi, d, 3)) for d in corpus] for qi in q]).float().topk(5)
    scores, indices = top_k(q, corpus, 5, chunk=7, similarity=LateInteraction(3).similarity)
    assert torch.equal(indices, want.indices) and (scores - want.values).abs().max() < 1e-5


@needs("hf")
@pytest.mark.parametrize("dims", [[], ["--loss.matryoshka_dims=8,4"]], ids=["whole", "token-prefixes"])
def test_training_evaluates_by_late_interaction(tmp_path: Path, dims: list[str]) -> None:
    """A PyLate folder trained one step, evaluated on held-out pairs (recall both ways, the loss) and on a BEIR
    folder, every text scored by MaxSim; with Matryoshka prefixes also at each token's first 4 dims."""
    from tests.test_hf_text import PAIRS
    from tests.test_retrieval_metrics import write_beir
    from tests.test_trainer import make_trainer as base

    folder = pylate_folder(colbert_encoder(tmp_path), DIM)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"query": q, "positive": p}) + "\n" for q, p in PAIRS))
    trainer = base(
        str(tmp_path / "run"),
        "--model.name=bi_encoder",
        f"--model.path={folder}",
        "--data.dataset=pairs",
        f"--data.path={pairs}",
        f"--data.val_path={pairs}",
        "--data.context_length=0",
        "--training.local_batch_size=6",
        "--training.steps=1",
        "--eval.enable=true",
        f"--eval.beir_path={write_beir(tmp_path / 'beir')}",
        *dims,
    )
    assert trainer.model_args.query_length == 12  # the PyLate folder's, data.context_length being 0
    trainer.train()
    trainer.metrics.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (evaluated,) = [row for row in rows if row.get("kind") == "eval"]
    assert 0 <= evaluated["beir/ndcg@10"] <= 1 and 0 <= evaluated["query_to_doc_r@1"] <= 1 and evaluated["loss"] > 0
    cuts = [key for key in evaluated if key.startswith("dim")]
    ranked = [k for k in evaluated if k.startswith(("beir/", "query_to", "doc_to")) and k != "beir/corpus_tokens"]
    assert sorted(cuts) == (sorted(f"dim4/{k}" for k in ranked) if dims else [])
    assert evaluated["beir/corpus_tokens"] > 1  # the vectors a document keeps, whatever the cut


@needs("hf")
def test_a_step_exports_to_pylate_and_back(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A ColBERT step from a PyLate folder written as a PyLate folder (its projection, prefixes, lengths, skiplist)
    whose embeddings of both sides are the run's (the exporter checks); a new projection's run too; `--to hf`, which
    cannot hold it, and the miner refuse in one line; the counts include the projection (`--to sentence-transformers`:
    tests/test_multi_vector.py)."""
    from titan_contrastive.export import main as export_main
    from titan_contrastive.mine import main as mine_main
    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs

    folder = pylate_folder(colbert_encoder(tmp_path), DIM, attend_to_expansion_tokens=True, skiplist_words=["."])
    pairs_file(tmp_path)
    run = make_trainer(
        tmp_path, f"--model.path={folder}", "--training.local_batch_size=6", "--training.steps=1",
        "--checkpoint.enable=true", "--data.context_length=0",
    )  # fmt: skip
    run.train()
    run.metrics.close()
    step = tmp_path / "run" / "checkpoint" / "step-1"
    assert export_main([str(step), "--to", "pylate", "--out", str(tmp_path / "pylate")]) == 0
    written = json.loads((tmp_path / "pylate" / "config_sentence_transformers.json").read_text())
    assert (written["query_prefix"], written["query_length"], written["document_length"]) == ("[Q] ", 12, 10)
    assert (written["skiplist_words"], written["attend_to_expansion_tokens"]) == (["."], True)
    args = BiEncoderArgs(path=str(tmp_path / "pylate")).resolve()
    assert (args.pooling, args.colbert_dim, args.query_prompt) == ("colbert", DIM, "[Q] ")
    assert args.num_params() == sum(p.numel() for p in BiEncoder(args).parameters())
    (tmp_path / "minilm").mkdir()
    pairs_file(tmp_path / "minilm")
    minilm = make_trainer(
        tmp_path / "minilm", *COLBERT, "--training.local_batch_size=6", "--training.steps=1", "--checkpoint.enable=true"
    )
    minilm.train()
    minilm.metrics.close()
    new = tmp_path / "minilm" / "run" / "checkpoint" / "step-1"
    assert export_main([str(new), "--to", "pylate", "--out", str(tmp_path / "minilm-pylate")]) == 0
    written = json.loads((tmp_path / "minilm-pylate" / "config_sentence_transformers.json").read_text())
    assert (written["query_prefix"], written["document_prefix"], written["document_length"]) == ("", "", 12)
    capsys.readouterr()
    assert export_main([str(step), "--to", "hf", "--out", str(tmp_path / "hf")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "this run is a ColBERT model (model.pooling='colbert'), whose projection a transformers folder" in line
    assert mine_main([str(tmp_path / "pairs.jsonl"), "--model", str(step), "--out", str(tmp_path / "m.jsonl")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "a colbert run (model.pooling='colbert'), and sentence-transformers' miner ranks dense" in line


@needs("hf")
def test_standalone_evaluation_ranks_by_late_interaction(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`python -m titan_contrastive.evaluate` on a PyLate folder: its query length, BEIR by MaxSim, also at each
    token's first 4 dims; a cut wider than the tokens refused in one line."""
    from tests.test_retrieval_metrics import write_beir
    from titan_contrastive.evaluate import load_text_model, main

    folder = pylate_folder(colbert_encoder(tmp_path), DIM)
    beir = write_beir(tmp_path / "beir")
    args, model = load_text_model(str(folder), 0, 0)
    assert (args.query_length, model.token_dim) == (12, DIM)
    assert main([str(folder), "--beir", str(beir), "--out", str(tmp_path / "m.json")]) == 0
    assert 0 <= json.loads((tmp_path / "m.json").read_text())["ndcg@10"] <= 1
    capsys.readouterr()
    assert main([str(folder), "--beir", str(beir), "--dims", "4", "--out", str(tmp_path / "d.json")]) == 0
    assert 0 <= json.loads((tmp_path / "d.json").read_text())["dim4/ndcg@10"] <= 1
    capsys.readouterr()
    assert main([str(folder), "--beir", str(beir), "--dims", "16"]) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert "--dims [16]: " in line and "tokens have 8 dimensions; use dims <= 8" in line
