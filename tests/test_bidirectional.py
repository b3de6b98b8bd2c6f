"""`[model] bidirectional`: a decoder embedder whose tokens attend to the whole text (LLM2Vec, GritLM, NV-Embed).
Its embeddings equal the definition: the causally loaded transformers model run with an attention mask that
lets every token read every real token, mean-pooled; every step kind equals the dense objective in float64
(dropout replayed, two gloo processes under FSDP2); its exports say so in config.json and load back
bidirectional; settings it cannot honour are one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.hf_folders import architecture_folder, decoder_folder, encoder_folder
from tests.needs import needs
from tests.test_hf_text import (
    KINDS,
    PAIRS,
    _step,
    _step_distributed,
    _train_main,
    assert_gradcache_replays_dropout,
    folder_run,
)

BIDIRECTIONAL = "--model.bidirectional=true"
TEXTS = [q for q, _ in PAIRS[:6]]


def _folder(tmp: Path, arch: str) -> Path:
    return decoder_folder(tmp, 0.0) if arch == "qwen3" else architecture_folder(tmp, arch, 0.0)


def _definition(folder: Path, ids: torch.Tensor, pad: int) -> torch.Tensor:
    """Mean-pooled, normalized hidden states of the folder's model loaded as transformers loads it (causal), run
    with a 4-D mask in which every token reads every real token of its row."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(folder)).double().eval()
    real = ids != pad
    every = real[:, None, None, :].expand(-1, 1, ids.shape[1], -1)
    with torch.no_grad():
        hidden = model(input_ids=ids.masked_fill(~real, 0), attention_mask=every).last_hidden_state
    weights = real.unsqueeze(-1).double()
    return torch.nn.functional.normalize((hidden * weights).sum(1) / weights.sum(1), dim=-1)


@needs("hf")
@pytest.mark.parametrize("arch", ["qwen3", "llama", "mistral", "qwen2"])
def test_embeddings_equal_the_definition(tmp_path: Path, arch: str) -> None:
    """Right-padded rows of different lengths; `auto` pooling is mean; the causal model's differ."""
    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs, build_tokenizer

    folder = _folder(tmp_path, arch)
    args = BiEncoderArgs(path=str(folder), bidirectional=True).resolve()
    assert (args.pooling, args.bidirectional) == ("mean", True)
    tokenizer = build_tokenizer(args)
    ids = tokenizer.encode_queries(TEXTS, 16)
    assert len({int((row != tokenizer.pad_id).sum()) for row in ids}) > 2
    model = BiEncoder(args).double().eval()
    with torch.no_grad():
        got = model._embed(model.query_tower, ids)
    want = _definition(folder, ids, tokenizer.pad_id)
    assert (got - want).abs().max() <= 1e-10
    causal = BiEncoder(BiEncoderArgs(path=str(folder), pooling="mean")).double().eval()
    with torch.no_grad():
        assert (causal._embed(causal.query_tower, ids) - want).abs().max() > 1e-3


@needs("hf")
def test_the_first_token_reads_the_last(tmp_path: Path) -> None:
    """cls pooling, refused on a causal decoder, reads the whole text once it attends both ways."""
    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs

    folder = _folder(tmp_path, "qwen3")
    model = BiEncoder(BiEncoderArgs(path=str(folder), bidirectional=True, pooling="cls")).double().eval()
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 9]])
    with torch.no_grad():
        first = model._embed(model.query_tower, ids)
    assert (first[0] - first[1]).abs().max() > 1e-3


@needs("hf")
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_step_kind_equals_the_dense_objective(tmp_path: Path, kind: str) -> None:
    _step(tmp_path, "decoder", kind, BIDIRECTIONAL)


@needs("hf")
def test_gradcache_replays_the_dropout(tmp_path: Path) -> None:
    assert_gradcache_replays_dropout(tmp_path, "decoder", BIDIRECTIONAL)


@needs("hf")
def test_global_negatives_on_two_ranks_under_fsdp2(tmp_path: Path) -> None:
    decoder_folder(tmp_path)
    run_distributed(_step_distributed, 2, str(tmp_path), "decoder", False, BIDIRECTIONAL)


@needs("hf")
def test_exports_keep_the_attention_both_ways(tmp_path: Path) -> None:
    """A LoRA step's merged transformers and sentence-transformers folders hold `is_causal: false` and embed as
    the run does, and so do its adapters on a base loaded so (the exporter checks each); loaded causally the same
    weights embed otherwise; a run from the export attends both ways without the setting."""
    from transformers import AutoModel

    from titan_contrastive.export import main as export_main
    from titan_contrastive.models.bi_encoder import BiEncoderArgs, build_tokenizer
    from titan_contrastive.models.bi_encoder.model import embed
    from titan_contrastive.models.weights import read_ours

    run = folder_run(
        tmp_path, "decoder", BIDIRECTIONAL, "--lora.enable=true", "--lora.rank=4", "--training.local_batch_size=6",
        "--training.steps=1", "--checkpoint.enable=true",
    )  # fmt: skip
    assert run.model.query_tower.config.is_causal is False
    run.train()
    run.metrics.close()
    step = tmp_path / "run-decoder" / "checkpoint" / "step-1"
    for to in ("hf", "sentence-transformers", "peft"):
        assert export_main([str(step), "--to", to, "--out", str(tmp_path / to)]) == 0, to
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["is_causal"] is False
    assert json.loads((tmp_path / "sentence-transformers" / "config.json").read_text())["is_causal"] is False
    _, args, ours = read_ours(step)
    ids = build_tokenizer(args).encode_queries(TEXTS, args.query_length)
    causal = AutoModel.from_pretrained(str(tmp_path / "hf")).eval()
    causal.config.is_causal = True
    with torch.no_grad():
        want = ours.eval()._embed(ours.query_tower, ids)
        assert (embed(causal, ids, ours.pad_id, "mean", 0) - want).abs().max() > 1e-3
    again = BiEncoderArgs(path=str(tmp_path / "hf")).resolve()
    assert (again.bidirectional, again.pooling) == (True, "mean")


@needs("hf")
def test_what_it_cannot_honour_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """false on an encoder; true where the folder's own code keeps its causal mask (gte-Qwen2's kind: a `qwen2`
    model type whose code ships in the folder); either on a family without a text decoder."""
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"query": q, "positive": p}) + "\n" for q, p in PAIRS))
    own = architecture_folder(tmp_path, "own-code-decoder")
    cases = [
        (f"--model.path={encoder_folder(tmp_path)} --model.bidirectional=false", "attends both ways"),
        (
            f"--model.path={own} --model.trust_remote_code=true {BIDIRECTIONAL}",
            "still attends to earlier tokens only (its model code, TinyDecoder, does not read",
        ),
    ]
    capsys.readouterr()
    for args, message in cases:
        code, err = _train_main(tmp_path, *args.split(), capsys=capsys)
        assert code == 2 and len(err) == 1 and message in err[0], (args, err)
    assert not (tmp_path / "run" / "checkpoint").exists()
    from tests.test_trainer import make_trainer
    from titan_contrastive.config import ConfigError

    with pytest.raises(ConfigError, match=r"^model.bidirectional=true: the clip family has no decoder"):
        make_trainer(str(tmp_path / "clip"), BIDIRECTIONAL)
