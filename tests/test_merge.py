"""`python -m titan_contrastive.merge`: step folders merged by a weighted average (a model soup) or by slerp. The
merged folder reads back (verified, as `export` reads it) with every weight the definition written here gives from
the sources' weights, in float64 then the sources' float32 (1e-6 relative); clip's `init_from` reads it and it
exports; what cannot work is one line, exit 2, nothing written."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.needs import needs
from tests.test_export import BYTE, step_folder
from titan_contrastive.merge import main, merged, slerp
from titan_contrastive.models.clip.args import CLIPArgs
from titan_contrastive.models.weights import read_ours


def clip_step(dump: Path, seed: int, args: CLIPArgs = BYTE, **config: object) -> Path:
    """step-1 of a run holding a CLIP of `args` started from `seed`, written as training writes it."""
    return step_folder(dump, args, seed, config or None)[0]


def weights_of(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v.detach().double() for k, v in read_ours(folder)[2].state_dict().items()}


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        scale = want[name].abs().max().clamp_min(1e-30)
        assert (got[name] - want[name]).abs().max() <= 1e-6 * scale, name


def run(capsys: pytest.CaptureFixture, *argv: object) -> tuple[int, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def test_a_weighted_soup_is_the_weighted_mean_of_every_weight(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    steps = [clip_step(tmp_path / f"run{i}", seed=i) for i in range(3)]
    out = tmp_path / "soup" / "step-0"
    assert run(capsys, *steps, "--out", out, "--weights", "1,2,0.5") == (0, "")
    sources = [weights_of(s) for s in steps]
    want = {k: (1 * sources[0][k] + 2 * sources[1][k] + 0.5 * sources[2][k]) / 3.5 for k in sources[0]}
    assert_close(weights_of(out), want)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["merged"]["method"] == "mean" and manifest["merged"]["weights"] == [1.0, 2.0, 0.5]
    assert manifest["model"] == json.loads((steps[0] / "manifest.json").read_text())["model"]
    assert [p.name for p in out.parent.iterdir()] == ["step-0"]  # no temporary folder left

    equal = tmp_path / "equal"
    assert run(capsys, *steps[:2], "--out", equal) == (0, "")
    assert_close(weights_of(equal), {k: (sources[0][k] + sources[1][k]) / 2 for k in sources[0]})

    from titan_contrastive import export
    from titan_contrastive.models.registry import resolve_model_args

    assert_close(
        {k: v.double() for k, v in resolve_model_args("clip", "debug", str(out))[1].items()}, want
    )  # init_from
    assert export.main([str(out), "--to", "open_clip", "--out", str(tmp_path / "exported")]) == 0


def defined_slerp(a: torch.Tensor, b: torch.Tensor, t: float) -> torch.Tensor:
    """Slerp written from its definition, one number at a time for the angle (Python floats)."""
    x, y = a.flatten().tolist(), b.flatten().tolist()
    na, nb = math.sqrt(sum(v * v for v in x)), math.sqrt(sum(v * v for v in y))
    if na * nb == 0:  # a zero tensor (a bias at its init): no angle, the linear mix
        return (1 - t) * a + t * b
    w = math.acos(max(-1.0, min(1.0, sum(u * v for u, v in zip(x, y)) / (na * nb))))
    if math.sin(w) < 1e-6:
        return (1 - t) * a + t * b
    return (math.sin((1 - t) * w) * a + math.sin(t * w) * b) / math.sin(w)


@pytest.mark.parametrize("t", [0.0, 0.3, 1.0])
def test_slerp_interpolates_each_tensor_on_its_great_circle(
    tmp_path: Path, capsys: pytest.CaptureFixture, t: float
) -> None:
    steps = [clip_step(tmp_path / f"run{i}", seed=i) for i in range(2)]
    out = tmp_path / "slerp"
    assert run(capsys, *steps, "--out", out, "--method", "slerp", "--t", t) == (0, "")
    a, b = weights_of(steps[0]), weights_of(steps[1])
    got = weights_of(out)
    assert_close(got, {k: defined_slerp(a[k], b[k], t) for k in a})
    if 0 < t < 1:  # not the linear mix: slerp keeps the norm of equal-norm tensors the mix shrinks
        name = "visual.conv1.weight"
        assert not torch.allclose(got[name], (1 - t) * a[name] + t * b[name], rtol=0, atol=1e-4)


def test_slerp_of_parallel_or_zero_tensors_is_the_linear_mix() -> None:
    a = torch.randn(5, 3, dtype=torch.float64)
    for b in (2 * a, torch.zeros_like(a)):
        assert torch.allclose(slerp(a, b, 0.25), 0.75 * a + 0.25 * b, rtol=0, atol=1e-12)


def test_integer_tensors_are_kept_and_must_agree() -> None:
    ids = torch.arange(4)
    states = [{"ids": ids, "w": torch.ones(2)}, {"ids": ids.clone(), "w": 3 * torch.ones(2)}]
    out = merged(states, [1.0, 1.0], "mean", 0.5)
    assert torch.equal(out["ids"], ids) and torch.equal(out["w"], 2 * torch.ones(2))
    states[1]["ids"] = ids.flip(0)
    with pytest.raises(ValueError, match="^ids: a torch.int64 tensor that differs"):
        merged(states, [1.0, 1.0], "mean", 0.5)


def test_what_cannot_merge_is_one_line_and_nothing_written(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a, b, c = (clip_step(tmp_path / f"run{i}", seed=i) for i in range(3))
    wide = clip_step(tmp_path / "wide", seed=0, args=dataclasses.replace(BYTE, embed_dim=24))
    lora = clip_step(tmp_path / "lora", seed=0, lora={"enable": True})
    other = tmp_path / "static" / "step-1"
    other.mkdir(parents=True)
    (other / "manifest.json").write_text(json.dumps({"model": {"family": "static", "args": {}}}))
    taken = tmp_path / "taken"
    taken.mkdir()
    out = tmp_path / "out"
    for argv, message in [
        ([a, "--out", out], "one checkpoint; give two or more"),
        ([a, a, "--out", out], "names a folder twice"),
        ([a, tmp_path, "--out", out], "not one of our step folders"),
        ([a, b, c, "--out", out, "--method", "slerp"], "slerp interpolates two checkpoints, and 3"),
        ([a, b, "--out", out, "--method", "slerp", "--t", "1.5"], "--t=1.5: the fraction"),
        ([a, b, "--out", out, "--method", "slerp", "--weights", "1,2"], "--weights=1,2: slerp takes --t"),
        ([a, b, "--out", out, "--t", "0.2"], "--t=0.2 is slerp's"),
        ([a, b, "--out", out, "--weights", "1"], r"--weights=1: 2 weights >= 0 \(one per STEP\)"),
        ([a, b, "--out", out, "--weights", "1,-1"], "--weights=1,-1: 2 weights >= 0"),
        ([a, "--with-start", "--out", out, "--weights", "1,2,3"], r"2 weights >= 0 \(the start's first, then"),
        ([a, b, "--with-start", "--out", out, "--method", "slerp"], "slerp interpolates two checkpoints, and 3"),
        ([a, "--with-start", "--out", out], "--with-start: .*start at random .*; merge step folders without"),
        ([a, b, "--out", out, "--weights", "0,0"], "not all 0"),
        ([a, b, "--out", out, "--weights", "x,1"], "numbers, comma-separated"),
        ([a, b, "--out", taken], "exists; choose a new folder"),
        ([a, b, "--out", a / "soup"], "is inside a checkpoint it reads"),
        ([a, other, "--out", out], "a static model, and .* holds a clip one"),
        ([a, lora, "--out", out], "a full fine-tune, and .* is a LoRA run|a LoRA run, and .* is a full fine-tune"),
        ([a, wide, "--out", out], "its weights differ from .* in "),
    ]:
        code, err = run(capsys, *argv)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (argv, err)
        assert re.search(message, err), (message, err)
    assert not out.exists() and list(taken.iterdir()) == []
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@needs("hf")
def test_a_soup_of_two_text_runs_embeds_with_the_mean_weights_and_evaluates(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Two bi_encoder runs on the tiny BERT folder (other learning rates) merged: the folder `evaluate` loads embeds
    as the first run's model with every weight set to the mean of the two, and the command evaluates it."""
    from tests.test_hf_text import folder_run
    from tests.test_retrieval_metrics import write_beir
    from titan_contrastive import evaluate

    steps = []
    for name, lr in (("a", "1e-3"), ("b", "3e-3")):
        trainer = folder_run(
            tmp_path / name, "encoder", "--training.local_batch_size=6", "--training.steps=1",
            "--checkpoint.enable=true", f"--optimizer.lr={lr}",
        )  # fmt: skip
        trainer.train()
        trainer.metrics.close()
        steps.append(tmp_path / name / "run-encoder" / "checkpoint" / "step-1")
    out = tmp_path / "soup"
    assert run(capsys, *steps, "--out", out) == (0, "")

    _, _, model = read_ours(steps[0])
    other = read_ours(steps[1])[2].state_dict()
    model.load_state_dict(
        {k: ((v.double() + other[k].double()) / 2).to(v.dtype) for k, v in model.state_dict().items()}
    )
    args, soup = evaluate.load_text_model(str(out), 0, 0)
    from titan_contrastive.models.bi_encoder import build_tokenizer

    texts = ["the capital of France", "a tower in Paris", "zebra"]
    ids = build_tokenizer(args).encode_queries(texts, args.query_length)
    with torch.no_grad():
        got, want = soup.embed_side("query", ids), model.eval().embed_side("query", ids)
    assert (got - want).abs().max() <= 1e-6 and not torch.allclose(
        got, read_ours(steps[1])[2].eval().embed_side("query", ids), atol=1e-4
    )
    assert (
        evaluate.main([str(out), "--beir", str(write_beir(tmp_path / "beir")), "--out", str(tmp_path / "m.json")]) == 0
    )
    assert 0 <= json.loads((tmp_path / "m.json").read_text())["ndcg@10"] <= 1


def _effective(folder: Path) -> tuple[Any, Any, dict[str, torch.Tensor]]:
    """(args, model, every adapted weight W0 + s B A of the folder's LoRA model), s = alpha / r (rsLoRA: / sqrt r),
    in float64."""
    _, args, model = read_ours(folder)
    state = {k: v.double() for k, v in model.state_dict().items()}
    s = args.lora_alpha / (math.sqrt(args.lora_rank) if args.lora_rslora else args.lora_rank)
    a = "lora_A.default.weight"
    stems = [name[: -len(a)] for name in state if name.endswith(a)]
    weights = {
        st: state[st + "base_layer.weight"] + s * state[st + "lora_B.default.weight"] @ state[st + a] for st in stems
    }
    return args, model, weights


@needs("hf")
def test_lora_runs_merge_into_one_adapter_of_the_models_average(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Two LoRA runs of one tiny BERT (rank 2 at alpha 16; rank 4 at alpha 8 with rsLoRA) merged 1:3: one adapter
    of rank 6 at alpha 6, each adapted weight W0 + s' B' A' the weighted mean of the runs' W0 + s_i B_i A_i, every
    other trained tensor the weighted mean; through peft's own forward, the folder `evaluate` loads embeds as the base
    model with those weights; slerp and a run of another base are refused."""
    import shutil

    from tests.hf_folders import encoder_folder
    from tests.test_hf_text import folder_run
    from titan_contrastive import evaluate
    from titan_contrastive.models.bi_encoder import build_tokenizer

    encoder_folder(tmp_path / "a")
    shutil.copytree(tmp_path / "a" / "tiny-bert", tmp_path / "b" / "tiny-bert")  # one base, two folders
    steps = []
    for name, flags in (
        ("a", ["--lora.rank=2", "--lora.alpha=16"]),
        ("b", ["--lora.rank=4", "--lora.use_rslora=true"]),
    ):
        trainer = folder_run(
            tmp_path / name, "encoder", "--lora.enable=true", "--lora.alpha=8", *flags, "--optimizer.lr=1e-2",
            "--training.local_batch_size=6", "--training.steps=1", "--checkpoint.enable=true",
        )  # fmt: skip
        trainer.train()
        trainer.metrics.close()
        steps.append(tmp_path / name / "run-encoder" / "checkpoint" / "step-1")
    out = tmp_path / "soup"
    assert run(capsys, *steps, "--out", out, "--weights", "1,3") == (0, "")

    (args_a, model_a, wa), (_, model_b, wb), (args, soup, got) = (_effective(f) for f in (*steps, out))
    assert (args.lora_rank, args.lora_alpha, args.lora_rslora) == (6, 6.0, False)
    assert got.keys() == wa.keys() and wa
    for stem in wa:
        want = (wa[stem] + 3 * wb[stem]) / 4
        assert (got[stem] - want).abs().max() <= 1e-6 * want.abs().max(), stem
    trained = {n for n, p in model_a.named_parameters() if p.requires_grad and "lora_" not in n}
    sa, sb, sm = (m.state_dict() for m in (model_a, model_b, soup))
    for name in trained:
        assert torch.allclose(sm[name].double(), (sa[name].double() + 3 * sb[name].double()) / 4, rtol=1e-6), name

    reference = model_a.eval()  # the base with the averaged weights, its adapters zeroed
    with torch.no_grad():
        for name, p in reference.named_parameters():
            stem = name[: -len("base_layer.weight")]
            if stem in wa:
                p.copy_((wa[stem] + 3 * wb[stem]) / 4)
            elif "lora_B" in name:
                p.zero_()
            elif name in trained:
                p.copy_(sm[name])
    loaded_args, loaded = evaluate.load_text_model(str(out), 0, 0)
    ids = build_tokenizer(loaded_args).encode_queries(["the capital of France", "zebra"], loaded_args.query_length)
    with torch.no_grad():
        assert (loaded.embed_side("query", ids) - reference.embed_side("query", ids)).abs().max() <= 1e-5

    from titan_contrastive import export

    assert export.main([str(out), "--to", "peft", "--out", str(tmp_path / "adapter")]) == 0  # reloaded and checked

    shutil.copytree(tmp_path / "a" / "tiny-bert", tmp_path / "d" / "tiny-bert")
    for name, flags in (("c", []), ("d", ["--lora.modules_to_save", "word_embeddings"])):  # another base; more trained
        trainer = folder_run(
            tmp_path / name, "encoder", "--lora.enable=true", "--training.local_batch_size=6", "--training.steps=1",
            "--checkpoint.enable=true", *flags,
        )  # fmt: skip
        trainer.train()
        trainer.metrics.close()
    other, more = (tmp_path / name / "run-encoder" / "checkpoint" / "step-1" for name in "cd")
    for argv, message in [
        ([*steps, "--out", tmp_path / "x", "--method", "slerp"], "the slerp of two models is no adapter"),
        ([steps[0], other, "--out", tmp_path / "x"], "frozen base weights"),
        ([steps[0], more, "--out", tmp_path / "x"], "trained in some runs and frozen in others"),
    ]:
        code, err = run(capsys, *argv)
        assert code == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "x").exists()


@pytest.mark.slow  # ~19 s: two clip runs; the text and hf_clip runs check --with-start in the default suite
def test_with_start_a_clip_run_merges_with_the_checkpoint_it_started_from(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """WiSE-FT on clip: a run from `init_from` (another run's step folder) merged with its start gives every weight
    as the weighted mean, or the slerp, of what the trainer held before its first step and after its last; a run
    from random weights, and runs of two starts, are refused in one line."""
    from tests.test_trainer import make_trainer

    def trained(dump: Path, *flags: str) -> tuple[Path, dict[str, torch.Tensor]]:
        trainer = make_trainer(str(dump), "--training.steps=1", "--checkpoint.enable=true", *flags)
        start = {k: v.detach().double().clone() for k, v in trainer.model.state_dict().items()}
        trainer.train()
        trainer.metrics.close()
        return dump / "checkpoint" / "step-1", start

    pre, _ = trained(tmp_path / "pretrain")
    step, start = trained(tmp_path / "run", f"--model.init_from={pre}", "--optimizer.lr=1e-2")
    fine = weights_of(step)
    assert fine.keys() == start.keys() and any(not torch.allclose(fine[k], start[k], atol=1e-4) for k in fine)
    out = tmp_path / "wise"
    assert run(capsys, step, "--with-start", "--weights", "1,3", "--out", out) == (0, "")
    assert_close(weights_of(out), {k: (start[k] + 3 * fine[k]) / 4 for k in fine})
    record = json.loads((out / "manifest.json").read_text())["merged"]
    assert record["start"] == str(pre) and record["weights"] == [1.0, 3.0]
    slerped = tmp_path / "slerp"
    assert run(capsys, step, "--with-start", "--method", "slerp", "--t", "0.75", "--out", slerped) == (0, "")
    assert_close(weights_of(slerped), {k: defined_slerp(start[k], fine[k], 0.75) for k in fine})

    for argv, message in [
        ([pre], f"--with-start: .* of {pre}'s model start at random"),
        ([step, pre], f"STEP={pre} started from 'random weights' and {step} from '{pre}'"),
    ]:
        code, err = run(capsys, *argv, "--with-start", "--out", tmp_path / "x")
        assert code == 2 and err.count("\n") == 1 and re.search(message, err), err
    assert not (tmp_path / "x").exists()


@needs("hf")
def test_with_start_text_runs_merge_with_the_folder_they_started_from(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """WiSE-FT on a bi_encoder (the tiny BERT folder): a full fine-tune merged with its start is the mean of the
    trainer's weights before and after; a LoRA run's is one adapter of the run's rank (the start's zero adapter left
    out) whose adapted weights are (W0 + 3 (W0 + s B A)) / 4, W0 the trainer's before its first step."""
    from tests.test_hf_text import folder_run

    def trained(name: str, *flags: str) -> tuple[Path, dict[str, torch.Tensor], str]:
        trainer = folder_run(
            tmp_path / name, "encoder", "--training.local_batch_size=6", "--training.steps=1",
            "--checkpoint.enable=true", "--optimizer.lr=1e-2", *flags,
        )  # fmt: skip
        start = {k: v.detach().double().clone() for k, v in trainer.model.state_dict().items()}
        trainer.train()
        trainer.metrics.close()
        return tmp_path / name / "run-encoder" / "checkpoint" / "step-1", start, trainer.cfg.model.path

    step, start, folder = trained("full")
    fine, out = weights_of(step), tmp_path / "wise"
    assert run(capsys, step, "--with-start", "--out", out) == (0, "")
    assert_close(weights_of(out), {k: (start[k] + fine[k]) / 2 for k in fine})
    assert json.loads((out / "manifest.json").read_text())["merged"]["start"] == folder

    lora, lora_start, _ = trained("lora", "--lora.enable=true", "--lora.rank=2", "--lora.alpha=16")
    out = tmp_path / "wise-lora"
    assert run(capsys, lora, "--with-start", "--weights", "1,3", "--out", out) == (0, "")
    (_, run_model, adapted), (args, merged_model, got) = _effective(lora), _effective(out)
    assert (args.lora_rank, args.lora_alpha) == (2, 2.0) and adapted
    for stem, w in adapted.items():
        want = (lora_start[stem + "base_layer.weight"] + 3 * w) / 4
        assert (got[stem] - want).abs().max() <= 1e-6 * want.abs().max(), stem
    trained_names = [n for n, p in run_model.named_parameters() if p.requires_grad and "lora_" not in n]
    ran, soup = run_model.state_dict(), merged_model.state_dict()
    assert trained_names
    for name in trained_names:
        want = (lora_start[name] + 3 * ran[name].double()) / 4
        assert torch.allclose(soup[name].double(), want, rtol=1e-6), name


@needs("hf")
def test_with_start_an_hf_clip_run_merges_with_its_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """WiSE-FT as its paper does it, on an image-text model: a SigLIP fine-tune (the tiny folder, its scale and bias
    trained) merged 1:1 with the folder it started from is the mean of the trainer's weights before and after."""
    from tests.test_hf_clip import clip_run

    trainer = clip_run(
        tmp_path, "siglip", "--training.local_batch_size=4", "--training.steps=1", "--checkpoint.enable=true",
        "--optimizer.lr=1e-2",
    )  # fmt: skip
    start = {k: v.detach().double().clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    trainer.metrics.close()
    step = tmp_path / "run-siglip" / "checkpoint" / "step-1"
    fine, out = weights_of(step), tmp_path / "wise"
    assert any(not torch.allclose(fine[k], start[k], atol=1e-4) for k in fine)
    assert run(capsys, step, "--with-start", "--out", out) == (0, "")
    assert_close(weights_of(out), {k: (start[k] + fine[k]) / 2 for k in fine})
