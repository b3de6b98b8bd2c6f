"""CUDA checks; skipped cleanly on machines without a GPU (CI never has one)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from titan_contrastive.config import parse_args
from titan_contrastive.train import Trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_trains_and_evaluates_on_cuda(tmp_path: Path) -> None:
    trainer = Trainer(
        parse_args(
            [
                "--training.device=cuda",
                "--training.steps=3",
                "--training.local_batch_size=64",
                "--training.global_batch_size=128",
                "--metrics.log_freq=1",
                f"--job.dump_folder={tmp_path}",
            ]
        )
    )
    assert next(trainer.model.parameters()).is_cuda
    result = trainer.train()
    assert math.isfinite(result["loss"]) and 0.0 <= result["zero_shot_top1"] <= 1.0
    assert torch.cuda.max_memory_allocated() > 0
    trainer.metrics.close()


def test_bfloat16_selective_ac_compile_on_cuda(tmp_path: Path) -> None:
    """The issue-3 GPU stack on one device: bf16 autocast + selective AC + inductor per block."""
    trainer = Trainer(
        parse_args(
            [
                "--training.device=cuda",
                "--training.steps=3",
                "--training.local_batch_size=64",
                "--eval.enable=false",
                "--training.mixed_precision_param=bfloat16",
                "--activation_checkpoint.mode=selective",
                "--compile.enable=true",
                "--metrics.log_freq=1",
                "--metrics.enable_tensorboard=false",
                f"--job.dump_folder={tmp_path}",
            ]
        )
    )
    trainer.train()
    trainer.metrics.close()
    losses = [line for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"train"' in line]
    assert len(losses) == 3 and all("NaN" not in line and "Infinity" not in line for line in losses)


def test_cuda_rng_state_round_trip() -> None:
    from titan_contrastive.checkpoint import RNGState

    state = RNGState("cuda")
    saved = state.state_dict()
    assert "cuda" in saved
    first = torch.rand(4, device="cuda")
    state.load_state_dict(saved)
    assert torch.equal(torch.rand(4, device="cuda"), first)


def test_pixel_loss_modes_on_cuda_bf16_and_memory() -> None:
    """bf16 on CUDA: the chunked modes track the float32 gradient as closely as v0 does, and
    per_chunk_backward's allocator peak is well below v0's. (v0 sums the error in bf16, the chunked modes in
    float32: two bf16 results differ by up to both their errors, so each is held to the float32 reference.)"""
    from titan_contrastive.components.pixel_loss import compute_pixel_loss
    from titan_contrastive.models.vae import Decoder, vae_flavors

    torch.manual_seed(0)
    decoder = Decoder(vae_flavors["debug"]).cuda().bfloat16().requires_grad_(False)
    latents = torch.randn(8, 4, 32, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    images = torch.rand(8, 3, 128, 128, device="cuda", dtype=torch.bfloat16) * 2 - 1
    masks = torch.ones(8, 1, 128, 128, device="cuda", dtype=torch.bfloat16)
    reference = latents.detach().float().requires_grad_(True)
    compute_pixel_loss(reference, images.float(), masks.float(), decoder.float(), mode="v0", adaptive=False).backward()
    decoder.bfloat16()
    results = {}
    for mode in ("v0", "chunked", "per_chunk_backward"):
        latents.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        compute_pixel_loss(latents, images, masks, decoder, mode=mode, adaptive=False, chunk_size=1).backward()
        torch.cuda.synchronize()
        results[mode] = (latents.grad.float().clone(), torch.cuda.max_memory_allocated() - base)
    err = {mode: float((g - reference.grad).norm() / reference.grad.norm()) for mode, (g, _) in results.items()}
    assert err["v0"] < 0.1, err  # bf16 through the decoder: ~3.5 % on CPU
    assert err["chunked"] <= err["v0"] + 1e-2 and err["per_chunk_backward"] <= err["v0"] + 1e-2, err
    assert results["per_chunk_backward"][1] < 0.4 * results["v0"][1]


# The documented host syncs of a train step (docs/performance.md#host-syncs): the step's loss, read once; the
# gradient norm, read once for clipping and the non-finite check; global negatives read the temperature once
# (the fused kernels take it as a host float). Anything else found here is a regression.
STEP_SYNCS = {
    "accumulate": {"steps/accumulate.py:AccumulateStep.__call__", "components/optimizer.py:clip_grad_norm"},
    "gradcache": {"steps/gradcache.py:GradCacheStep.__call__", "components/optimizer.py:clip_grad_norm"},
    "global": {
        "steps/global_negatives.py:GlobalNegativesStep.__call__",
        "losses/infonce.py:InfoNCE.streamed",
        "components/optimizer.py:clip_grad_norm",
    },
}
STEP_SYNCS["global_patch_dropout"] = STEP_SYNCS["global"]  # the draw, its replay and the gather sync nothing
STEP_KINDS = {
    "accumulate": [],
    "gradcache": ["--gradcache.enabled=true", "--gradcache.chunk_sizes=24"],
    "global": ["--loss.negatives=global"],
    "global_patch_dropout": ["--loss.negatives=global", "--model.patch_dropout=0.5"],
}


@pytest.mark.parametrize("kind", list(STEP_KINDS))
def test_train_step_syncs_only_where_documented(kind: str, tmp_path: Path) -> None:
    from titan_contrastive.components.host_syncs import sync_sites

    args = ["--training.device=cuda", "--training.local_batch_size=64", "--training.global_batch_size=128"]
    args += ["--training.mixed_precision_param=bfloat16", "--eval.enable=false", f"--job.dump_folder={tmp_path}"]
    trainer = Trainer(parse_args([*args, "--metrics.enable_tensorboard=false", *STEP_KINDS[kind]]))
    local = trainer.cfg.training.local_batch_size
    batches = [trainer.train_set.__getitems__(list(range(j * local, (j + 1) * local))) for j in range(2)]
    batches = [{k: v.pin_memory() if torch.is_tensor(v) else v for k, v in b.items()} for b in batches]
    trainer.train_step(batches)  # the first step's one-time checks (normalization) and allocations
    torch.cuda.synchronize()
    sites = sync_sites(lambda: trainer.train_step(batches))
    torch.cuda.synchronize()
    assert sites and set(sites) <= STEP_SYNCS[kind], dict(sites)
    assert all(count == 1 for count in sites.values()), dict(sites)
    trainer.metrics.close()


def test_profiling_traces_cuda_kernels_and_snapshots_memory(tmp_path: Path) -> None:
    """`[profiling]` on CUDA: the window's trace holds the GPU's kernels, and the allocator's history is
    dumped at the window's end and, under an out-of-memory error, into `oom-step-N/`."""
    from titan_contrastive.train import main

    args = ["--training.device=cuda", "--training.local_batch_size=64", "--eval.enable=false"]
    profiling = ["--profiling.enable=true", "--profiling.memory_snapshot=true", "--profiling.start_step=2"]
    assert main([*args, *profiling, "--training.steps=2", f"--job.dump_folder={tmp_path}"]) == 0
    window = tmp_path / "profile_traces" / "step-2"
    events = json.loads((window / "rank0_trace.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)
    assert "Self CUDA" in (window / "rank0_ops.txt").read_text()
    assert (window / "rank0_memory_snapshot.pickle").read_bytes()[:1] == b"\x80"  # a pickle's protocol byte

    from titan_contrastive.components.profiling import StepProfiler
    from titan_contrastive.config.job_config import Profiling

    cfg = Profiling(memory_snapshot=True, start_step=5)
    profiler = StepProfiler(cfg, str(tmp_path), rank=0, device=torch.device("cuda"), last_step=9)
    with pytest.raises(torch.OutOfMemoryError), profiler.loop(first_step=1):
        profiler.step()
        torch.empty(2**50, dtype=torch.uint8, device="cuda")  # 1 PiB
    assert (tmp_path / "profile_traces" / "oom-step-2" / "rank0_memory_snapshot.pickle").stat().st_size > 0


def test_pinned_mode_background_save_holds_its_step_on_cuda(tmp_path: Path) -> None:
    """`async_mode = "async_with_pinned_mem"` on CUDA: the save is called right after an optimizer step
    whose kernels are still queued, its copy (pinned, non-blocking, on the stager's stream) runs beside
    the next step's forward and backward, the optimizer step waits for it: the checkpoint holds exactly
    the state at the save, and a fresh model and optimizer load it."""
    from tests.test_checkpoint import Cfg
    from titan_contrastive.checkpoint import CheckpointManager, ModelState, OptimizerState, TrainState

    def run(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, CheckpointManager]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(4))).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        states = {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer), "train": TrainState()}
        cfg = Cfg(async_mode="async_with_pinned_mem", interval=1)
        manager = CheckpointManager(
            cfg, dump_folder=str(tmp_path), states=states, per_rank_states={}, rank=0, dp_rank=0, dp_degree=1
        )
        return model, optimizer, manager

    def state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        moments = [t for s in optimizer.state.values() for t in (s["exp_avg"], s["exp_avg_sq"])]
        return [t.detach().cpu().clone() for t in (*model.parameters(), *moments)]

    model, optimizer, manager = run(0)
    x = torch.randn(256, 2048, device="cuda")
    for step in range(1, 5):
        model(x).square().mean().backward()
        manager.wait_for_staging()
        optimizer.step()
        optimizer.zero_grad()
        if step in (2, 3):
            manager.save(step, background=True)  # no host sync since the optimizer step
            at_save = state(model, optimizer)  # the state is unchanged until the next optimizer step
    manager.wait()
    assert manager.available_steps() == [2, 3]

    fresh_model, fresh_optimizer, fresh = run(1)
    fresh_model(x).square().mean().backward()
    fresh_optimizer.step()  # creates the moments that the checkpoint fills
    assert fresh.load() == 3
    assert all(torch.equal(a, b) for a, b in zip(state(fresh_model, fresh_optimizer), at_save, strict=True))
