"""The bi_encoder family on what embedders are built on beyond test_hf_text.py's BERT and Qwen3: XLM-R,
MPNet, DistilBERT, DeBERTa-v2, ModernBERT, T5 (its encoder alone), Llama, Mistral, Qwen2, Gemma 3 and a
sentence-transformers folder whose pooling is followed by Dense modules, tiny and random
(tests/hf_folders.py: ARCHITECTURES). For each: the repeated layers are found (FSDP2, activation
checkpointing and compile units; MPNet, DistilBERT and DeBERTa declare no `_no_split_modules`); every
step kind, activation checkpointing and LoRA equal the dense objective over the whole batch in float64;
GradCache replays the dropout. MPNet, T5 and the Dense folder also on two gloo processes under FSDP2,
and exported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.hf_folders import ARCHITECTURES, architecture_folder
from tests.needs import needs
from tests.test_hf_text import KINDS, REL, _step, _step_distributed, assert_gradcache_replays_dropout, folder_run

ARCHS = list(ARCHITECTURES)
# Gemma's RMSNorm computes in float32 whatever the model's dtype, so a float64 step is exact to float32's
# rounding there (with that norm in float64 the step agrees to 1e-10, as the others do)
TOLERANCE = {"gemma3": 1e-5}
NO_LORA_DEFAULT = ("mpnet", "distilbert", "modernbert")  # peft names no target modules for these
LORA = ("--lora.enable=true", "--lora.rank=4")


def _lora(arch: str) -> tuple[str, ...]:
    return (*LORA, "--lora.target_modules=all-linear") if arch in NO_LORA_DEFAULT else LORA


@needs("hf")
@pytest.mark.parametrize("arch", ARCHS)
def test_the_repeated_layers_are_found_and_counted(tmp_path: Path, arch: str) -> None:
    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs, bi_encoder_blocks

    args = BiEncoderArgs(path=str(architecture_folder(tmp_path, arch)), shared=False)
    model = BiEncoder(args)
    blocks = bi_encoder_blocks(model)
    assert len(blocks) == 4 and len({type(b) for b in blocks}) == 1, [type(b).__name__ for b in blocks]
    assert type(blocks[0]).__name__.endswith(("Layer", "Block"))
    assert not any(".decoder." in n for n, _ in model.named_parameters())  # T5: the encoder alone
    assert args.num_params() == sum(p.numel() for p in model.parameters())


@needs("hf")
@pytest.mark.parametrize("arch", ARCHS)
def test_the_folders_tokenizer_keeps_the_words(tmp_path: Path, arch: str) -> None:
    """The batches hold the texts (transformers loads a qwen2 folder's tokenizer as its own class, which a
    word-level tokenizer would not survive: every text became 'a a a')."""
    from titan_contrastive.models.bi_encoder import BiEncoderArgs, build_tokenizer

    tokenizer = build_tokenizer(BiEncoderArgs(path=str(architecture_folder(tmp_path, arch))))
    ids = tokenizer.encode_queries(["a small cat", "frozen water"], 16)
    texts = [tokenizer.hf.decode(row[row != tokenizer.pad_id], skip_special_tokens=True).strip() for row in ids]
    assert texts == ["a small cat", "frozen water"]


@needs("hf")
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("arch", ARCHS)
def test_every_step_kind_equals_the_dense_objective(tmp_path: Path, arch: str, kind: str) -> None:
    _step(tmp_path, arch, kind, rel=TOLERANCE.get(arch, REL))


@needs("hf")
@pytest.mark.parametrize("arch", ARCHS)
def test_activation_checkpointing_keeps_gradcache_exact(tmp_path: Path, arch: str) -> None:
    _step(tmp_path, arch, "gradcache", "--activation_checkpoint.mode=full", rel=TOLERANCE.get(arch, REL))


@needs("hf")
@pytest.mark.parametrize("arch", ARCHS)
def test_lora_steps_equal_the_dense_objective(tmp_path: Path, arch: str) -> None:
    """peft's target modules for the architecture, or every linear layer where peft names none."""
    _step(tmp_path, arch, "gradcache", *_lora(arch), warm=True, rel=TOLERANCE.get(arch, REL))


@needs("hf")
@pytest.mark.parametrize("arch", ARCHS)
def test_gradcache_replays_the_dropout(tmp_path: Path, arch: str) -> None:
    """Dropout on: GradCache chunks of 4 over 6 give the dense objective's gradient over the same forwards."""
    assert_gradcache_replays_dropout(tmp_path, arch)


@needs("hf")
def test_lora_without_peft_targets_names_the_fix(tmp_path: Path) -> None:
    from titan_contrastive.config import ConfigError

    with pytest.raises(ConfigError, match=r"peft has no default for model type 'mpnet'.*\['all-linear'\]"):
        folder_run(tmp_path, "mpnet", *LORA)


@needs("hf")
@pytest.mark.parametrize("arch", ["mpnet", "t5", "bert-dense"])
def test_global_negatives_on_two_ranks_under_fsdp2(tmp_path: Path, arch: str) -> None:
    """Each layer an FSDP2 unit: MPNet's found without `_no_split_modules`, T5's in its encoder alone; the
    Dense layers after a pooling sharded with the rest of the model."""
    architecture_folder(tmp_path, arch)
    run_distributed(_step_distributed, 2, str(tmp_path), arch, False)


@needs("hf")
@pytest.mark.parametrize("arch", ["mpnet", "t5", "bert-dense"])
def test_exports_load_back_in_their_libraries(tmp_path: Path, arch: str) -> None:
    """A step folder of each (MPNet with LoRA on all linear layers) exports to every format it can hold; each
    export is loaded back by its library and checked by the exporter; sentence-transformers' embeddings of
    the run's tokens equal the run's; T5's transformers folder is its encoder; a model ending in Dense
    modules is refused by --to hf, and its sentence-transformers folder holds them as trained."""
    from sentence_transformers import SentenceTransformer

    from titan_contrastive.export import main as export_main
    from titan_contrastive.models.bi_encoder import build_tokenizer
    from titan_contrastive.models.weights import read_ours

    lora = _lora(arch) if arch == "mpnet" else ()
    run = folder_run(
        tmp_path, arch, *lora, "--training.local_batch_size=6", "--training.steps=1", "--checkpoint.enable=true"
    )
    run.train()
    run.metrics.close()
    step = tmp_path / f"run-{arch}" / "checkpoint" / "step-1"
    for to in ("hf", "sentence-transformers", *(("peft",) if lora else ())):
        code = export_main([str(step), "--to", to, "--out", str(tmp_path / to)])
        assert code == (2 if (arch, to) == ("bert-dense", "hf") else 0), to
    if arch == "bert-dense":
        assert not (tmp_path / "hf").exists()
        exported = SentenceTransformer(str(tmp_path / "sentence-transformers"), device="cpu")
        start = SentenceTransformer(str(architecture_folder(tmp_path, arch)), device="cpu")
        assert [type(m).__name__ for m in exported] == ["Transformer", "Pooling", "Dense", "Dense", "Normalize"]
        assert not torch.equal(exported[2].linear.weight, start[2].linear.weight)  # the Dense layers trained
    if arch == "t5":
        assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["T5EncoderModel"]
    _, args, ours = read_ours(step)
    texts = ["frozen water", "a small animal kept as a pet", "the season after summer"]
    ids = build_tokenizer(args).encode_queries(texts, args.query_length)
    with torch.no_grad():
        want = ours.eval()._embed(ours.query_tower, ids).float()
    theirs = SentenceTransformer(str(tmp_path / "sentence-transformers"), device="cpu")
    assert (theirs.encode(texts, convert_to_tensor=True) - want).abs().max() <= 1e-4


@needs("hf")
def test_an_encoder_decoder_without_an_encoder_class_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """BART: transformers has no class for its encoder alone (T5's is `T5EncoderModel`)."""
    from transformers import BartConfig, BartModel

    from tests.test_hf_text import PAIRS, _train_main

    t5 = architecture_folder(tmp_path, "t5")
    shape = dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2)
    BartModel(BartConfig(vocab_size=64, encoder_ffn_dim=32, decoder_ffn_dim=32, **shape)).save_pretrained(
        tmp_path / "bart"
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "bart" / name).write_text((t5 / name).read_text())
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"query": q, "positive": p}) + "\n" for q, p in PAIRS))
    capsys.readouterr()
    code, err = _train_main(tmp_path, f"--model.path={tmp_path / 'bart'}", capsys=capsys)
    assert code == 2 and len(err) == 1 and "an encoder-decoder (bart) whose encoder transformers cannot load" in err[0]
    assert not (tmp_path / "run" / "checkpoint").exists()


@needs("hf")
def test_dense_modules_give_sentence_transformers_embeddings(tmp_path: Path) -> None:
    """A sentence-transformers folder ending in Dense modules: our embeddings of queries and documents
    equal `SentenceTransformer(folder).encode` (float32), 8 wide: the pooling's 16 through both."""
    from sentence_transformers import SentenceTransformer

    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs, build_tokenizer

    folder = architecture_folder(tmp_path, "bert-dense")
    args = BiEncoderArgs(path=str(folder), query_length=24).resolve(doc_length=24)
    tokenizer, model = build_tokenizer(args), BiEncoder(args).eval()
    texts = ["frozen water", "a small animal kept as a pet", "the season after summer", "a musical instrument"]
    with torch.no_grad():
        zq, zd, _ = model(tokenizer.encode_queries(texts, 24), tokenizer.encode_docs(texts))
    want = SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_tensor=True)
    assert zq.shape == (4, 8) and (zq - want).abs().max() <= 1e-5 and (zd - want).abs().max() <= 1e-5


@needs("hf")
def test_dense_modules_that_cannot_be_run_exactly_are_refused(tmp_path: Path) -> None:
    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs
    from titan_contrastive.models.bi_encoder.folder import TextFolderError, read_text_folder

    folder = architecture_folder(tmp_path, "bert-dense")
    with pytest.raises(TextFolderError, match=r"model.freeze=\['query'\]: .* ends in Dense modules"):
        folder_run(tmp_path, "bert-dense", "--model.freeze=query")
    dense = folder / "2_Dense"
    config = json.loads((dense / "config.json").read_text())
    (dense / "config.json").write_text(json.dumps(config | {"in_features": 24}))
    with pytest.raises(TextFolderError, match=r"2_Dense: in_features=24, and the embedding that reaches it is 16"):
        BiEncoder(BiEncoderArgs(path=str(folder)))
    (dense / "config.json").write_text(json.dumps(config | {"activation_function": "mypackage.Swish"}))
    with pytest.raises(TextFolderError, match=r"2_Dense: a Dense module with activation mypackage.Swish"):
        read_text_folder(str(folder))
    (dense / "config.json").write_text(json.dumps(config))
    (dense / "model.safetensors").rename(dense / "pytorch_model.bin")
    with pytest.raises(
        TextFolderError, match=r"2_Dense: no model.safetensors \(a pytorch_model.bin is never unpickled"
    ):
        read_text_folder(str(folder))
    modules = json.loads((folder / "modules.json").read_text())
    (folder / "modules.json").write_text(json.dumps([modules[0], modules[2], modules[1], *modules[3:]]))
    with pytest.raises(TextFolderError, match=r"Dense modules are supported between the Pooling and the Normalize"):
        read_text_folder(str(folder))


@needs("hf")
def test_a_decoder_made_bidirectional_pools_as_an_encoder(tmp_path: Path) -> None:
    """EmbeddingGemma's Gemma 3 attends both ways (`use_bidirectional_attention`): `auto` pooling is mean
    there, and cls is allowed; the causal Gemma 3 pools its last token."""
    from tests.hf_folders import _decoder
    from titan_contrastive.models.bi_encoder import BiEncoderArgs

    both = _decoder(tmp_path / "both", "Gemma3Text", 0.0, sliding_window=8, use_bidirectional_attention=True)
    assert BiEncoderArgs(path=str(both)).resolve().pooling == "mean"
    assert BiEncoderArgs(path=str(both), pooling="cls").resolve().pooling == "cls"
    assert BiEncoderArgs(path=str(architecture_folder(tmp_path, "gemma3"))).resolve().pooling == "last_token"


@needs("hf")
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "bert-dense"])  # a Dense folder's towers cannot lock
def test_unlocked_layers_leave_the_last_layer_training(tmp_path: Path, arch: str) -> None:
    """`freeze = ["query"]` with `unlocked_layers = 1`: of the repeated layers the last trains and the first
    does not, whatever the architecture names them (BERT's `layer.N`, a decoder's `layers.N`, T5's `block.N`
    holding its own `layer.0`, `layer.1`)."""
    from titan_contrastive.models.bi_encoder import bi_encoder_blocks

    trainer = folder_run(
        tmp_path, arch, "--model.freeze=query", "--model.unlocked_layers=1", "--training.local_batch_size=4"
    )
    trains = [any(p.requires_grad for p in block.parameters()) for block in bi_encoder_blocks(trainer.model)]
    assert trains == [False, True]
    trainer.metrics.close()
