"""`[model] attn_implementation`: the attention kernel transformers runs a bi_encoder's or qwen_vl's model with.
Eager and SDPA embed the same padded rows alike on an encoder (float64 <= 1e-10) and a decoder (its norm's
float32 rounding), and a GradCache step on eager attention equals the dense objective within float32's rounding
(`EAGER_REL`); a kernel that cannot run here (flash-attn not installed) and the setting on a family without a
transformers model are one-line errors; qwen_vl runs on eager attention; a change on resume is applied."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.hf_folders import decoder_folder, encoder_folder
from tests.needs import needs
from tests.test_hf_text import PAIRS, _step, _train_main


@needs("hf")
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_eager_and_sdpa_embed_alike(tmp_path: Path, kind: str) -> None:
    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs, build_tokenizer

    folder = (encoder_folder if kind == "encoder" else decoder_folder)(tmp_path, 0.0)
    texts = [q for q, _ in PAIRS[:6]]
    out = {}
    for kernel in ("eager", "sdpa"):
        args = BiEncoderArgs(path=str(folder), attn_implementation=kernel).resolve()
        model = BiEncoder(args).double().eval()
        assert model.query_tower.config._attn_implementation == kernel
        ids = build_tokenizer(args).encode_queries(texts, 16)
        with torch.no_grad():
            out[kernel] = model._embed(model.query_tower, ids)
    # Qwen3's RMSNorm computes in float32 whatever the model's dtype, which carries the kernels' float64
    # differences up to float32's rounding
    assert (out["eager"] - out["sdpa"]).abs().max() <= (1e-10 if kind == "encoder" else 1e-6)


EAGER_REL = 1e-5
"""Qwen3's and Qwen2-VL's eager attention (transformers' `eager_attention_forward`) takes its softmax in float32
whatever the model's dtype: the chunks' and the whole batch's float64 scores, equal to their last bits or not
depending on the machine's kernels for each shape, are rounded to float32 there, so a float64 step on it is exact to
float32's rounding (the standard's 1e-5). With that softmax in float64 the same step is within 1e-16."""


@needs("hf")
def test_a_gradcache_step_on_eager_attention_equals_the_objective(tmp_path: Path) -> None:
    _step(tmp_path, "decoder", "gradcache", "--model.attn_implementation=eager", rel=EAGER_REL)


@needs("hf")
def test_qwen_vl_steps_on_eager_attention(tmp_path: Path) -> None:
    """Its language model and its vision tower on eager attention; a GradCache step equals the dense objective
    (within float32's rounding: `EAGER_REL`)."""
    from tests.test_qwen_vl import _step as vl_step
    from tests.test_qwen_vl import vl_run

    trainer = vl_run(tmp_path / "built", "qwen2_vl", "--model.attn_implementation=eager")
    assert trainer.model.tower.config._attn_implementation == "eager"
    assert trainer.model.tower.config.vision_config._attn_implementation == "eager"
    trainer.metrics.close()
    vl_step(tmp_path, "qwen2_vl", "gradcache", "--model.attn_implementation=eager", rel=EAGER_REL)


@needs("hf")
def test_what_cannot_run_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from tests.test_trainer import make_trainer
    from titan_contrastive.config import ConfigError

    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"query": q, "positive": p}) + "\n" for q, p in PAIRS))
    if importlib.util.find_spec("flash_attn") is None:  # on a machine with flash-attn it runs instead
        capsys.readouterr()
        code, err = _train_main(
            tmp_path, f"--model.path={decoder_folder(tmp_path)}", "--model.attn_implementation=flash_attention_2",
            capsys=capsys,
        )  # fmt: skip
        assert code == 2 and len(err) == 1, err
        assert "model.attn_implementation=flash_attention_2: transformers cannot run" in err[0], err
    with pytest.raises(ConfigError, match=r"^model.attn_implementation=eager: the clip family runs no transformers"):
        make_trainer(str(tmp_path / "clip"), "--model.attn_implementation=eager")


@needs("hf")
def test_a_change_on_resume_is_applied(tmp_path: Path) -> None:
    """The kernel changes how the attention is computed, not the weights: a resumed run may switch it."""
    from titan_contrastive.checkpoint.resume import config_changes

    saved = {"model": {"family": "bi_encoder", "args": {"path": "m", "attn_implementation": ""}}}
    now = {"family": "bi_encoder", "args": {"path": "m", "attn_implementation": "eager"}}
    assert config_changes(2, saved, None, now) == []
