"""Behaviour pinned across refactors: every train-step kind, float64 on CPU, on 1 and 2 processes,
ends with the losses and final parameters recorded in `tests/fixtures/step_kinds.json`.

The fixture was recorded with the trainer as it was before the step protocol (commit 985e4e2,
four step paths chosen by flags inside `Trainer.train_step`), so this test is the proof that the
restructuring changed no arithmetic. Where the platform is the one the fixture was recorded on
(torch version, CPU kernel capability, core count: they pick the BLAS kernels and thread splits),
the check is bit-identical: every logged loss `==` and the SHA-256 of every parameter's bytes.
Elsewhere another CPU's kernels may sum in another order, so it is relative error <= 1e-10 on
the losses and on each parameter's sum and norm.

One known exception, in the last bits only: single-process GradCache (`LAST_BITS`). The old
trainer packed both towers and the scale into one [B, 2d+1] tensor, so the loss read the text
embeddings as a strided view of it; autograd's matmul backward picks its product order from the
operand's layout (`(a.T @ g).T` for that view, `g.T @ a` for the contiguous tensor the multi-output
GradCache hands the loss now), which changes the text gradients by ~1 ulp (5.6e-17). After 3
steps the losses differ by <= 2.6e-16 and the parameters' sums by <= 1.3e-13 relative to their
norms, so these cases are held to 1e-10, not to the bit. On 2 processes the loss all-gathers
contiguous copies either way, and every case, GradCache included, is bit-identical.

Re-record (only when a change is *meant* to change the numbers, and say so in the commit):
    python -m tests.test_step_baseline --record
"""

from __future__ import annotations

import hashlib
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
COMMON = ["--training.dtype=float64", "--training.max_norm=0.5", "--training.steps=3", "--metrics.log_freq=1",
          "--metrics.enable_tensorboard=false", "--eval.enable=false", "--lr_scheduler.warmup_steps=1"]
DDP = ["--parallelism.data_parallel_replicate_degree=-1", "--parallelism.data_parallel_shard_degree=1"]
VAE = ["--model.name=vae", "--data.dataset=emoji", "--data.image_sizes=16,24,32"]
VLM = ["--model.name=vlm", "--data.dataset=emoji", "--data.image_sizes=16,24,32"]
LAST_BITS = {("gradcache", 1), ("gradcache_ddp", 1), ("gradcache_vlm", 1)}  # see the module docstring


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
        "global_gradcache_ddp": [*batch(5, 2), "--loss.negatives=global", "--loss.stream_chunk_size=7",
                                 "--gradcache.enabled=true", "--gradcache.chunk_sizes=3", *DDP],
        "pixel": [*VAE, *batch(3, 2), *DDP],
        "pixel_chunked": [*VAE, *batch(3, 2), "--pixel_loss.mode=chunked", "--pixel_loss.adaptive=false",
                          "--pixel_loss.chunk_size=2"],
    }


def platform() -> str:
    return f"torch {torch.__version__}, cpu {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores"


def _digest(params: dict[str, torch.Tensor]) -> dict:
    sha = hashlib.sha256()
    for name in sorted(params):
        sha.update(name.encode())
        sha.update(params[name].detach().double().contiguous().numpy().tobytes())
    return {"sha256": sha.hexdigest(),
            "fingerprint": {n: [p.double().sum().item(), p.double().norm().item()] for n, p in sorted(params.items())}}


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
            results[name] = {"losses": losses, **_digest(params)}
        del trainer
    if rank == 0:
        (Path(out) / f"results_w{world}.json").write_text(json.dumps(results))


def run(tmp: Path, world: int) -> dict:
    if world == 1:
        _train(str(tmp), 1)
    else:
        run_distributed(_train, world, str(tmp), world)
    return json.loads((tmp / f"results_w{world}.json").read_text())


@pytest.mark.parametrize("world", [1, 2])
def test_step_kinds_reproduce_the_recorded_run(tmp_path: Path, world: int) -> None:
    fixture = json.loads(FIXTURE.read_text())
    want, got = fixture[f"world{world}"], run(tmp_path, world)
    assert got.keys() == want.keys()
    bitwise_platform = fixture["platform"] == platform()
    problems = []
    for name in want:
        w, g = want[name], got[name]
        assert len(g["losses"]) == len(w["losses"]) == 3, name
        bitwise = bitwise_platform and (name, world) not in LAST_BITS
        if bitwise and g["losses"] != w["losses"]:
            problems.append(f"{name}: losses {g['losses']} != recorded {w['losses']}")
        if bitwise and g["sha256"] != w["sha256"]:
            problems.append(f"{name}: final parameters are not bit-identical to the recorded run")
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
