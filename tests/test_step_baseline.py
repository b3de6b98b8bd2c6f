"""Behaviour pinned across refactors: every train-step kind, float64 on CPU, on 1 and 2 processes,
ends with the losses and final parameters recorded in `tests/fixtures/step_kinds.json`.

The fixture was recorded with the trainer as it was before the step protocol (four step paths
chosen by flags inside one train step), so this test is the proof that the restructuring changed
no arithmetic beyond rounding. Another CPU's BLAS kernels and thread splits may sum in another
order, so the check is the documented float64 bound: relative error <= 1e-10 on every logged loss
and on each parameter's sum and norm, never a bitwise comparison (which holds only on the machine
the fixture was recorded on).

Re-record (only when a change is *meant* to change the numbers, and say so in the commit):
    python -m tests.test_step_baseline --record
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from tests.dist_utils import run_distributed

FIXTURE = Path(__file__).parent / "fixtures" / "step_kinds.json"
REL = 1e-10
COMMON = [
    "--training.dtype=float64",
    "--training.max_norm=0.5",
    "--training.steps=3",
    "--metrics.log_freq=1",
    "--metrics.enable_tensorboard=false",
    "--eval.enable=false",
    "--lr_scheduler.warmup_steps=1",
]
DDP = ["--parallelism.data_parallel_replicate_degree=-1", "--parallelism.data_parallel_shard_degree=1"]
VAE = ["--model.name=vae", "--data.dataset=emoji", "--data.image_sizes=16,24,32"]
VLM = ["--model.name=vlm", "--data.dataset=emoji", "--data.image_sizes=16,24,32"]


def cases(world: int) -> dict[str, list[str]]:
    """Step kind -> config; batch sizes per rank that chunk sizes do not divide."""

    def batch(local: int, ga: int) -> list[str]:
        return [f"--training.local_batch_size={local}", f"--training.global_batch_size={local * ga * world}"]

    return {
        "accumulate": batch(4, 2),
        "accumulate_ddp": [*batch(4, 2), *DDP],
        "gradcache": [*batch(5, 2), "--gradcache.enabled=true", "--gradcache.chunk_sizes=3"],
        "gradcache_ddp": [*batch(5, 2), "--gradcache.enabled=true", "--gradcache.chunk_sizes=3", *DDP],
        "gradcache_vlm": [*VLM, *batch(5, 2), "--gradcache.enabled=true", "--gradcache.chunk_sizes=3"],
        "global": [*batch(4, 2), "--loss.negatives=global", "--loss.stream_chunk_size=3"],
        "global_gradcache_ddp": [
            *batch(5, 2),
            "--loss.negatives=global",
            "--loss.stream_chunk_size=7",
            "--gradcache.enabled=true",
            "--gradcache.chunk_sizes=3",
            *DDP,
        ],
        "pixel": [*VAE, *batch(3, 2), *DDP],
        "pixel_chunked": [
            *VAE,
            *batch(3, 2),
            "--pixel_loss.mode=chunked",
            "--pixel_loss.adaptive=false",
            "--pixel_loss.chunk_size=2",
        ],
    }


def platform() -> str:
    return f"torch {torch.__version__}, cpu {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores"


def _fingerprint(params: dict[str, torch.Tensor]) -> dict:
    return {"fingerprint": {n: [p.double().sum().item(), p.double().norm().item()] for n, p in sorted(params.items())}}


def _train(out: str, world: int) -> None:
    """Train every case on this process group (or alone); rank 0 writes the results as JSON."""
    from titan_contrastive.config import parse_args
    from titan_contrastive.train import Trainer

    results = {}
    rank = int(os.environ.get("RANK", "0"))  # the trainer joins the process group
    for name, extra in cases(world).items():
        dump = Path(out) / f"{name}_w{world}"
        trainer = Trainer(parse_args([*COMMON, f"--job.dump_folder={dump}", *extra]))
        trainer.train()
        params = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        trainer.metrics.close()
        if rank == 0:
            losses = [json.loads(line)["loss"] for line in (dump / "metrics.jsonl").read_text().splitlines()]
            results[name] = {"losses": losses, **_fingerprint(params)}
        del trainer
    if rank == 0:
        (Path(out) / f"results_w{world}.json").write_text(json.dumps(results))


def run(tmp: Path, world: int) -> dict:
    if world == 1:
        _train(str(tmp), 1)
    else:
        run_distributed(_train, world, str(tmp), world)
    return json.loads((tmp / f"results_w{world}.json").read_text())


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])  # 2: ~12 s, slow
def test_step_kinds_reproduce_the_recorded_run(tmp_path: Path, world: int) -> None:
    fixture = json.loads(FIXTURE.read_text())
    want, got = fixture[f"world{world}"], run(tmp_path, world)
    assert got.keys() == want.keys()
    problems = []
    for name in want:
        w, g = want[name], got[name]
        assert len(g["losses"]) == len(w["losses"]) == 3, name
        for a, b in zip(g["losses"], w["losses"]):
            if not abs(a - b) <= REL * abs(b):
                problems.append(f"{name}: loss {a} vs recorded {b}")
        assert g["fingerprint"].keys() == w["fingerprint"].keys(), name
        for param, (s, n) in g["fingerprint"].items():
            ws, wn = w["fingerprint"][param]
            if not (abs(n - wn) <= REL * wn and abs(s - ws) <= REL * max(wn, 1e-300)):
                problems.append(f"{name}: {param} sum/norm {s}/{n} vs recorded {ws}/{wn}")
    assert not problems, "\n".join(problems)


def record() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        data = {"platform": platform(), "world1": run(Path(tmp) / "w1", 1), "world2": run(Path(tmp) / "w2", 2)}
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(data, indent=1) + "\n")
    print(f"recorded {FIXTURE} on {data['platform']}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python -m tests.test_step_baseline --record")
    record()
