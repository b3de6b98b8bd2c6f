"""`python -m titan_contrastive.export`: where it may write, and that what it writes computes what the source does.

Sources are step folders written by the real `CheckpointManager` from tiny random clip models
(float32, non-trivial norms): one as the default config trains it (byte tokenizer, EOS 2,
1-channel images) and one with CLIP's BPE and 1 channel.

- Faithful: the byte-tokenizer 1-channel model exports to open_clip (pooling at the first EOS and
  the channel count recorded) and reloads with our embeddings within 1e-5 and its weights
  bit-identical; its hf export is refused in one line (transformers cannot pool at the first id 2)
  and leaves nothing; a 1-channel CLIP-BPE model exports to hf and transformers reproduces it.
- Safe: `--out` naming `..`, a foreign non-empty folder, a run folder, the source, a folder holding
  the source or the working directory, or a file is refused in one line (exit 2) before any weight
  is read, even with `--overwrite`, and everything there stays byte-identical; an empty folder is
  used; `--overwrite` replaces a previous export but not one holding other files; an export that
  fails its reload check (forced) leaves the previous export as it was and no temporary folder.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tests.needs import require

require("hf")

import transformers  # noqa: E402

from titan_contrastive import export as export_module  # noqa: E402
from titan_contrastive.checkpoint import CheckpointManager, ModelState  # noqa: E402
from titan_contrastive.config.job_config import Checkpoint  # noqa: E402
from titan_contrastive.datasets.clip_bpe import ClipBpeTokenizer  # noqa: E402
from titan_contrastive.datasets.tokenizer import ByteTokenizer  # noqa: E402
from titan_contrastive.models import export_check  # noqa: E402
from titan_contrastive.models.bi_encoder import export as bi_encoder_export  # noqa: E402
from titan_contrastive.models.clip import load_clip, read_checkpoint, state_dict_adapter  # noqa: E402
from titan_contrastive.models.clip.args import CLIPArgs  # noqa: E402
from titan_contrastive.models.clip.model import CLIP  # noqa: E402

# the debug flavor's shape, smaller: Fashion-MNIST-like 1-channel images, byte tokens (EOS 2)
BYTE = CLIPArgs(
    embed_dim=16,
    image_size=8,
    patch_size=4,
    in_channels=1,
    vision_width=32,
    vision_layers=1,
    vision_heads=4,
    vocab_size=ByteTokenizer.vocab_size,
    context_length=40,
    text_width=32,
    text_layers=1,
    text_heads=4,
    eos_id=2,
)
BPE = dataclasses.replace(BYTE, vocab_size=49408, context_length=20, eos_id=49407)
RGB = dataclasses.replace(BYTE, in_channels=3)
TEXTS = ["a photo of a cat", "zebra", "Two dogs, playing in the snow at night!"]


def step_folder(dump: Path, args: CLIPArgs = BYTE, seed: int = 0, run_config: dict | None = None) -> tuple[Path, CLIP]:
    """step-1 of a run folder holding `args`' model started from `seed` (and `run_config` in its manifest), written
    as training writes it, and the model."""
    torch.manual_seed(seed)
    model = CLIP(args)
    with torch.no_grad():  # non-trivial norms and scale, so a mapping mistake cannot hide behind ones and zeros
        for name, p in model.named_parameters():
            if "ln" in name or name == "logit_scale":
                p.add_(torch.rand_like(p) * 0.5)
    cfg = Checkpoint(enable=True, folder="checkpoint", interval=1, keep_latest_k=0)
    CheckpointManager(
        cfg,
        dump_folder=str(dump),
        states={"model": ModelState(model)},
        per_rank_states={},
        rank=0,
        dp_rank=0,
        dp_degree=1,
        model_info={"family": "clip", "args": dataclasses.asdict(args)},
        run_config=run_config,
    ).save(1)
    (dump / "metrics.jsonl").write_text('{"step": 1}\n')
    return dump / "checkpoint" / "step-1", model.eval()


def run_export(
    capsys: pytest.CaptureFixture, src: Path, to: str, out: Path | str, *extra: str
) -> tuple[int, list[str]]:
    capsys.readouterr()  # what ran before (transformers' progress bars) is not the export's
    code = export_module.main([str(src), "--to", to, "--out", str(out), *extra])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` with its bytes (None for folders)."""
    return {p.relative_to(folder).as_posix(): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))}


def leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def images_for(args: CLIPArgs) -> torch.Tensor:
    return torch.randn(
        4, args.in_channels, args.image_size, args.image_size, generator=torch.Generator().manual_seed(5)
    )


def test_byte_tokenizer_one_channel_model_exports_to_open_clip_faithfully(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Before: exit 0, but the reload pooled at the highest id (0.4 off) and a 1-channel patch
    kernel could not load (the config said 3 channels)."""
    step, ours = step_folder(tmp_path / "run")
    assert run_export(capsys, step, "open_clip", tmp_path / "oc") == (0, [])
    config = json.loads((tmp_path / "oc" / "open_clip_config.json").read_text())
    assert config["model_cfg"]["text_cfg"]["pool_type"] == "eos" and config["model_cfg"]["text_cfg"]["eos_id"] == 2
    assert config["titan_contrastive"] == {"in_channels": 1}
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "oc" / "open_clip_model.safetensors"))["visual.conv1.weight"].shape == (32, 3, 4, 4)
    args, state = read_checkpoint(tmp_path / "oc")
    assert (args.in_channels, args.eos_id) == (1, 2)
    # the 3-channel kernel folds back exactly
    assert all(torch.equal(state[k], v) for k, v in ours.state_dict().items())
    reloaded, ids, images = load_clip(tmp_path / "oc"), ByteTokenizer(40).encode(TEXTS), images_for(BYTE)
    with torch.no_grad():
        assert (reloaded.encode_text(ids) - ours.encode_text(ids)).abs().max() <= 1e-5
        assert (reloaded.encode_image(images) - ours.encode_image(images)).abs().max() <= 1e-5
    marker = json.loads((tmp_path / "oc" / export_module.MARKER).read_text())
    assert marker["format"] == "open_clip" and marker["source"] == str(step.resolve())
    assert (
        marker["files"] == ["README.md", "open_clip_config.json", "open_clip_model.safetensors"]
        and leftovers(tmp_path) == []
    )


def test_byte_tokenizer_model_to_hf_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """transformers reads eos_token_id 2 as its legacy argmax rule: such an export changed the text
    embeddings with exit 0 before; now one line names why, and nothing is written. `--layers` (a bi_encoder's cut)
    is refused the same way."""
    step, _ = step_folder(tmp_path / "run")
    code, err = run_export(capsys, step, "hf", tmp_path / "hf")
    assert code == 2 and len(err) == 1 and "token id 2" in err[0] and "--to open_clip" in err[0], err
    assert not (tmp_path / "hf").exists() and leftovers(tmp_path) == []
    code, err = run_export(capsys, step, "open_clip", tmp_path / "cut", "--layers", "2")  # a bi_encoder's option
    assert code == 2 and len(err) == 1 and "--layers 2: cuts a bi_encoder run trained with" in err[0], err
    assert not (tmp_path / "cut").exists() and leftovers(tmp_path) == []


def test_one_channel_clip_bpe_model_to_hf_and_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """transformers reproduces a 1-channel CLIP-BPE model's export; exporting again needs --overwrite,
    which replaces the previous export (before: no --overwrite, and the folder was deleted silently)."""
    step, ours = step_folder(tmp_path / "run", BPE)
    out = tmp_path / "hf"
    assert run_export(capsys, step, "hf", out)[0] == 0
    theirs = transformers.CLIPModel.from_pretrained(str(out)).eval()
    ids, images = ClipBpeTokenizer(20).encode(TEXTS), images_for(BPE)
    with torch.no_grad():
        img, txt = (
            getattr(x, "pooler_output", x)
            for x in (theirs.get_image_features(pixel_values=images), theirs.get_text_features(input_ids=ids))
        )
        assert (torch.nn.functional.normalize(img, dim=-1) - ours.encode_image(images)).abs().max() <= 1e-5
        assert (torch.nn.functional.normalize(txt, dim=-1) - ours.encode_text(ids)).abs().max() <= 1e-5
    code, err = run_export(capsys, step, "hf", out)
    assert code == 2 and len(err) == 1 and "pass --overwrite" in err[0], err
    (out / "config.json").write_text("{}")  # an export's own file may differ: it is replaced
    assert run_export(capsys, step, "hf", out, "--overwrite")[0] == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "clip" and leftovers(tmp_path) == []


RUN_MARKS = {
    "run_metrics": "metrics.jsonl",
    "run_tb": "tb/events.out",
    "run_lock": ".titan_contrastive.lock",
    "run_checkpoints": "ckpt/step-3/manifest.json",
    "step_folder": "manifest.json",
}


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize(
    "case", ["dotdot", "cwd", "foreign", "source", "source_ancestor", "file", "export_with_extra", *RUN_MARKS]
)
def test_refused_out_is_left_byte_identical(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, case: str, overwrite: bool
) -> None:
    """Before: each of these was `shutil.rmtree`d with exit 0 (`..` from a subfolder took the whole
    project). Now one line, exit 2, nothing read and nothing changed, even with --overwrite."""
    step, _ = step_folder(tmp_path / "run", RGB)
    (tmp_path / "proj" / "sub").mkdir(parents=True)
    (tmp_path / "proj" / "notes.txt").write_text("mine")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "data.csv").write_text("a,b\n")
    (tmp_path / "a.txt").write_text("a file")
    if case in RUN_MARKS:  # a folder marked as (part of) a run by that one entry, beside a file of the user's
        (tmp_path / "runs" / RUN_MARKS[case]).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "runs" / RUN_MARKS[case]).write_text("{}")
        (tmp_path / "runs" / "config.toml").write_text("")
    if case == "export_with_extra":  # a previous export the user has since put a file into
        assert run_export(capsys, step, "open_clip", tmp_path / "other" / "oc")[0] == 0
        (tmp_path / "other" / "oc" / "keep.txt").write_text("keep")
    out, expect = {
        "dotdot": ("..", "working directory"),
        "cwd": (".", "working directory"),
        "foreign": (tmp_path / "other", "did not write" if overwrite else "not empty"),
        "source": (step, "is the source"),
        "source_ancestor": (tmp_path / "run" / "checkpoint", "or holds it"),
        "file": (tmp_path / "a.txt", "is a file"),
        "export_with_extra": (tmp_path / "other" / "oc", "keep.txt" if overwrite else "holds a previous export"),
    }.get(case, (tmp_path / "runs", "run or checkpoint folder"))
    monkeypatch.chdir(tmp_path / "proj" / "sub")
    before = snapshot(tmp_path)

    def no_reading(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights were read before --out was checked")

    monkeypatch.setattr(state_dict_adapter, "read_checkpoint", no_reading)
    monkeypatch.setattr(bi_encoder_export, "read_ours", no_reading)
    monkeypatch.setattr(state_dict_adapter, "read_ours", no_reading)
    code, err = run_export(capsys, step, "open_clip", out, *(["--overwrite"] if overwrite else []))
    assert code == 2 and len(err) == 1 and expect in err[0], err
    assert snapshot(tmp_path) == before


def test_empty_folder_is_used_and_failed_export_keeps_the_previous_one(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model that does not reload to its own embeddings (a corrupted write, or a zero tolerance) is
    refused in one line naming the tower; the previous export stays and no temporary folder does."""
    from titan_contrastive.models.clip import openclip

    step, _ = step_folder(tmp_path / "run", RGB)
    out = tmp_path / "exports" / "oc"
    out.mkdir(parents=True)
    assert run_export(capsys, step, "open_clip", out) == (0, [])
    before = snapshot(tmp_path / "exports")

    original = openclip.to_open_clip_state_dict

    def corrupted(state: dict[str, torch.Tensor], **kwargs: bool) -> dict[str, torch.Tensor]:
        written = original(state, **kwargs)
        return {**written, "text_projection": written["text_projection"] * 1.5 + 0.01}

    monkeypatch.setattr(openclip, "to_open_clip_state_dict", corrupted)
    code, err = run_export(capsys, step, "open_clip", out, "--overwrite")
    assert code == 2 and len(err) == 1 and "the text embeddings differ from the source's by up to" in err[0], err
    assert snapshot(tmp_path / "exports") == before
    monkeypatch.undo()
    monkeypatch.setattr(export_check, "TOLERANCE", -1.0)
    code, err = run_export(capsys, step, "open_clip", tmp_path / "exports" / "deep" / "new")
    assert code == 2 and len(err) == 1 and "the image embeddings differ" in err[0], err
    assert snapshot(tmp_path / "exports") == before  # no `deep/new`, no `.new.tmp-*`, no `deep`
