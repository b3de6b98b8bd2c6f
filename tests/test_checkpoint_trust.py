"""Reading a checkpoint runs no code from it and uses nothing corrupted (`checkpoint/reader.py`).

A tiny clip-family checkpoint is written by the real `CheckpointManager`, then made hostile: a
`.metadata`, a per-rank state or a byte item that is a pickle running code when loaded (it
creates a marker file, then returns the real value, so the old readers loaded it and exited 0).
Each is refused with one line, marker absent, on every path that reads it: resume
(`CheckpointManager.load`), init_from (`models.clip.read_checkpoint`), export (`export.main`, exit 2)
and `models.weights.read_ours`. Corrupted or unverifiable folders and damaged weight files are one-line
errors on those paths too.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from titan_contrastive.checkpoint import MANIFEST, CheckpointError, CheckpointManager, ModelState, RNGState, TrainState
from titan_contrastive.checkpoint.reader import sha256, unpickle_state
from titan_contrastive.config.job_config import Checkpoint
from titan_contrastive.export import main as export_main
from titan_contrastive.models.clip import read_checkpoint
from titan_contrastive.models.clip.args import CLIPArgs
from titan_contrastive.models.clip.model import CLIP
from titan_contrastive.models.weights import WeightsError, load_state, read_ours

ARGS = CLIPArgs(
    embed_dim=8,
    image_size=8,
    patch_size=4,
    in_channels=3,
    vision_width=16,
    vision_layers=1,
    vision_heads=2,
    vocab_size=32,
    context_length=6,
    text_width=16,
    text_layers=1,
    text_heads=2,
)


class Payload:
    """Unpickles to `obj` after creating `marker`: a crafted pickle could run any code there."""

    def __init__(self, obj: Any, marker: Path) -> None:
        self.obj, self.marker = obj, marker

    def __reduce__(self) -> tuple[Any, ...]:
        return eval, (f"(open({str(self.marker)!r}, 'w').close(), obj)[1]", {"obj": self.obj})


class Fixed:
    """A Stateful that saves the state dict it is given (and takes whatever it loads)."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


def manager(dump: Path, model: Any, train_state: Any, rng: Any) -> CheckpointManager:
    cfg = Checkpoint(enable=True, folder="ckpt", interval=1, keep_latest_k=0)
    return CheckpointManager(
        cfg,
        dump_folder=str(dump),
        states={"model": model, "train_state": train_state},
        per_rank_states={"rng": rng},
        rank=0,
        dp_rank=0,
        dp_degree=1,
        model_info={"family": "clip", "args": dataclasses.asdict(ARGS)},
    )


def clip_step(dump: Path, *, model: Any = None, train_state: Any = None, rng: Any = None) -> tuple[Path, CLIP]:
    """Checkpoint step-1 of a tiny CLIP written by the manager (pieces replaceable), and the model."""
    torch.manual_seed(0)
    clip = CLIP(ARGS)
    manager(dump, model or ModelState(clip), train_state or TrainState(step=1), rng or RNGState("cpu")).save(1)
    return dump / "ckpt" / "step-1", clip


def resume(dump: Path) -> int | None:
    """What a resumed run does: a fresh model and states, `CheckpointManager.load()`."""
    return manager(dump, ModelState(CLIP(ARGS)), TrainState(), RNGState("cpu")).load()


def rehash(step: Path) -> None:
    """Recompute the manifest, as whoever crafted the folder would."""
    manifest = json.loads((step / MANIFEST).read_text())
    manifest["files"] = {
        name: {"bytes": (step / name).stat().st_size, "sha256": sha256(step / name)} for name in manifest["files"]
    }
    (step / MANIFEST).write_text(json.dumps(manifest))


def export(step: Path, out: Path, capsys: pytest.CaptureFixture) -> tuple[int, list[str]]:
    """`export --to open_clip`'s exit code and its stderr lines."""
    code = export_main([str(step), "--to", "open_clip", "--out", str(out)])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def one_line(error: pytest.ExceptionInfo, *parts: str) -> str:
    message = str(error.value)
    assert "\n" not in message and all(part in message for part in parts), message
    return message


def test_malicious_metadata_runs_nothing_on_any_path(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    step, clip = clip_step(tmp_path)
    state = read_checkpoint(step)[1]  # the clean checkpoint reads on every path
    assert state.keys() == clip.state_dict().keys() and all(
        torch.equal(state[k], v) for k, v in clip.state_dict().items()
    )
    assert resume(tmp_path) == 1 and read_ours(step)[0] == "clip"
    assert export(step, tmp_path / "clean", capsys)[0] == 0

    marker = tmp_path / "ran"
    meta = step / ".metadata"
    meta.write_bytes(pickle.dumps(Payload(pickle.loads(meta.read_bytes()), marker)))
    rehash(step)
    with pytest.raises(CheckpointError) as error:
        resume(tmp_path)
    one_line(error, "loading checkpoint step-1", ".metadata: refused to unpickle", "builtins.eval")
    for read in (read_checkpoint, read_ours):
        with pytest.raises(WeightsError) as error:
            read(step)
        one_line(error, ".metadata: refused to unpickle", "builtins.eval")
    code, err = export(step, tmp_path / "out", capsys)
    assert code == 2 and len(err) == 1 and "refused to unpickle" in err[0], err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_malicious_per_rank_state_is_refused_on_resume(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    marker = tmp_path / "ran"
    rng = RNGState("cpu")
    step, clip = clip_step(tmp_path, rng=Fixed(Payload(rng.state_dict(), marker)))
    with pytest.raises(CheckpointError) as error:
        resume(tmp_path)
    one_line(error, "loading checkpoint step-1", "'rng/dp_rank_0.pickle': refused to unpickle", "builtins.eval")
    # the weights-only readers never unpickle per-rank states
    assert torch.equal(read_checkpoint(step)[1]["logit_scale"], clip.logit_scale.detach())
    assert export(step, tmp_path / "out", capsys)[0] == 0
    assert not marker.exists()


def test_malicious_byte_item_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A byte item (DCP's torch.save of a non-tensor value): a counter, read on resume; a model entry,
    read by every path (where the model has a tensor, it is refused before anything is read)."""
    marker = tmp_path / "ran"
    clip_step(tmp_path / "a", train_state=Fixed({"step": Payload(1, marker), "samples_seen": 0, "skipped_steps": 0}))
    with pytest.raises(CheckpointError) as error:
        resume(tmp_path / "a")
    one_line(error, "checkpoint item 'train_state.step': refused to unpickle", "eval")

    torch.manual_seed(0)
    weights = CLIP(ARGS).state_dict()
    step, _ = clip_step(
        tmp_path / "b", model=Fixed({**weights, "logit_scale": Payload(weights["logit_scale"], marker)})
    )
    with pytest.raises(CheckpointError) as error:
        resume(tmp_path / "b")
    one_line(error, "checkpoint item 'model.logit_scale' is a pickled object where a tensor is expected")
    for read in (read_checkpoint, read_ours):
        with pytest.raises(WeightsError) as error:
            read(step)
        one_line(error, "'model.logit_scale' is a pickled object")
    code, err = export(step, tmp_path / "out", capsys)
    assert code == 2 and len(err) == 1 and "model.logit_scale" in err[0], err
    assert not marker.exists()


def _flip(step: Path) -> None:
    data = step / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    for i in range(len(raw) // 2, len(raw) // 2 + 8):
        raw[i] ^= 0xFF
    data.write_bytes(bytes(raw))


def _truncate(step: Path) -> None:
    data = step / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (_flip, "__0_0.distcp: its content does not match the sha256"),
        (_truncate, "__0_0.distcp has"),
        (lambda step: (step / ".metadata").unlink(), ".metadata is missing"),
    ],
)
def test_corrupted_checkpoint_is_refused_on_init_from_and_export(
    tmp_path: Path, capsys: pytest.CaptureFixture, damage: Any, problem: str
) -> None:
    step, _ = clip_step(tmp_path)
    damage(step)
    for read in (read_checkpoint, read_ours):
        with pytest.raises(WeightsError) as error:
            read(step)
        one_line(error, f"checkpoint {step} is corrupt", problem)
    code, err = export(step, tmp_path / "out", capsys)
    assert code == 2 and len(err) == 1 and problem in err[0], err


def test_dcp_folder_without_manifest_cannot_be_verified(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    step, _ = clip_step(tmp_path)
    (step / MANIFEST).unlink()
    with pytest.raises(WeightsError) as error:
        read_checkpoint(step)
    one_line(error, f"{step}: DCP checkpoint files without {MANIFEST}, so they cannot be verified")
    code, err = export(step, tmp_path / "out", capsys)
    assert code == 2 and len(err) == 1 and "cannot be verified" in err[0], err


def test_manifest_with_sizes_only_loads_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    step, clip = clip_step(tmp_path)
    manifest = json.loads((step / MANIFEST).read_text())
    manifest["files"] = {name: entry["bytes"] for name, entry in manifest["files"].items()}
    (step / MANIFEST).write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="titan_contrastive"):
        state = read_checkpoint(step)[1]
    assert torch.equal(state["logit_scale"], clip.logit_scale.detach())
    assert (
        f"checkpoint {step}: {MANIFEST} has sizes but no sha256" in caplog.text
        and "content is unverified" in caplog.text
    )


def _open_clip_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> Path:
    step, _ = clip_step(tmp_path)
    assert export(step, tmp_path / "oc", capsys)[0] == 0
    return tmp_path / "oc"


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda raw: b"", "an empty file (0 bytes)"),
        (lambda raw: b"\x07garbage" * 20, "not a readable safetensors file"),
        (lambda raw: raw[:-64], "not a readable safetensors file"),
    ],
)
def test_damaged_safetensors_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, damage: Any, problem: str
) -> None:
    weights = _open_clip_folder(tmp_path, capsys) / "open_clip_model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    for path in (weights.parent, weights):  # the folder, and the file alone (init_from takes both)
        with pytest.raises(WeightsError) as error:
            read_checkpoint(path)
        one_line(error, f"{weights}: {problem}")
    code, err = export(weights.parent, tmp_path / "out", capsys)
    assert code == 2 and len(err) == 1 and problem in err[0], err


def test_integer_weights_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from safetensors.torch import load_file, save_file

    weights = _open_clip_folder(tmp_path, capsys) / "open_clip_model.safetensors"
    state = load_file(str(weights))
    save_file({**state, "visual.proj": state["visual.proj"].to(torch.int32)}, str(weights))
    with pytest.raises(WeightsError) as error:
        read_checkpoint(weights.parent)
    one_line(error, f"{weights}: visual.proj is torch.int32")
    code, err = export(weights.parent, tmp_path / "out", capsys)
    assert code == 2 and len(err) == 1 and "visual.proj is torch.int32" in err[0], err

    model = CLIP(ARGS)  # init_from's last step, for readers of other families
    with pytest.raises(WeightsError) as error:
        load_state(
            model, {k: v.to(torch.int32) if k == "visual.proj" else v for k, v in model.state_dict().items()}, "src"
        )
    one_line(error, "src: visual.proj is torch.int32")

    torch.manual_seed(0)  # one of our checkpoints with an integer tensor where the model has a float one
    ints = {k: v.to(torch.int32) if k == "visual.proj" else v for k, v in CLIP(ARGS).state_dict().items()}
    step, _ = clip_step(tmp_path / "ours", model=Fixed(ints))
    with pytest.raises(WeightsError) as error:
        read_checkpoint(step)
    one_line(error, "'model.visual.proj' is torch.int32, the model's tensor is torch.float32")


def test_allowlist_reads_what_the_trainer_saves_and_nothing_else(tmp_path: Path) -> None:
    """The per-rank states (a StatefulDataLoader's, with workers too; RNG tensors) pass the
    allowlist; a global outside it does not, and never runs."""
    loader_state = {
        "epoch": 1,
        "dataloader": {
            "_snapshot": {
                "_snapshot_step": 3,
                "_main_snapshot": {
                    "_num_workers": 2,
                    "_sampler_iter_state": {"samples_yielded": 12, "sampler_state": {"epoch": 1, "yielded": 12}},
                    "_shared_seed": None,
                    "_base_seed": 883951781600517636,
                },
                "_worker_snapshots": {"worker_0": {"worker_id": 0, "dataset_state": None}},
            },
            "_iterator_finished": False,
        },
        "bad_samples": {"counts": {"decode": 2}, "seen": 12},
    }
    assert unpickle_state(pickle.dumps(loader_state), "loader") == loader_state
    # CUDA's arrives as a CPU uint8 tensor
    rng = {"cpu": torch.get_rng_state(), "cuda": torch.arange(16, dtype=torch.uint8)}
    got = unpickle_state(pickle.dumps(rng), "rng")
    assert got.keys() == rng.keys() and all(torch.equal(got[k], v) for k, v in rng.items())
    marker = tmp_path / "ran"
    with pytest.raises(CheckpointError) as error:
        unpickle_state(pickle.dumps({"x": Payload(1, marker)}), "item")
    one_line(error, "item: refused to unpickle: it names builtins.eval, which is not on the allowlist")
    assert not marker.exists()
