"""The static family (sentence-transformers' StaticEmbedding as a dual encoder): a StaticEmbedding folder embeds as
`SentenceTransformer(folder).encode` does (prompts, a literal special token, an empty text), a model2vec folder
(vocabulary-quantized too) as model2vec's own `encode`; every step kind (plain, GradCache by samples and by tokens,
global negatives) equals InfoNCE written from the definition over the whole batch, loss and the tables' and
scale's gradients in float64 within 1e-10, on 1, 2 and 4 gloo processes (FSDP2 and DDP), with hard negatives and
chunk sizes that divide nothing (a lookup has no dropout); a step exports to a sentence-transformers folder that
reads back as a static folder; the counts are exact; what it cannot take is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import run_distributed, write_once
from tests.hf_folders import WORDS
from tests.hf_folders import _bert_tokenizer as bert_tokenizer
from tests.needs import needs
from tests.test_hard_negatives import assert_grads_close
from tests.test_trainer import full
from tests.test_trainer import make_trainer as base_trainer

PROMPTS = {"query": "query ", "document": "represent the passage "}
ROWS = [  # query, positive, hard negative: every word in the test vocabulary
    ("a small animal kept as a pet", "cat", "dog"),
    ("a feline kept as a pet", "cat", "tiger"),
    ("a vehicle with wheels", "car", "bicycle"),
    ("frozen water", "ice", "steam"),
    ("the season after summer", "autumn", "winter"),
    ("a person who flies an aircraft", "pilot", "sailor"),
    ("a musical instrument with black and white keys", "piano", "guitar"),
    ("a domestic animal", "dog", "wolf"),
    ("what is the season after autumn", "winter", "spring"),
    ("a small vehicle with wheels for a person", "bicycle", "bus"),
    ("steam from water", "steam", "snow"),
    ("a person who is a driver of a bus", "driver", "pilot"),
    ("an animal of the snow", "wolf", "tiger"),
    ("a feline with black and white", "tiger", "cat"),
    ("frozen water in winter", "snow", "ice"),
    ("the season after winter", "spring", "summer"),
    ("the season after spring", "summer", "autumn"),
    ("a person who is a sailor", "sailor", "pilot"),
    ("a small musical instrument", "violin", "piano"),
    ("a musical instrument", "guitar", "violin"),
    ("a vehicle for a person", "bus", "car"),
    ("a vehicle that flies", "aircraft", "bus"),
    ("what is a pet", "pet", "wolf"),
    ("the water of the season", "water", "steam"),
]


def static_folder(root: Path, dim: int = 8, prompts: dict[str, str] | None = None) -> Path:
    """A StaticEmbedding (a random table over the test vocabulary) saved by sentence-transformers, with `prompts`."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding

    torch.manual_seed(0)
    folder = root / "static"
    module = StaticEmbedding(bert_tokenizer(), embedding_dim=dim)
    SentenceTransformer(modules=[module], device="cpu", prompts=prompts or {}).save(str(folder))
    return folder


def _rows(tmp: Path) -> Path:
    rows = tmp / "rows.jsonl"
    rows.write_text("".join(json.dumps({"query": q, "positive": p, "negative": n}) + "\n" for q, p, n in ROWS))
    return rows


def static_run(tmp: Path, *extra: str):
    """A trainer of the static family on the StaticEmbedding folder and the rows above (each written once per tmp)."""
    folder = write_once(tmp / "static", lambda: static_folder(tmp))
    rows = write_once(tmp / "rows.jsonl", lambda: _rows(tmp))
    return base_trainer(
        str(tmp / "run"), "--model.name=static", f"--model.path={folder}", "--data.dataset=pairs",
        f"--data.path={rows}", "--data.context_length=12", "--data.doc_context_length=6", "--eval.enable=false",
        *extra,
    )  # fmt: skip


def defined_embeddings(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The definition: the mean of the table's rows over each text's token ids (padding is -1), normalized; 0 for a
    text without tokens."""
    rows = [table[row[row >= 0]].mean(0) if (row >= 0).any() else table.new_zeros(table.shape[1]) for row in ids]
    return F.normalize(torch.stack(rows), dim=-1)


def defined_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], symmetric: bool) -> torch.Tensor:
    """InfoNCE over the whole batch from the definition: query i against every positive and every hard negative,
    its own positive the target; `symmetric`: also each positive against every query."""
    q = defined_embeddings(model.query_embedding.weight, batch["query"])
    docs = batch["doc"] if "neg" not in batch else torch.cat([batch["doc"], batch["neg"].flatten(0, 1)])
    d = defined_embeddings(model.doc_embedding.weight, docs)
    logits = model.logit_scale.exp() * q @ d.T
    target = torch.arange(len(q))
    loss = F.cross_entropy(logits, target)
    return (loss + F.cross_entropy(logits[:, : len(q)].T, target)) / 2 if symmetric else loss


KINDS = {
    "plain": (6, 1, []),
    "gradcache": (6, 1, ["--gradcache.enabled=true", "--gradcache.chunk_sizes=5"]),
    "gradcache-tokens": (6, 1, ["--gradcache.enabled=true", "--gradcache.chunk_tokens=20"]),
    "global": (3, 2, ["--loss.negatives=global", "--loss.stream_chunk_size=5"]),
}


def _step(tmp: Path, kind: str, *extra: str, symmetric: bool = False) -> None:
    """One step of `kind` against `defined_loss` over the whole global batch (every rank's microbatches)."""
    local, ga, args = KINDS[kind]
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    trainer = static_run(
        tmp, f"--training.local_batch_size={local}", f"--training.global_batch_size={local * ga * world}",
        f"--loss.symmetric={str(symmetric).lower()}", *args, *extra,
    )  # fmt: skip
    data = trainer.train_set
    steps = [data.__getitems__(list(range(j * local * world, (j + 1) * local * world))) for j in range(ga)]
    mine = [{k: v[rank * local : (rank + 1) * local] for k, v in s.items()} for s in steps]
    model = float64_copy(trainer)
    every = {k: torch.cat([s[k] for s in steps]) for k in steps[0]}
    assert (every["query"] == -1).any() and every["neg"].shape[1] == 1  # padded, one hard negative per row
    assert_step_is(trainer, mine, model, defined_loss(model, every, symmetric))


def float64_copy(trainer) -> torch.nn.Module:
    """The trainer's model rebuilt in float64 with its (gathered) weights."""
    model = trainer.spec.build_model(trainer.model_args).double()
    model.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    return model


def assert_step_is(trainer, mine: list[dict], model: torch.nn.Module, want_loss: torch.Tensor) -> None:
    """The trainer's step on this rank's microbatches `mine` has loss `want_loss` (computed on `model`, the float64
    copy) and its gradients, within 1e-10."""
    want_loss.backward()
    out = trainer.train_step(mine)
    grads = {n: full(p.grad) for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert_grads_close(grads, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, 1e-10)
    assert abs(out["loss"] - want_loss.item()) <= 1e-10 * want_loss.item()
    trainer.metrics.close()


@needs("hf")
def test_a_static_embedding_folder_embeds_as_sentence_transformers_does(tmp_path: Path) -> None:
    """Queries and documents with the folder's prompts, no special tokens added, a literal "[PAD]" counted as a
    token, an empty text 0: our embeddings equal the folder's `encode` (normalized) in float32."""
    from sentence_transformers import SentenceTransformer

    from titan_contrastive.models.static import StaticEmbedder, build_tokenizer
    from titan_contrastive.models.static.args import DEFAULT_DOC_LENGTH

    folder = static_folder(tmp_path, prompts=PROMPTS)
    args = _args(folder)
    assert (args.query_prompt, args.doc_prompt, args.vocab, args.dim) == (*PROMPTS.values(), 4 + len(WORDS), 8)
    assert args.doc_length == DEFAULT_DOC_LENGTH
    tokenizer, ours = build_tokenizer(args), StaticEmbedder(args)
    texts = [q for q, _, _ in ROWS[:5]] + ["a [PAD] cat", ""]
    with torch.no_grad():
        zq, zd, _ = ours(tokenizer.encode_queries(texts, 32), tokenizer.encode_docs(texts))
    theirs = SentenceTransformer(str(folder), device="cpu")
    for got, name in ((zq, "query"), (zd, "document")):
        want = F.normalize(theirs.encode(texts, convert_to_tensor=True, prompt_name=name), dim=-1)
        assert (got - want).abs().max() <= 1e-6
    assert ours.embed_side("doc", torch.full((2, 3), -1)).eq(0).all()  # no tokens (no prompt either): 0, as theirs


@needs("hf")
@pytest.mark.parametrize("quantized", [False, True])
def test_a_model2vec_folder_embeds_as_model2vec_does(tmp_path: Path, quantized: bool) -> None:
    """A folder model2vec writes (quantized: a token mapping to shared vectors and a weight per token) reads as
    sentence-transformers reads it, and embeds the texts as model2vec's own normalized `encode`."""
    from model2vec import StaticModel

    from titan_contrastive.models.static import StaticEmbedder, build_tokenizer

    tokenizer = bert_tokenizer().backend_tokenizer
    vocab = tokenizer.get_vocab_size()
    generator = torch.Generator().manual_seed(1)
    extra = {}
    if quantized:
        extra = dict(
            token_mapping=torch.randint(0, 7, (vocab,), generator=generator).numpy(),
            weights=torch.rand(vocab, generator=generator).add(0.5).numpy(),
        )
    vectors = torch.randn(7 if quantized else vocab, 6, generator=generator).numpy()
    StaticModel(vectors, tokenizer, normalize=True, **extra).save_pretrained(tmp_path / "m2v")
    args = _args(tmp_path / "m2v")
    assert (args.vocab, args.dim, args.query_prompt) == (vocab, 6, "")
    texts = [q for q, _, _ in ROWS]
    assert set(" ".join(texts).split()) <= set(WORDS)  # model2vec leaves unknown tokens out of its mean; ours not
    with torch.no_grad():
        got = StaticEmbedder(args).embed_side("query", build_tokenizer(args).encode_queries(texts, 32))
    want = StaticModel.from_pretrained(tmp_path / "m2v").encode(texts)
    assert (got - torch.as_tensor(want)).abs().max() <= 1e-6


def _args(path: Path, *extra: str):
    """The static family's args resolved from `--model.path=path` and `extra`, as a run resolves them."""
    from titan_contrastive.config.manager import parse_args
    from titan_contrastive.models import configured, get_model_spec

    cfg = parse_args(["--model.name=static", f"--model.path={path}", *extra])
    spec = get_model_spec("static")
    return configured(spec.flavors[cfg.model.flavor or "shared"], cfg, spec)


@needs("hf")
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_step_kind_equals_the_definition(tmp_path: Path, kind: str) -> None:
    _step(tmp_path, kind)


@needs("hf")
@pytest.mark.parametrize("kind", ["gradcache", "global"])
def test_two_tables_and_both_directions(tmp_path: Path, kind: str) -> None:
    """The dual flavor (a table per side, both learning) with symmetric InfoNCE and a learnt scale."""
    _step(tmp_path, kind, "--model.flavor=dual", symmetric=True)


def _distributed(tmp: str, ddp: bool) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    replicate = ["--parallelism.data_parallel_shard_degree=1", f"--parallelism.data_parallel_replicate_degree={world}"]
    _step(Path(tmp), "global", *(replicate if ddp else []), "--model.flavor=dual")


@needs("hf")
@pytest.mark.parametrize("world,parallel", [(2, "fsdp2"), (2, "ddp"), pytest.param(4, "fsdp2", marks=pytest.mark.slow)])
def test_global_negatives_across_ranks(tmp_path: Path, world: int, parallel: str) -> None:
    """Each table sharded by rows (FSDP2) or replicated (DDP) on 2 and 4 gloo processes."""
    static_folder(tmp_path)
    _rows(tmp_path)
    run_distributed(_distributed, world, str(tmp_path), parallel == "ddp")


@needs("hf")
@pytest.mark.parametrize("flavor", ["shared", "dual"])
def test_a_step_exports_to_sentence_transformers_and_reads_back(tmp_path: Path, flavor: str) -> None:
    """`--to sentence-transformers` writes a StaticEmbedding and a Normalize with the run's prompts, cut at the side's
    length (the exporter checks the probe texts, one longer than that); the folder reads back as a static folder
    that embeds as the run; `--to hf` is refused in one line; `--to model2vec` as `_model2vec_export` says."""
    from titan_contrastive.export import main as export_main
    from titan_contrastive.models.static import StaticEmbedder, build_tokenizer

    run = static_run(
        tmp_path, f"--model.flavor={flavor}", "--model.query_prompt=query ", "--training.local_batch_size=6",
        "--training.steps=1", "--checkpoint.enable=true", "--optimizer.lr=0.1",
    )  # fmt: skip
    run.train()
    run.metrics.close()
    step = tmp_path / "run" / "checkpoint" / "step-1"
    side = "doc" if flavor == "dual" else "query"
    out = tmp_path / "st"
    assert export_main([str(step), "--to", "sentence-transformers", "--tower", side, "--out", str(out)]) == 0
    modules = [m["type"].rsplit(".", 1)[-1] for m in json.loads((out / "modules.json").read_text())]
    assert modules == ["StaticEmbedding", "Normalize"]
    args = _args(out)
    assert (args.query_prompt, args.dim) == ("query ", 8)
    texts = [q for q, _, _ in ROWS]
    again, trained = StaticEmbedder(args), run.model
    with torch.no_grad():
        ids = build_tokenizer(args).encode_queries(texts, 12)
        got = again.embed_side("query", ids)
        want = trained.embed_side(side, ids.to(trained.logit_scale.device)).float()
        other = trained.embed_side("query" if side == "doc" else "doc", ids).float()
    assert (got - want).abs().max() <= 1e-6
    assert ((other - want).abs().max() > 1e-3) == (flavor == "dual")  # the doc table itself, trained apart
    assert export_main([str(step), "--to", "hf", "--out", str(tmp_path / "hf")]) == 2
    assert not (tmp_path / "hf").exists()
    _model2vec_export(tmp_path, step, side, trained)


def _model2vec_export(tmp: Path, step: Path, side: str, trained: torch.nn.Module) -> None:
    """`--to model2vec`: a side with a prompt is refused; one without reads back in model2vec, and as a static folder,
    embedding as the run's table (with model2vec's one difference: an unknown token is left out of its mean)."""
    from model2vec import StaticModel

    from titan_contrastive.export import main as export_main
    from titan_contrastive.models.static import StaticEmbedder, build_tokenizer

    out = tmp / "m2v"
    if side == "query":  # the run's queries carry a prompt
        assert export_main([str(step), "--to", "model2vec", "--out", str(out)]) == 2
        assert not out.exists()
        return
    assert export_main([str(step), "--to", "model2vec", "--tower", side, "--out", str(out)]) == 0
    texts = [d for _, d, _ in ROWS] + ["a cat", "", "a cat zebra"]  # zebra: not in the vocabulary
    args = _args(out)
    with torch.no_grad():
        ids = build_tokenizer(args).encode_docs(texts)
        want = trained.embed_side(side, ids).float()
        again = StaticEmbedder(args).embed_side("doc", ids)
    got = torch.as_tensor(StaticModel.from_pretrained(out).encode(texts))
    assert (again - want).abs().max() <= 1e-6 and (got[:-1] - want[:-1]).abs().max() <= 1e-6
    assert (got[-1] - want[-1]).abs().max() > 1e-3 and (got[-1] - got[-3]).abs().max() <= 1e-6


@needs("hf")
def test_a_table_from_a_tokenizer_and_the_counts(tmp_path: Path) -> None:
    """`static_dim` over a transformers folder's tokenizer (its sentence-transformers wrapper's too): a table of its
    vocabulary drawn N(0, 1) from the run's seed; `num_params` is the model's; no FLOPs are modelled."""
    from tests.hf_folders import encoder_folder, st_folder
    from titan_contrastive.models.static import StaticEmbedder

    encoder = encoder_folder(tmp_path)
    for path in (encoder, st_folder(encoder, "mean", PROMPTS)):
        args = _args(path, "--model.static_dim=24")
        assert (args.vocab, args.dim, args.flops_per_sample()) == (4 + len(WORDS), 24, 0)
        torch.manual_seed(0)
        model = StaticEmbedder(args)
        assert args.num_params() == sum(p.numel() for p in model.parameters()) == args.vocab * 24 + 1
        assert abs(model.query_embedding.weight.std().item() - 1) < 0.1
    assert args.query_prompt == PROMPTS["query"]
    dual = _args(encoder, "--model.static_dim=24", "--model.flavor=dual")
    assert dual.num_params() == sum(p.numel() for p in StaticEmbedder(dual).parameters()) == 2 * dual.vocab * 24 + 1


@needs("hf")
def test_what_it_cannot_take_is_a_one_line_error(tmp_path: Path) -> None:
    from tests.hf_folders import encoder_folder
    from titan_contrastive.config import ConfigError

    folder, encoder = static_folder(tmp_path), encoder_folder(tmp_path)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "modules.json").write_text(json.dumps([{"path": "", "type": "x.Pooling"}]))
    for path, extra, message in [
        (encoder, [], "holds a tokenizer and no table of token vectors .*; set model.static_dim"),
        (tmp_path / "other", [], r"modules \['Pooling'\]; a static model is a StaticEmbedding"),
        (folder, ["--model.pooling=cls"], "model.pooling=cls: the static family pools as its architecture does"),
        (folder, ["--lora.enable=true"], "lora.enable=true: the static family has no Hugging Face layers to adapt"),
        (folder, ["--model.static_dim=-1"], "model.static_dim=-1"),
    ]:
        with pytest.raises(ConfigError, match=message):
            _args(path, *extra)
    from titan_contrastive.config.manager import parse_args
    from titan_contrastive.models import configured, get_model_spec

    for name, extra, message in [
        (
            "bi_encoder",
            [f"--model.path={folder}"],
            "a sentence-transformers StaticEmbedding model; use model.name=.static.",
        ),
        ("clip", ["--model.static_dim=8"], "model.static_dim=8: the clip family has no table of token vectors"),
    ]:
        cfg = parse_args([f"--model.name={name}", *extra])
        spec = get_model_spec(name)
        with pytest.raises(ConfigError, match=message):
            configured(spec.flavors[next(iter(spec.flavors))], cfg, spec)


@needs("hf")
def test_a_step_folder_mines_with_the_runs_own_embeddings(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`python -m titan_contrastive.mine --model STEP` with a static step folder (through its verified export): the
    negatives score, under the run's own embeddings, as the reference selects."""
    from tests.test_mine import check_mined, expected, mine, tiny_rows, write_csv
    from titan_contrastive.models.static import build_tokenizer

    run = static_run(tmp_path, "--training.local_batch_size=6", "--training.steps=1", "--checkpoint.enable=true")
    run.train()
    run.metrics.close()
    rows, step = tiny_rows(), tmp_path / "run" / "checkpoint" / "step-1"
    ids = [f"t{i}" for i in range(len(rows))]
    src, out = write_csv(tmp_path / "pairs.csv", rows, ids), tmp_path / "mined.jsonl"
    assert mine(capsys, src, f"--model={step}", f"--out={out}", "--range-max=100", "--relative-margin=0.01") == (0, [])
    tokenizer, model, cache = build_tokenizer(run.model_args), run.model, {}

    def embed(texts: list[str], side: str) -> torch.Tensor:
        ids = tokenizer.encode_queries(texts, 12) if side == "query" else tokenizer.encode_docs(texts)
        with torch.no_grad():
            vectors = model.embed_side(side, ids)
        cache.update(zip(texts, vectors))
        return vectors

    want = expected(rows, embed, k=1, skip=0, margin=0.01)
    judged = check_mined(out, rows, ids, want, lambda q, d: float(cache[q] @ cache[d]))
    assert judged >= 30 and any(want)
