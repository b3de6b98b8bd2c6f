"""Locked towers and partial tuning (`[model] freeze`, `unlocked_layers`), on the real clip/debug model.

- what each entry freezes (tower names, unlocked last blocks, patterns) and the one-line error;
- through the trainer (float64): frozen parameters bit-identical after training steps and absent
  from the optimizer state; the trainable tower's gradients equal those of the unfrozen model
  (freezing one tower does not change the other's gradient); the locked tower runs once per
  sample without a graph (no saved activations) under accumulation, global negatives and
  GradCache (whose re-forward reuses the locked tower's first-pass embeddings).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.needs import require
from titan_contrastive.components.freeze import apply_freeze
from titan_contrastive.components.memory_probe import SavedActivations
from titan_contrastive.config import ConfigError, parse_args
from titan_contrastive.models import get_flavor_args, get_model_spec
from titan_contrastive.train import Trainer

TOWERS = {"image": "visual.", "text": "text."}


def tiny_clip() -> torch.nn.Module:
    args = get_flavor_args("clip", "debug").update_from_data(image_shape=(1, 28, 28), vocab_size=259, context_length=32)
    return get_model_spec("clip").build_model(args)


def frozen_names(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if not p.requires_grad}


def test_what_each_entry_freezes() -> None:
    model = tiny_clip()
    summary = apply_freeze(model, ["image"], 0, TOWERS)
    assert frozen_names(model) == {n for n, _ in model.named_parameters() if n.startswith("visual.")}
    assert model.visual.frozen and not model.text.frozen and "locked towers (run without a graph): image" in summary

    model = tiny_clip()
    apply_freeze(model, ["image"], 1, TOWERS)  # the last block, ln_post and proj stay trainable
    trainable_visual = {n for n, p in model.named_parameters() if n.startswith("visual.") and p.requires_grad}
    assert trainable_visual == {
        n
        for n, _ in model.named_parameters()
        if n.startswith(("visual.transformer.blocks.1.", "visual.ln_post.", "visual.proj"))
    }
    assert not model.visual.frozen

    model = tiny_clip()
    apply_freeze(model, ["text.transformer.blocks.*", "logit_scale"], 0, TOWERS)
    assert frozen_names(model) == {
        n for n, _ in model.named_parameters() if n.startswith("text.transformer.blocks.") or n == "logit_scale"
    }
    with pytest.raises(ConfigError) as err:
        apply_freeze(tiny_clip(), ["vision"], 0, TOWERS)
    assert (
        len(str(err.value).splitlines()) == 1
        and "'vision' matches no parameter" in str(err.value)
        and "image, text" in str(err.value)
    )


def test_locked_tower_keeps_no_activations() -> None:
    model = tiny_clip()
    images, ids = torch.randn(4, 1, 28, 28), torch.randint(3, 200, (4, 32))
    ids[:, 10] = 2
    params = list(model.parameters())
    with SavedActivations(params) as full:
        kept = model(images, ids)
    apply_freeze(model, ["image"], 0, TOWERS)
    with SavedActivations(params) as locked:
        img, txt, _ = model(images, ids)
    with SavedActivations(params) as text_only:
        kept_text = (model.encode_text(ids), model.logit_scale.exp())  # what a locked image tower leaves to save
    assert not img.requires_grad and txt.requires_grad
    assert locked.peak == text_only.peak < full.peak  # nothing of the image tower is saved for backward
    del kept, kept_text


def _trainer(tmp: Path, *extra: str, dtype: str = "float64") -> Trainer:
    return Trainer(
        parse_args(
            [
                f"--training.dtype={dtype}",
                "--training.steps=3",
                "--training.local_batch_size=8",
                "--training.global_batch_size=16",
                "--metrics.enable_tensorboard=false",
                "--eval.enable=false",
                f"--job.dump_folder={tmp}",
                *extra,
            ]
        )
    )


@pytest.mark.parametrize(
    "kind", [(), ("--loss.negatives=global",), ("--gradcache.enabled=true", "--gradcache.chunk_sizes=3")]
)
def test_trainer_lit_run(tmp_path: Path, kind: tuple[str, ...]) -> None:
    locked = _trainer(tmp_path / "a", "--model.freeze=text", *kind)
    plain = _trainer(tmp_path / "b", *kind)
    start = {n: p.detach().clone() for n, p in locked.model.named_parameters()}
    assert all(torch.equal(start[n], p) for n, p in plain.model.named_parameters())  # same seed, same init
    batches = [locked.train_set.__getitems__(list(range(i * 8, i * 8 + 8))) for i in range(2)]
    calls: list[int] = []
    hook = locked.model.text.register_forward_hook(lambda m, args, out: calls.append(len(args[0])))
    locked.gradient_step(batches)
    hook.remove()
    plain.gradient_step(batches)
    for name, p in locked.model.named_parameters():
        if name.startswith("text."):
            assert p.grad is None, name
        else:  # freezing the text tower leaves the image tower's gradient as it was
            q = dict(plain.model.named_parameters())[name]
            assert torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-12), name
    assert sum(calls) == 16  # the locked tower runs once per sample, also under GradCache and global negatives
    locked.optimizer.zero_grad(set_to_none=True)
    for step in range(2):
        locked.train_step([locked.train_set.__getitems__(list(range(s, s + 8))) for s in (32 * step, 32 * step + 8)])
    for name, p in locked.model.named_parameters():
        assert torch.equal(p, start[name]) == name.startswith("text."), name  # frozen: bit-identical; the rest trained
    in_state = {id(p) for group in locked.optimizer.param_groups for p in group["params"]} | set(
        map(id, locked.optimizer.state)
    )
    assert not any(id(p) in in_state for n, p in locked.model.named_parameters() if n.startswith("text."))


def test_lit_family_locked_text_tower(tmp_path: Path) -> None:
    """lit/minilm_debug: the pretrained MiniLM text tower locked, the ViT trained; parameter count
    exact; the locked tower bit-identical after steps and run once per sample without a graph."""
    require("hf")
    trainer = _trainer(
        tmp_path,
        "--model.name=lit",
        "--model.flavor=minilm_debug",
        "--model.freeze=text",
        "--data.dataset=emoji",
        dtype="float32",
    )
    model = trainer.model
    assert sum(p.numel() for p in model.parameters()) == trainer.model_args.num_params()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    calls: list[int] = []
    model.text.register_forward_hook(
        lambda m, args, kwargs, out: calls.append(len(kwargs["input_ids"])), with_kwargs=True
    )
    batch = trainer.train_set.__getitems__(list(range(16)))
    image, text, _ = model(batch["image"], batch["text"])
    assert image.requires_grad and not text.requires_grad and text.shape == (16, 384)
    for step in range(2):
        trainer.train_step(
            [
                trainer.train_set.__getitems__(list(range(16 * step, 16 * step + 8))),
                trainer.train_set.__getitems__(list(range(16 * step + 8, 16 * step + 16))),
            ]
        )
    assert sum(calls) == 16 + 2 * 16  # the forward above, then once per trained sample
    for name, p in model.named_parameters():
        assert torch.equal(p, start[name]) == name.startswith("text."), name


def test_the_probe_counts_a_tensor_two_operators_save_once() -> None:
    """relu saves its output and log1p saves the same tensor as its input: one tensor's bytes, not two; a slice of
    it, saved by another operator, is its own bytes."""
    x = torch.randn(64, 32, dtype=torch.float64, requires_grad=True)
    with SavedActivations([x]) as probe:
        y = torch.log1p(torch.relu(x))
    assert probe.peak == 64 * 32 * 8
    with SavedActivations([x]) as probe:
        r = torch.relu(x)
        y = torch.log1p(r).sum() + (r[:16] * x[:16]).sum()  # mul saves the slice r[:16] (and x's, a parameter's)
    assert probe.peak == 64 * 32 * 8 + 16 * 32 * 8
    del y
