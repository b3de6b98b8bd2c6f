"""LoRA through peft on the bi_encoder's Hugging Face towers (tiny BERT-like and Qwen3-like folders,
tests/hf_folders.py): only adapters train; every step kind equals the dense objective in float64 on
1 and 2 gloo processes (FSDP2 with a frozen base, DDP), LoRA dropout replayed in GradCache; a
checkpoint holds only the adapters and resumes bit-identically; a changed rank is a one-line error. DoRA and
rsLoRA (`VARIANTS`) the same."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.hf_folders import decoder_folder, encoder_folder
from tests.marks import slow_ones
from tests.needs import require
from tests.test_hard_negatives import assert_step_equals_its_forwards
from tests.test_hf_text import FOLDERS, KINDS, _step, _step_distributed, folder_run

require("hf")

LORA = ("--lora.enable=true", "--lora.rank=4", "--lora.alpha=8")
DORA = (*LORA, "--lora.use_dora=true", "--lora.use_rslora=true")
VARIANTS = {"lora": LORA, "dora-rslora": DORA}
REL = 1e-10


@pytest.mark.parametrize("arch", list(FOLDERS))
def test_only_the_adapters_train(tmp_path: Path, arch: str) -> None:
    """peft's default targets for the architecture get adapters; the base gets no gradient, no optimizer
    state and does not move; the adapters and the scale do."""
    trainer = folder_run(tmp_path, arch, *LORA, "--training.local_batch_size=6")
    targets = {"encoder": ("query", "value"), "decoder": ("q_proj", "v_proj")}[arch]
    assert trainer.model_args.lora_targets == targets and trainer.model_args.lora_rank == 4
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    adapters = {n for n in trainable if ".lora_A." in n or ".lora_B." in n}
    assert trainable == adapters | {"logit_scale"} and len(adapters) == 2 * 2 * 2  # 2 layers x 2 targets x (A, B)
    assert all(n.split(".lora_")[0].endswith(targets) for n in adapters)
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    adapted = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if n in adapters}
    trainer.train_step([trainer.train_set.__getitems__(list(range(6)))])
    params = dict(trainer.model.named_parameters())
    assert all(torch.equal(params[n], p) for n, p in base.items())
    assert any(not torch.equal(params[n], p) for n, p in adapted.items() if ".lora_B." in n)
    stateful = {id(p) for p in trainer.optimizer.state}
    assert {n for n, p in params.items() if id(p) in stateful} == trainable
    total = sum(p.numel() for p in params.values())
    assert trainer.model_args.num_params() == total  # the adapters counted
    trainer.metrics.close()


def test_dora_and_rslora_are_peft_s_own(tmp_path: Path) -> None:
    """`use_dora`: a magnitude per output row trains beside A and B, starting at the loaded weight's row norms;
    `use_rslora`: the adapters scaled by alpha / sqrt(r) = 8 / 2 (alpha / r = 2 without)."""
    from transformers import AutoModel

    trainer = folder_run(tmp_path, "encoder", *DORA, "--training.local_batch_size=6")
    args = trainer.model_args
    assert args.lora_dora and args.lora_rslora
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    magnitudes = {n for n in trainable if ".lora_magnitude_vector." in n}
    assert len(magnitudes) == 2 * 2 and trainable - magnitudes == {
        n for n in trainable if ".lora_A." in n or ".lora_B." in n
    } | {"logit_scale"}
    base = AutoModel.from_pretrained(args.model_dir)
    layer = trainer.model.query_tower.encoder.layer[1].attention.self.value
    want = base.encoder.layer[1].attention.self.value.weight.detach().norm(dim=1)
    assert torch.allclose(layer.lora_magnitude_vector["default"].weight, want.to(torch.float64), rtol=0, atol=1e-6)
    assert layer.scaling["default"] == 4.0
    trainer.metrics.close()
    plain = folder_run(tmp_path / "plain", "encoder", *LORA, "--training.local_batch_size=6")
    assert plain.model.query_tower.encoder.layer[1].attention.self.value.scaling["default"] == 2.0
    assert not any(".lora_magnitude_vector." in n for n, _ in plain.model.named_parameters())
    plain.metrics.close()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("arch", list(FOLDERS))
def test_every_step_kind_with_lora_equals_the_dense_objective(
    tmp_path: Path, arch: str, kind: str, variant: str
) -> None:
    _step(tmp_path, arch, kind, *VARIANTS[variant], warm=True)


@pytest.mark.parametrize(  # each architecture, wrapper and variant by default; the other five with the slow marker
    ("arch", "parallel", "variant"),
    slow_ones(
        [(a, p, v) for a in FOLDERS for p in ("fsdp2", "ddp") for v in VARIANTS],
        [
            ("encoder", "fsdp2", "dora-rslora"),
            ("encoder", "ddp", "lora"),
            ("encoder", "ddp", "dora-rslora"),
            ("decoder", "fsdp2", "lora"),
            ("decoder", "ddp", "dora-rslora"),
        ],
    ),
)
def test_lora_global_negatives_on_two_ranks(tmp_path: Path, arch: str, parallel: str, variant: str) -> None:
    """FSDP2 shards a frozen base beside trainable adapters (and DoRA's magnitudes) in each layer unit; DDP
    reduces the adapters."""
    FOLDERS[arch](tmp_path)
    run_distributed(_step_distributed, 2, str(tmp_path), arch, parallel == "ddp", *VARIANTS[variant])


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", list(FOLDERS))
def test_gradcache_replays_lora_dropout(tmp_path: Path, arch: str, variant: str) -> None:
    """LoRA dropout 0.3 (and the model's own dropout) on: GradCache chunks of 4 over 6 equal the dense
    objective over the same forwards, the chunks encoded in order from the same seed."""
    trainer = folder_run(
        tmp_path,
        arch,
        *VARIANTS[variant],
        "--lora.dropout=0.3",
        "--training.local_batch_size=6",
        "--gradcache.enabled=true",
        "--gradcache.chunk_sizes=4",
    )
    batch = trainer.train_set.__getitems__(list(range(6)))
    trainer.train_step([batch])  # B away from zero
    chunks = [{k: v[s] for k, v in batch.items()} for s in (slice(0, 4), slice(4, 6))]
    assert_step_equals_its_forwards(trainer, [batch], chunks, seed=7)
    trainer.metrics.close()


def _run(tmp: Path, *extra: str, variant: str = "lora"):
    return folder_run(
        tmp,
        "decoder",
        *VARIANTS[variant],
        "--lora.dropout=0.1",
        "--training.local_batch_size=4",
        "--training.steps=4",
        "--checkpoint.enable=true",
        "--checkpoint.interval=2",
        "--metrics.log_freq=1",
        *extra,
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_resume_with_lora_is_bit_identical_and_saves_only_adapters(tmp_path: Path, variant: str) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    whole = _run(tmp_path, variant=variant)
    whole.train()
    whole.metrics.close()
    want = {n: p.detach().clone() for n, p in whole.model.named_parameters()}
    run = tmp_path / "run-decoder"
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    want_losses = [r["loss"] for r in logged if r.get("kind") == "train"]
    step2 = run / "checkpoint" / "step-2"
    keys = FileSystemReader(str(step2)).read_metadata().state_dict_metadata.keys()
    model_keys = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    trainable = {n for n, p in whole.model.named_parameters(remove_duplicate=False) if p.requires_grad}
    assert model_keys == trainable  # the adapters and the scale (under both names of the shared tower), no base weight
    assert any(".lora_magnitude_vector." in k for k in model_keys) == (variant != "lora")

    shutil.rmtree(run / "checkpoint" / "step-4")
    (run / "metrics.jsonl").unlink()
    resumed = _run(tmp_path, variant=variant)
    assert resumed.step == 2
    resumed.train()
    resumed.metrics.close()
    got = dict(resumed.model.named_parameters())
    assert all(torch.equal(got[n], p) for n, p in want.items())
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(want_losses) == 4 and [r["loss"] for r in logged if r.get("kind") == "train"] == want_losses[2:]


def test_a_changed_lora_rank_on_resume_is_a_one_line_error(tmp_path: Path) -> None:
    from titan_contrastive.checkpoint import CheckpointError

    first = _run(tmp_path, "--training.steps=2")
    first.train()
    first.metrics.close()
    for change, says in (
        ("--lora.rank=8", "lora_rank: 4 -> 8"),
        ("--lora.enable=false", "lora_rank: 4 -> 0"),
        ("--lora.use_dora=true", "lora_dora: False -> True"),
    ):
        with pytest.raises(CheckpointError, match=rf"^checkpoint step-2 holds a different architecture \({says}[;)]"):
            _run(tmp_path, "--training.steps=4", change)


def test_target_modules_that_match_nothing_are_refused(tmp_path: Path) -> None:
    from titan_contrastive.config import ConfigError

    encoder_folder(tmp_path)
    decoder_folder(tmp_path)
    with pytest.raises(ConfigError, match=r"lora.target_modules=\['nowhere'\]"):
        folder_run(tmp_path, "encoder", *LORA, "--training.local_batch_size=6", "--lora.target_modules", "nowhere")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_exports_merged_and_as_a_peft_adapter(tmp_path: Path, variant: str) -> None:
    """A LoRA (or DoRA with rsLoRA) run's step folder: --to sentence-transformers and --to hf hold the merged
    weights, --to peft the adapters alone; each loads in its library (PeftModel over the run's base folder) and
    gives the run's embeddings within the exporter's 1e-4 (float32: the merge's rounding, other kernel shapes),
    while the base alone is off by more than 1e-3."""
    from peft import PeftModel
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    from titan_contrastive.export import main as export_main
    from titan_contrastive.models.bi_encoder import build_tokenizer
    from titan_contrastive.models.weights import read_ours

    run = folder_run(
        tmp_path,
        "encoder",
        *VARIANTS[variant],
        "--training.local_batch_size=6",
        "--training.steps=2",
        "--checkpoint.enable=true",
        "--lr_scheduler.warmup_steps=0",
        "--optimizer.lr=2e-2",
    )
    run.train()
    run.metrics.close()
    step = tmp_path / "run-encoder" / "checkpoint" / "step-2"
    _, args, ours = read_ours(step)
    ours.eval()
    texts = ["frozen water", "a small animal kept as a pet", "the season after summer"]
    ids = build_tokenizer(args).encode_queries(texts, args.query_length)
    with torch.no_grad():
        want = ours._embed(ours.query_tower, ids)
    for to in ("sentence-transformers", "hf", "peft"):
        assert export_main([str(step), "--to", to, "--out", str(tmp_path / to)]) == 0
    assert (
        SentenceTransformer(str(tmp_path / "sentence-transformers"), device="cpu").encode(texts, convert_to_tensor=True)
        - want
    ).abs().max() <= 1e-4

    mask = ids != build_tokenizer(args).hf.pad_token_id

    def mean_pooled(tower) -> torch.Tensor:
        with torch.no_grad():
            hidden = tower(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        w = mask.unsqueeze(-1).float()
        return torch.nn.functional.normalize((hidden * w).sum(1) / w.sum(1), dim=-1)

    merged = AutoModel.from_pretrained(str(tmp_path / "hf")).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert (mean_pooled(merged) - want).abs().max() <= 1e-4
    base = AutoModel.from_pretrained(args.model_dir).eval()
    adapter = PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    assert adapter.peft_config["default"].use_dora == (variant != "lora")
    assert (mean_pooled(adapter) - want).abs().max() <= 1e-4
    assert (
        mean_pooled(AutoModel.from_pretrained(args.model_dir).eval()) - want
    ).abs().max() > 1e-3  # it trained: 10x the tolerance


SAVED = {"encoder": "word_embeddings", "decoder": "embed_tokens"}


@pytest.mark.parametrize("arch", list(FOLDERS))
def test_modules_to_save_train_in_full_and_the_step_stays_exact(tmp_path: Path, arch: str) -> None:
    """`[lora] modules_to_save`: the word embeddings train in full beside the adapters (their gradient
    and optimizer state), and GradCache with them equals the dense objective in float64."""
    trainer = folder_run(tmp_path, arch, *LORA, "--training.local_batch_size=6", "--lora.modules_to_save", SAVED[arch])
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    full = {n for n in trainable if ".lora_" not in n and n != "logit_scale"}
    assert full == {f"query_tower.{'embeddings.' if arch == 'encoder' else ''}{SAVED[arch]}.weight"}, full
    trainer.train_step([trainer.train_set.__getitems__(list(range(6)))])
    assert {id(p) for p in trainer.optimizer.state} == {
        id(p) for n, p in trainer.model.named_parameters() if n in trainable
    }
    trainer.metrics.close()
    _step(tmp_path / "exact", arch, "gradcache", *LORA, "--lora.modules_to_save", SAVED[arch], warm=True)


def test_modules_to_save_reach_the_checkpoint_and_every_export(tmp_path: Path) -> None:
    """The trained embeddings are in the checkpoint (beside the adapters) and in the merged and PEFT
    exports: each export passes the exporter's reload check (its embeddings equal the run's), and the
    merged folder's embedding matrix is the trained one, not the base's."""
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModel

    from titan_contrastive.export import main as export_main
    from titan_contrastive.models.weights import read_ours

    run = folder_run(
        tmp_path,
        "encoder",
        *LORA,
        "--lora.modules_to_save",
        "word_embeddings",
        "--training.local_batch_size=6",
        "--training.steps=2",
        "--checkpoint.enable=true",
        "--lr_scheduler.warmup_steps=0",
        "--optimizer.lr=2e-2",
    )
    run.train()
    run.metrics.close()
    step = tmp_path / "run-encoder" / "checkpoint" / "step-2"
    keys = FileSystemReader(str(step)).read_metadata().state_dict_metadata.keys()
    assert "model.query_tower.embeddings.word_embeddings.weight" in keys
    _, args, ours = read_ours(step)
    trained = ours.query_tower.embeddings.word_embeddings.weight.detach()
    base = AutoModel.from_pretrained(args.model_dir).embeddings.word_embeddings.weight.detach()
    assert not torch.equal(trained, base)
    for to in ("hf", "peft", "sentence-transformers"):
        assert export_main([str(step), "--to", to, "--out", str(tmp_path / to)]) == 0, to
    merged = AutoModel.from_pretrained(str(tmp_path / "hf")).embeddings.word_embeddings.weight.detach()
    assert torch.equal(merged, trained)


def test_modules_to_save_that_match_nothing_or_nest_are_refused(tmp_path: Path) -> None:
    from titan_contrastive.config import ConfigError

    with pytest.raises(ConfigError, match=r"^lora.modules_to_save=\['nowhere'\]: no module's name ends with 'nowhere'"):
        folder_run(tmp_path, "encoder", *LORA, "--training.local_batch_size=6", "--lora.modules_to_save", "nowhere")
    with pytest.raises(
        ConfigError,
        match=r"selects 'embeddings.position_embeddings' inside another selected module; name the innermost",
    ):
        folder_run(tmp_path, "encoder", *LORA, "--training.local_batch_size=6", "--lora.modules_to_save", "embeddings")
