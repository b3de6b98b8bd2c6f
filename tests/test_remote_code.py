"""The bi_encoder on a folder that ships its own model code (config.json `auto_map`, as nomic-embed-text,
gte-*-v1.5 and jina-embeddings-v2 do), with `[model] trust_remote_code`: the tiny model of
tests/fixtures/own_code (its own layers and attention, nothing of transformers' but `PreTrainedModel`).
Refused in one line without the flag, and with the flag on a family that never runs a folder's code, or
when the code lives in a repository that is not in the local cache. With it: every step kind, activation
checkpointing, LoRA and the dropout's replay equal the dense objective in float64; its layers are the
FSDP2 units on 2 gloo processes, and 4 processes load the code at once under DDP; the exports carry the
code, load back with `trust_remote_code=True` and embed as the run does; the standalone evaluation and the
miner take it too; a run on it resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.hf_folders import architecture_folder
from tests.needs import needs
from tests.test_hf_text import KINDS, PAIRS, _step, _train_main, assert_gradcache_replays_dropout, folder_run

ARCH = "own-code"
TRUST = "--model.trust_remote_code=true"


@needs("hf")
def test_the_folders_code_is_loaded_and_its_layers_found(tmp_path: Path) -> None:
    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs, bi_encoder_blocks

    args = BiEncoderArgs(path=str(architecture_folder(tmp_path, ARCH)), shared=False, trust_remote_code=True)
    model = BiEncoder(args.resolve())
    assert type(model.query_tower).__module__.startswith("transformers_modules.")  # the folder's own class
    assert [type(b).__name__ for b in bi_encoder_blocks(model)] == ["TinyLayer"] * 4
    assert args.num_params() == sum(p.numel() for p in model.parameters())
    assert args.resolve().pooling == "mean"  # a model type transformers does not map to a causal LM


@needs("hf")
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_step_kind_equals_the_dense_objective(tmp_path: Path, kind: str) -> None:
    _step(tmp_path, ARCH, kind, TRUST)


@needs("hf")
def test_activation_checkpointing_and_lora_keep_gradcache_exact(tmp_path: Path) -> None:
    _step(tmp_path, ARCH, "gradcache", TRUST, "--activation_checkpoint.mode=full")
    lora = ("--lora.enable=true", "--lora.rank=4", "--lora.target_modules=all-linear")
    _step(tmp_path, ARCH, "gradcache", TRUST, *lora, warm=True)


@needs("hf")
def test_gradcache_replays_the_dropout(tmp_path: Path) -> None:
    assert_gradcache_replays_dropout(tmp_path, ARCH, TRUST)


def _distributed(tmp: str, ddp: bool) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    layout = [f"--parallelism.data_parallel_replicate_degree={world}", "--parallelism.data_parallel_shard_degree=1"]
    _step(Path(tmp), ARCH, "global", TRUST, *(layout if ddp else []))


@needs("hf")
@pytest.mark.parametrize("world,parallel", [(2, "fsdp2"), (4, "ddp")])
def test_global_negatives_on_several_ranks(tmp_path: Path, world: int, parallel: str) -> None:
    """Each rank loads the folder's code (under the module cache's file lock) and builds its model from it; 4 ranks
    x 3 x 2 accumulation steps take 24 pairs."""
    architecture_folder(tmp_path, ARCH)
    rows = [*PAIRS, *((f"the {q}", p) for q, p in PAIRS)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"query": q, "positive": p}) + "\n" for q, p in rows))
    run_distributed(_distributed, world, str(tmp_path), parallel == "ddp")


@needs("hf")
def test_exports_carry_the_code_and_load_back_trusted(tmp_path: Path) -> None:
    """With LoRA on every linear layer: each format is checked by the exporter against the run's embeddings
    (loaded with trust_remote_code=True); the folders hold the model's code; sentence-transformers embeds
    the run's texts as the run does."""
    from sentence_transformers import SentenceTransformer

    from titan_contrastive.export import main as export_main
    from titan_contrastive.models.weights import read_ours

    lora = ("--lora.enable=true", "--lora.rank=4", "--lora.target_modules=all-linear")
    run = folder_run(
        tmp_path, ARCH, TRUST, *lora, "--training.local_batch_size=6", "--training.steps=1", "--checkpoint.enable=true"
    )
    run.train()
    run.metrics.close()
    step = tmp_path / f"run-{ARCH}" / "checkpoint" / "step-1"
    for to in ("hf", "sentence-transformers", "peft"):
        assert export_main([str(step), "--to", to, "--out", str(tmp_path / to)]) == 0, to
    assert (tmp_path / "hf" / "modeling_tiny.py").is_file()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["auto_map"]["AutoModel"].endswith("TinyModel")
    _, args, ours = read_ours(step)
    texts = ["frozen water", "a small animal kept as a pet"]
    from titan_contrastive.models.bi_encoder import build_tokenizer

    ids = build_tokenizer(args).encode_queries(texts, args.query_length)
    with torch.no_grad():
        want = ours.eval()._embed(ours.query_tower, ids).float()
    theirs = SentenceTransformer(str(tmp_path / "sentence-transformers"), device="cpu", trust_remote_code=True)
    assert (theirs.encode(texts, convert_to_tensor=True) - want).abs().max() <= 1e-5


@needs("hf", "data")
def test_the_miner_and_the_evaluation_run_the_code_when_asked(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from titan_contrastive.evaluate import main as evaluate_main
    from titan_contrastive.mine import main as mine_main

    folder = architecture_folder(tmp_path, ARCH)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"query": q, "positive": p}) + "\n" for q, p in PAIRS))
    out = tmp_path / "mined.jsonl"
    base = [str(pairs), "--model", str(folder), "--out", str(out), "--relative-margin", "none"]
    capsys.readouterr()
    assert mine_main(base) != 0 and not out.exists()
    assert mine_main([*base, "--trust-remote-code"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(PAIRS) and all(r["negative_1"] != r["positive"] for r in rows)
    capsys.readouterr()
    assert evaluate_main([str(folder)]) == 2
    assert "model.trust_remote_code=true" in capsys.readouterr().err
    assert evaluate_main([str(folder), "--trust-remote-code", "--out", str(tmp_path / "eval.json")]) == 0
    assert 0 <= json.loads((tmp_path / "eval.json").read_text())["ndcg@10"] <= 1


@needs("hf")
def test_what_it_cannot_load_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = architecture_folder(tmp_path, ARCH)
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"query": q, "positive": p}) + "\n" for q, p in PAIRS))
    elsewhere = tmp_path / "code-elsewhere"  # nomic-embed-text's layout: the code named in another repository
    elsewhere.mkdir()
    for file in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (elsewhere / file).write_bytes((folder / file).read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {k: f"nobody/tiny-impl--{v}" for k, v in config["auto_map"].items()}
    (elsewhere / "config.json").write_text(json.dumps(config))
    needs_more = tmp_path / "needs-a-package"  # code importing what is not installed (nomic's einops, say)
    needs_more.mkdir()
    for file in folder.iterdir():
        (needs_more / file.name).write_bytes(file.read_bytes())
    code = (folder / "modeling_tiny.py").read_text()
    (needs_more / "modeling_tiny.py").write_text("import not_an_installed_package\n" + code)
    cases = [
        ((f"--model.path={folder}",), "model.trust_remote_code=true"),
        ((f"--model.path={needs_more}", TRUST), "the code it ships cannot be imported"),
        ((f"--model.path={elsewhere}", TRUST), "lives in nobody/tiny-impl, which is not in the local Hugging Face"),
    ]
    for args, message in cases:
        capsys.readouterr()
        code, err = _train_main(tmp_path, *args, capsys=capsys)
        assert code == 2 and len(err) == 1 and message in err[0], (args, err)
    from titan_contrastive.train import main

    capsys.readouterr()
    assert main([f"--job.dump_folder={tmp_path / 'clip'}", "--training.steps=1", TRUST]) == 2  # the default: clip
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "the clip family loads no folder's own code" in err[0], err


@needs("hf")
def test_a_run_on_it_resumes(tmp_path: Path) -> None:
    """A checkpoint of a run on the folder resumes with its weights (the flag is loading, not architecture: its
    change is no architecture change, and without it the folder is refused as at any start)."""
    from titan_contrastive.config import ConfigError

    flags = (TRUST, "--training.local_batch_size=6", "--checkpoint.enable=true", "--checkpoint.interval=1")
    first = folder_run(tmp_path, ARCH, *flags, "--training.steps=1")
    first.train()
    first.metrics.close()
    saved = {k: v.clone() for k, v in first.model.state_dict().items()}
    resumed = folder_run(tmp_path, ARCH, *flags, "--training.steps=2")
    assert resumed.step == 1
    assert all(torch.equal(v, saved[k]) for k, v in resumed.model.state_dict().items())
    resumed.metrics.close()
    with pytest.raises(ConfigError, match="model.trust_remote_code=true"):
        folder_run(tmp_path, ARCH, *flags[1:], "--training.steps=2")
