"""The bi_encoder family on any Hugging Face text model in a local folder: a tiny random BERT-like
encoder and a Qwen3-like decoder (left-padding tokenizer whose pad token is its EOS), saved at test
time (tests/hf_folders.py). Embeddings equal sentence-transformers' on the same folder; every step
kind equals the dense objective over the whole batch in float64 (dropout on, on 1 and 2 gloo
processes, FSDP2 and DDP); bad folders and settings are one-line errors with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed, write_once
from tests.hf_folders import albert_folder, architecture_folder, decoder_folder, encoder_folder, st_folder
from tests.needs import needs
from tests.test_hard_negatives import assert_grads_close, assert_step_equals_its_forwards
from tests.test_trainer import full
from tests.test_trainer import make_trainer as base_trainer
from titan_contrastive.losses import InfoNCE, split_documents
from titan_contrastive.losses.base import columns

REL = 1e-10
FOLDERS = {"encoder": encoder_folder, "decoder": decoder_folder}
PAIRS = [
    ("a small animal kept as a pet", "cat"),
    ("a feline kept as a pet", "cat"),
    ("a vehicle with wheels", "car"),
    ("frozen water", "ice"),
    ("the season after summer", "autumn"),
    ("a person who flies an aircraft", "pilot"),
    ("a musical instrument with black and white keys", "piano"),
    ("a domestic animal", "dog"),
    ("what is the season after autumn", "winter"),
    ("a small vehicle with two wheels", "bicycle"),
    ("steam from water", "steam"),
    ("a person who is a driver of a bus", "driver"),
]


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gradients of the trainable parameters (LoRA: the adapters and the scale), whole."""
    return {n: full(p.grad).detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def write_pairs(tmp: Path) -> Path:
    """The pairs above as `tmp/pairs.jsonl`."""
    pairs = tmp / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"query": q, "positive": p}) + "\n" for q, p in PAIRS))
    return pairs


def folder_run(tmp: Path, kind: str, *extra: str, dropout: float = 0.1):
    """A trainer on `kind`'s tiny folder (FOLDERS, or hf_folders.ARCHITECTURES) and the pairs above (written
    once per tmp)."""
    if kind in FOLDERS:
        model = write_once(
            tmp / ("tiny-bert" if kind == "encoder" else "tiny-qwen3"), lambda: FOLDERS[kind](tmp, dropout)
        )
    else:
        model = write_once(tmp / f"tiny-{kind}", lambda: architecture_folder(tmp, kind, dropout))
    pairs = write_once(tmp / "pairs.jsonl", lambda: write_pairs(tmp))
    return base_trainer(
        str(tmp / f"run-{kind}"),
        "--model.name=bi_encoder",
        "--model.flavor=shared",
        f"--model.path={model}",
        "--data.dataset=pairs",
        f"--data.path={pairs}",
        "--data.context_length=16",
        "--data.doc_context_length=8",
        "--eval.enable=false",
        *extra,
    )


@needs("hf")
@pytest.mark.parametrize("include_prompt", [True, False])
@pytest.mark.parametrize("kind,pooling", [("encoder", "mean"), ("encoder", "cls"), ("decoder", "lasttoken")])
def test_sentence_transformers_folder_in_gives_its_embeddings(
    tmp_path: Path, kind: str, pooling: str, include_prompt: bool
) -> None:
    """A sentence-transformers folder: its pooling and prompts are honoured (with `include_prompt` false, the
    prompt's tokens left out of the pooling), and our embeddings of queries and documents equal
    `SentenceTransformer(folder).encode` with its prompt (float32)."""
    from sentence_transformers import SentenceTransformer

    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs, build_tokenizer

    prompts = {"query": "query ", "document": "represent the passage "}
    folder = st_folder(FOLDERS[kind](tmp_path), pooling, prompts, include_prompt)
    args = BiEncoderArgs(path=str(folder), query_length=24).resolve(doc_length=24)
    assert (args.pooling, args.query_prompt, args.doc_prompt) == (
        {"lasttoken": "last_token"}.get(pooling, pooling),
        "query ",
        "represent the passage ",
    )
    assert args.include_prompt == include_prompt
    tokenizer, model = build_tokenizer(args), BiEncoder(args).eval()
    texts = [q for q, _ in PAIRS[:5]]
    queries, docs = tokenizer.encode_queries(texts, 24), tokenizer.encode_docs(texts)
    if kind == "decoder":  # right-padded with -1 (its pad token is its EOS, which ends every text)
        assert model.pad_id == -1 and (queries == -1).any() and not (queries == tokenizer.hf.pad_token_id).all(1).any()
    with torch.no_grad():
        zq, zd, _ = model(queries, docs)
    theirs = SentenceTransformer(str(folder), device="cpu")
    for ours, name in ((zq, "query"), (zd, "document")):
        want = theirs.encode(texts, prompt_name=name, convert_to_tensor=True)
        assert (ours - want).abs().max() <= 1e-5


def _tokenizers_own_call(tokenizer, texts: list[str], length: int, prompt: str) -> torch.Tensor:
    """What PairTokenizer.encode is: the Hugging Face tokenizer's own padded, truncated call, real tokens
    moved to the left, padding written as `pad_id`."""
    out = tokenizer.hf([prompt + t for t in texts], padding="max_length", truncation=True, max_length=length)
    ids, mask = torch.tensor(out["input_ids"]), torch.tensor(out["attention_mask"]).bool()
    order = torch.argsort((~mask).int(), dim=1, stable=True)
    ids, mask = ids.gather(1, order), mask.gather(1, order)
    return ids.masked_fill(~mask, tokenizer.hf.pad_token_id if tokenizer.pad_id is None else tokenizer.pad_id)


@needs("hf")
@pytest.mark.parametrize("kind", ["minilm", "encoder", "decoder"])
def test_pair_tokenizer_gives_the_tokenizers_own_ids(tmp_path: Path, kind: str) -> None:
    """PairTokenizer.encode reads the Rust tokenizer's ids directly; they equal the tokenizer's own
    call (truncation, special tokens, left-padding decoders, prompts), and a second call is unchanged."""
    from titan_contrastive.models.bi_encoder import BiEncoderArgs, build_tokenizer

    args = BiEncoderArgs() if kind == "minilm" else BiEncoderArgs(path=str(FOLDERS[kind](tmp_path)))
    tokenizer = build_tokenizer(args)
    long = " ".join(w for q, d in PAIRS for w in (q + " " + d).split())
    texts = [q for q, _ in PAIRS] + ["", long, "frozen [SEP] water <|endoftext|> ice", "Café naïve 雪 🙂 dog"]
    for length, prompt in ((6, ""), (24, ""), (24, "query "), (64, "passage ")):
        got = tokenizer.encode(texts, length, prompt)
        want = _tokenizers_own_call(tokenizer, texts, length, prompt)
        assert got.dtype == torch.int64 and torch.equal(got, want), (length, prompt)
        assert (got[:, 0] != want.new_tensor(-1)).all() and torch.equal(tokenizer.encode(texts, length, prompt), got)


@needs("hf")
def test_document_length_defaults(tmp_path: Path) -> None:
    """Given > these args' own > the folder's (its tokenizer's 64 here, 512 at most) > the bundled MiniLM's 16."""
    from titan_contrastive.models.bi_encoder import BiEncoderArgs

    folder = str(encoder_folder(tmp_path))
    assert BiEncoderArgs().resolve().doc_length == 16
    resolved = BiEncoderArgs().resolve(path=folder)
    assert resolved.doc_length == 64 and resolved.resolve().doc_length == 64
    assert BiEncoderArgs(path=folder).resolve(doc_length=20).resolve().doc_length == 20


@needs("hf")
def test_last_token_pooling_reads_the_last_real_token(tmp_path: Path) -> None:
    """Decoder: the embedding is the hidden state at the EOS that ends each text, whatever the padding."""
    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs, build_tokenizer

    args = BiEncoderArgs(path=str(decoder_folder(tmp_path)), query_length=16).resolve()
    assert args.pooling == "last_token"
    tokenizer, model = build_tokenizer(args), BiEncoder(args).eval()
    ids = tokenizer.encode_queries(["frozen water", "a small animal kept as a pet"], 16)
    with torch.no_grad():
        got, _, _ = model(ids, ids)
        for row, text_ids in enumerate(ids):
            real = text_ids[text_ids != -1]
            assert real[-1] == tokenizer.hf.eos_token_id
            alone = model.query_tower(input_ids=real[None]).last_hidden_state[0, -1]
            assert torch.allclose(got[row], torch.nn.functional.normalize(alone, dim=-1), atol=1e-6)


KINDS = {
    "gradcache": (6, 1, ["--gradcache.enabled=true", "--gradcache.chunk_sizes=5"]),
    "gradcache-tokens": (6, 1, ["--gradcache.enabled=true", "--gradcache.chunk_tokens=40"]),
    "global": (3, 2, ["--loss.negatives=global", "--loss.stream_chunk_size=5"]),
}


def _dense(trainer, samples: dict) -> tuple[float, dict[str, torch.Tensor]]:
    model = trainer.spec.build_model(trainer.model_args).double()
    model.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    model.eval()
    q, d, scale = model(samples["query"], samples["doc"])
    loss = InfoNCE().dense(q, columns(*split_documents(d)), scale)
    loss.backward()
    return loss.item(), grads(model)


def _step(tmp: Path, arch: str, kind: str, *extra: str, warm: bool = False, rel: float = REL) -> None:
    """One step of `kind` (dropout off: the model in eval mode) against the dense full-batch objective, within
    `rel`; `warm`: after one step of it first (LoRA's B starts at zero, which would leave A's gradient zero)."""
    local, ga, args = KINDS[kind]
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    trainer = folder_run(
        tmp,
        arch,
        f"--training.local_batch_size={local}",
        f"--training.global_batch_size={local * ga * world}",
        *args,
        *extra,
    )
    trainer.model.eval()
    data = trainer.train_set
    steps = [data.__getitems__(list(range(j * local * world, (j + 1) * local * world))) for j in range(ga)]
    mine = [{k: v[rank * local : (rank + 1) * local] for k, v in s.items()} for s in steps]
    every = {k: torch.cat([s[k] for s in steps]) for k in steps[0]}
    if warm:
        trainer.train_step(mine)
    want_loss, want = _dense(trainer, every)
    out = trainer.train_step(mine)
    assert_grads_close(grads(trainer.model), want, rel)
    assert abs(out["loss"] - want_loss) <= rel * want_loss
    trainer.metrics.close()


@needs("hf")
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("arch", list(FOLDERS))
def test_every_step_kind_equals_the_dense_objective(tmp_path: Path, arch: str, kind: str) -> None:
    _step(tmp_path, arch, kind)


@needs("hf")
@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("arch", list(FOLDERS))
def test_activation_checkpointing_keeps_the_step_exact(tmp_path: Path, arch: str, mode: str) -> None:
    """Per-layer activation checkpointing under GradCache. Before: a decoder kept its keys and values in
    a cache during training (`use_cache`), so a layer's recompute attended to them twice and failed."""
    _step(tmp_path, arch, "gradcache", f"--activation_checkpoint.mode={mode}")


def _step_distributed(tmp: str, arch: str, ddp: bool, *extra: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    layout = ["--parallelism.data_parallel_shard_degree=1", "--parallelism.data_parallel_replicate_degree=2"]
    _step(Path(tmp), arch, "global", *(layout if ddp else []), *extra, warm=bool(extra))


@needs("hf")
@pytest.mark.parametrize("parallel", ["fsdp2", "ddp"])
@pytest.mark.parametrize("arch", list(FOLDERS))
def test_global_negatives_on_two_ranks(tmp_path: Path, arch: str, parallel: str) -> None:
    """FSDP2 (each transformer layer a unit, found from `_no_split_modules`) or DDP on 2 gloo processes."""
    FOLDERS[arch](tmp_path)
    run_distributed(_step_distributed, 2, str(tmp_path), arch, parallel == "ddp")


@needs("hf")
@pytest.mark.parametrize("arch", list(FOLDERS))
def test_gradcache_with_dropout_on_equals_the_objective_of_its_forwards(tmp_path: Path, arch: str) -> None:
    """Dropout on (BERT's hidden and attention dropout, Qwen3's attention dropout): GradCache chunks of
    4 over 6 replay each chunk's draws, so the step's gradient is the dense objective's over the same
    forwards (the chunks encoded in order from the same seed, as the cache pass does)."""
    assert_gradcache_replays_dropout(tmp_path, arch)


def assert_gradcache_replays_dropout(tmp: Path, arch: str, *extra: str) -> None:
    """A training-mode step of GradCache chunks of 4 over 6 against the dense objective over the same forwards,
    and the dropout on (a forward from the same seed differs from the eval-mode one)."""
    trainer = folder_run(
        tmp, arch, "--training.local_batch_size=6", "--gradcache.enabled=true", "--gradcache.chunk_sizes=4", *extra
    )
    assert trainer.model.training
    batch = trainer.train_set.__getitems__(list(range(6)))
    chunks = [{k: v[s] for k, v in batch.items()} for s in (slice(0, 4), slice(4, 6))]
    assert_step_equals_its_forwards(trainer, [batch], chunks, seed=5)
    torch.manual_seed(5)
    without = trainer.model(batch["query"][:4], batch["doc"][:4])[0]
    assert not torch.allclose(without, trainer.model.eval()(batch["query"][:4], batch["doc"][:4])[0])  # dropout is on
    trainer.metrics.close()


@needs("hf")
def test_a_folder_pooling_without_its_prompt_steps_exactly_and_exports_so(tmp_path: Path) -> None:
    """A sentence-transformers folder whose Pooling leaves the prompt out (`include_prompt` false, INSTRUCTOR's
    way): GradCache chunks and global negatives equal the dense objective in float64; a step exports to a
    sentence-transformers folder that pools the same way and embeds as the run does (the exporter checks)."""
    prompts = {"query": "represent the question ", "document": "represent the passage "}
    folder = st_folder(encoder_folder(tmp_path), "mean", prompts, include_prompt=False)
    for kind in ("gradcache", "global"):
        _step(tmp_path, "encoder", kind, f"--model.path={folder}")
    from titan_contrastive.export import main as export_main

    run = folder_run(
        tmp_path / "export",
        "encoder",
        f"--model.path={folder}",
        "--training.local_batch_size=6",
        "--training.steps=1",
        "--checkpoint.enable=true",
    )
    run.train()
    run.metrics.close()
    step = tmp_path / "export" / "run-encoder" / "checkpoint" / "step-1"
    out = tmp_path / "st"
    for side in ("query", "doc"):
        assert export_main([str(step), "--to", "sentence-transformers", "--tower", side, "--out", f"{out}-{side}"]) == 0
    pooling = json.loads((tmp_path / "st-query" / "1_Pooling" / "config.json").read_text())
    assert pooling["include_prompt"] is False
    from titan_contrastive.config import ConfigError

    with pytest.raises(ConfigError, match="pools without its prompt .* leave them empty"):
        folder_run(tmp_path / "per-source", "encoder", f"--model.path={folder}", "--data.query_prompts=find ")


@needs("hf")
def test_model_include_prompt_overrides_the_folder(tmp_path: Path) -> None:
    """`[model] include_prompt`: false on a plain folder with prompts embeds as the sentence-transformers folder
    of the same weights whose Pooling leaves the prompt out, true on that folder as the one whose Pooling reads
    it; a step with it exports a Pooling that says so (the exporter compares the embeddings); another family
    refuses it in one line."""
    from sentence_transformers import SentenceTransformer

    from titan_contrastive.config import ConfigError
    from titan_contrastive.export import main as export_main
    from titan_contrastive.models.bi_encoder import build_tokenizer

    model = encoder_folder(tmp_path)
    prompts = {"query": "represent the question ", "document": "represent the passage "}
    given = [f"--model.query_prompt={prompts['query']}", f"--model.doc_prompt={prompts['document']}"]
    texts = [q for q, _ in PAIRS[:5]]
    cases = [
        ("plain", model, False, [*given, "--checkpoint.enable=true", "--training.steps=1"]),
        ("no-prompt", st_folder(model, "mean", prompts, include_prompt=False), True, []),
    ]
    for name, folder, include, extra in cases:
        run = folder_run(
            tmp_path / name,
            "encoder",
            f"--model.path={folder}",
            f"--model.include_prompt={str(include).lower()}",
            "--training.local_batch_size=6",
            "--data.context_length=24",
            "--data.doc_context_length=24",
            *extra,
        )
        assert run.model_args.include_prompt is include
        reference = SentenceTransformer(str(st_folder(model, "mean", prompts, include_prompt=include)), device="cpu")
        tokenizer, ours = build_tokenizer(run.model_args), run.model.eval()
        with torch.no_grad():
            zq, zd, _ = ours(tokenizer.encode_queries(texts, 24), tokenizer.encode_docs(texts))
        for got, side in ((zq, "query"), (zd, "document")):
            assert (got - reference.encode(texts, prompt_name=side, convert_to_tensor=True)).abs().max() <= 1e-5
        if extra:
            run.train()
        run.metrics.close()
    step = tmp_path / "plain" / "run-encoder" / "checkpoint" / "step-1"
    assert export_main([str(step), "--to", "sentence-transformers", "--out", str(tmp_path / "st")]) == 0
    assert json.loads((tmp_path / "st" / "1_Pooling" / "config.json").read_text())["include_prompt"] is False
    with pytest.raises(ConfigError, match=r"^model.include_prompt=false: the clip family pools no prompted texts"):
        base_trainer(str(tmp_path / "clip"), "--model.include_prompt=false")


@needs("hf")
def test_layers_are_the_fsdp_and_checkpointing_units(tmp_path: Path) -> None:
    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs, bi_encoder_blocks

    for make, name in ((encoder_folder, "BertLayer"), (decoder_folder, "Qwen3DecoderLayer")):
        for shared in (True, False):
            model = BiEncoder(BiEncoderArgs(path=str(make(tmp_path)), shared=shared))
            blocks = bi_encoder_blocks(model)
            assert [type(b).__name__ for b in blocks] == [name] * (2 if shared else 4)


def _train_main(tmp: Path, *args: str, capsys: pytest.CaptureFixture) -> tuple[int, list[str]]:
    from titan_contrastive.train import main

    code = main(
        [
            f"--job.dump_folder={tmp / 'run'}",
            "--model.name=bi_encoder",
            "--model.flavor=shared",
            "--data.dataset=pairs",
            f"--data.path={tmp / 'pairs.jsonl'}",
            "--training.steps=1",
            "--training.local_batch_size=4",
            "--metrics.enable_tensorboard=false",
            *args,
        ]
    )
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@needs("hf")
def test_bad_folders_and_settings_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"query": q, "positive": p}) + "\n" for q, p in PAIRS))
    decoder = decoder_folder(tmp_path)
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text((decoder / "config.json").read_text())
    (tmp_path / "empty").mkdir()
    own_code = encoder_folder(tmp_path / "own-code")  # a model type whose code ships in the folder (auto_map)
    config = json.loads((own_code / "config.json").read_text())
    auto_map = {"AutoConfig": "configuration_tiny.TinyConfig", "AutoModel": "modeling_tiny.TinyModel"}
    (own_code / "config.json").write_text(json.dumps(config | {"model_type": "tiny_custom", "auto_map": auto_map}))
    (own_code / "configuration_tiny.py").write_text(
        "from transformers import BertConfig\n\n\nclass TinyConfig(BertConfig):\n    model_type = 'tiny_custom'\n"
    )
    cases = [
        (f"--model.path={tmp_path / 'empty'}", "holds no config.json nor modules.json"),
        ("--model.path=nobody/no-such-model", "not a local folder nor a model in the local Hugging Face cache"),
        (f"--model.path={no_tokenizer}", "no tokenizer transformers can load"),
        (f"--model.path={decoder} --model.pooling=cls", "a decoder's first token sees no other token"),
        (f"--model.path={own_code}", "model type 'tiny_custom' is code the folder ships (config.json auto_map)"),
    ]
    capsys.readouterr()  # the folders' save progress bars
    for args, message in cases:
        code, err = _train_main(tmp_path, *args.split(), capsys=capsys)
        assert code == 2 and len(err) == 1 and message in err[0], (args, err)
    st = st_folder(encoder_folder(tmp_path), "mean", {})
    modules = json.loads((st / "modules.json").read_text())
    modules.insert(2, {"idx": 9, "name": "9", "path": "9_LayerNorm", "type": "sentence_transformers.models.LayerNorm"})
    (st / "modules.json").write_text(json.dumps(modules))
    capsys.readouterr()
    code, err = _train_main(tmp_path, f"--model.path={st}", capsys=capsys)
    assert (
        code == 2 and len(err) == 1 and "sentence_transformers.models.LayerNorm" in err[0] and "not supported" in err[0]
    )
    assert not (tmp_path / "run" / "checkpoint").exists()


@needs("hf")
def test_a_model_without_repeated_layers_cannot_be_checkpointed_per_layer(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """ALBERT runs one shared layer group again and again: no list of layers to wrap, a one-line error."""
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"query": q, "positive": p}) + "\n" for q, p in PAIRS))
    folder = albert_folder(tmp_path)
    capsys.readouterr()
    code, err = _train_main(tmp_path, f"--model.path={folder}", "--activation_checkpoint.mode=full", capsys=capsys)
    assert code == 2 and len(err) == 1 and "holds no list of repeated layers" in err[0], err
    code, err = _train_main(tmp_path, f"--model.path={folder}", capsys=capsys)
    assert code == 0  # without per-layer units it trains


@needs("hf")
def test_a_decoder_embedder_trains(tmp_path: Path) -> None:
    """The tiny Qwen3-like decoder, last-token pooled, learns the 12 pairs: the contrastive loss over
    the whole set (one batch) falls below half its start in 40 steps."""
    trainer = folder_run(
        tmp_path,
        "decoder",
        "--training.local_batch_size=12",
        "--training.steps=40",
        "--training.dtype=float32",
        "--lr_scheduler.warmup_steps=0",
        "--optimizer.lr=3e-3",
        "--metrics.log_freq=1",
    )
    assert trainer.model_args.pooling == "last_token"
    trainer.train()
    trainer.metrics.close()
    rows = [json.loads(line) for line in (tmp_path / "run-decoder" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if row.get("kind") == "train"]
    assert len(losses) == 40 and losses[-1] < 0.5 * losses[0], losses


@needs("hf")
def test_layer_blocks_are_found_after_sharding_renames_their_class(tmp_path: Path) -> None:
    """FSDP2's fully_shard swaps a layer's class for a subclass named FSDP<name>; the layers are still found."""
    from titan_contrastive.models.bi_encoder.folder import layer_blocks
    from titan_contrastive.models.bi_encoder.tower import load_text_tower

    tower = load_text_tower(str(encoder_folder(tmp_path)))
    layers = layer_blocks(tower)
    assert len(layers) == 2
    for layer in layers:
        layer.__class__ = type(f"FSDP{type(layer).__name__}", (type(layer),), {})
    assert layer_blocks(tower) == layers
