"""bf16 mixed precision and per-layer torch.compile on the bi_encoder's Hugging Face towers (the tiny
BERT-like encoder and Qwen3-like decoder of tests/hf_folders.py), with and without LoRA; bf16 also on
the qwen_vl family (tiny Qwen2-VL with LoRA, slow).

Mixed precision runs under FSDP2 on 2 gloo processes (one process has no shard dimension, so FSDP2
is not applied there and mixed precision would be autocast instead): the step's loss and gradient
track the same step in float32 within bf16's accuracy, the parameters, adapters and gradients stay
float32, and every linear, embedding and norm really computes in bf16. Compile (`[compile]`, each
layer compiled in place) gives the eager step's loss and gradients within 1e-5 in float32, with
`aot_eager` as the other compile tests on CPU (tests/test_parallel.py); inductor (C++ codegen,
about a minute a model on 2 cores) and compile under FSDP2 with bf16 are in the `slow` set.
Dropout is off (model and LoRA), so two runs of a step draw nothing; LoRA's B is moved off zero by
a first step, copied into the other run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.needs import needs
from tests.test_hf_text import FOLDERS, folder_run, grads

LORA = ("--lora.enable=true", "--lora.rank=4", "--lora.alpha=8", "--lora.dropout=0")
LOCAL = 6
# bf16 keeps 8 significant bits (unit roundoff 2^-9 = 2e-3); through 2 layers, the normalization and a
# softmax at scale 20, the whole gradient measured 1.3-3.4e-2 off float32 (cosine >= 0.9994) and the loss
# 0.007-1.2% (this seed's folders and random ones): the bounds below are about 3x that, and far from what a
# wrong gradient gives.
BF16_GRAD_REL, BF16_COSINE, BF16_LOSS_REL = 0.1, 0.99, 0.05
# ...and the gradient at least this far off: float32 reordering moves it ~1e-6, so a bf16 setting that
# silently computed in float32 fails (the loss alone can land within 1e-4 of float32's by chance)
NOT_FP32 = 1e-3
COMPILE_REL = 1e-5


def _folder(tmp: Path, arch: str) -> None:
    """`arch`'s tiny folder, dropout off, from a fixed seed (the same weights every run)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        FOLDERS[arch](tmp, 0.0)


def _run(tmp: Path, arch: str, name: str, lora: bool, *extra: str):
    """A float32 trainer on `arch`'s folder in `tmp` (shared by the runs: the same weights), its own dump folder."""
    return folder_run(
        tmp,
        arch,
        f"--job.dump_folder={tmp / name}",
        "--training.dtype=float32",
        f"--training.local_batch_size={LOCAL}",
        *(LORA if lora else ()),
        *extra,
        dropout=0.0,
    )


def _flat(g: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.flatten() for t in g.values()])


def _same_step(runs: list, microbatch: dict[str, torch.Tensor], lora: bool) -> list[tuple[float, dict]]:
    """Each run's loss and (whole) gradients for one step on `microbatch` from the same parameters: with
    LoRA, after a step of the first run (B off zero, so A has a gradient) copied into the others."""
    if lora:
        runs[0].train_step([microbatch])
        for run in runs[1:]:
            run.model.load_state_dict(runs[0].model.state_dict())
    return [(run.train_step([microbatch])["loss"], grads(run.model)) for run in runs]


def _record_compute_dtypes(model: torch.nn.Module) -> tuple[set[str], dict[str, tuple[torch.dtype, torch.dtype]]]:
    """Forward hooks on every linear, embedding and norm: (their names, and {name: (weight dtype, output
    dtype)} filled in as they run)."""
    hooked, seen = set(), {}
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding, torch.nn.LayerNorm)) or type(
            module
        ).__name__.endswith("RMSNorm"):
            hooked.add(name)
            module.register_forward_hook(
                lambda m, args, out, name=name: seen.__setitem__(name, (m.weight.dtype, out.dtype))
            )
    return hooked, seen


def _bf16_under_fsdp2(tmp: str, arch: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    for lora in (False, True):
        fp32 = _run(Path(tmp), arch, f"fp32-{lora}", lora)
        bf16 = _run(Path(tmp), arch, f"bf16-{lora}", lora, "--training.mixed_precision_param=bfloat16")
        assert bf16.dims.mode == "fsdp" and bf16.precision.compute_dtype == torch.bfloat16
        batch = fp32.train_set.__getitems__(list(range(2 * LOCAL)))
        mine = {k: v[rank * LOCAL : (rank + 1) * LOCAL] for k, v in batch.items()}
        hooked, seen = _record_compute_dtypes(bf16.model)
        (want_loss, want), (loss, got) = _same_step([fp32, bf16], mine, lora)

        what = f"{arch}, lora={lora}"
        # every linear (LoRA's A and B included), embedding and norm computed with bf16 weights and outputs
        assert seen.keys() == hooked and set(seen.values()) == {(torch.bfloat16, torch.bfloat16)}, (what, seen)
        assert (".lora_A.default" in " ".join(seen)) == lora
        # master weights, adapters and gradients stay float32 (FSDP2 shards)
        assert {p.dtype for p in bf16.model.parameters()} == {torch.float32}, what
        trainable = [p for p in bf16.model.parameters() if p.requires_grad]
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trainable), what
        assert all(g.dtype == torch.float32 for g in got.values()) and got.keys() == want.keys()
        assert any(".lora_A." in n for n in got) == lora
        # close to float32 (bf16's accuracy) and not float32 itself (mixed precision really on)
        g, w = _flat(got), _flat(want)
        rel, cos = ((g - w).norm() / w.norm()).item(), torch.nn.functional.cosine_similarity(g, w, dim=0).item()
        assert NOT_FP32 < rel <= BF16_GRAD_REL and cos >= BF16_COSINE, (what, rel, cos)
        assert loss != want_loss and abs(loss - want_loss) <= BF16_LOSS_REL * want_loss, (what, loss, want_loss)
        fp32.metrics.close()
        bf16.metrics.close()


@needs("hf")
@pytest.mark.parametrize("arch", list(FOLDERS))
def test_bf16_mixed_precision_under_fsdp2_tracks_float32(tmp_path: Path, arch: str) -> None:
    """`training.mixed_precision_param=bfloat16`, FSDP2 per layer on 2 gloo processes, LoRA off and on."""
    _folder(tmp_path, arch)
    run_distributed(_bf16_under_fsdp2, 2, str(tmp_path), arch)


def _compiled_equals_eager(tmp: Path, arch: str, lora: bool, backend: str, *extra: str) -> None:
    """One step of a run with `[compile] enable` against the same step eager: loss and every gradient."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # compiled code is cached per code object (all HF layers share one), across tests
    counters.clear()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if not dist.is_initialized():
        _folder(tmp, arch)
    eager = _run(tmp, arch, "eager", lora, *extra)
    compiled = _run(tmp, arch, "compiled", lora, *extra, "--compile.enable=true", f"--compile.backend={backend}")
    batch = eager.train_set.__getitems__(list(range(world * LOCAL)))
    mine = {k: v[rank * LOCAL : (rank + 1) * LOCAL] for k, v in batch.items()}
    assert compiled.dims.fsdp_enabled == (world > 1)
    (want_loss, want), (loss, got) = _same_step([eager, compiled], mine, lora)
    assert counters["stats"]["unique_graphs"] >= 1  # Dynamo compiled the layers (no silent eager fallback)
    assert abs(loss - want_loss) <= COMPILE_REL * want_loss, (loss, want_loss)
    assert got.keys() == want.keys() and any(".lora_A." in n for n in got) == lora
    total = _flat(want).norm()
    for name, w in want.items():  # as tests/test_hard_negatives.assert_grads_close: a gradient that is zero in
        # exact arithmetic (BERT's key bias: softmax ignores a constant per row) is rounding, measured against
        # a millionth of the whole gradient
        err = ((got[name] - w).norm() / torch.maximum(w.norm(), 1e-6 * total)).item()
        assert err <= COMPILE_REL, f"{name}: relative error {err:.2e}"
    eager.metrics.close()
    compiled.metrics.close()


SLOW = pytest.mark.slow


@needs("hf")
@pytest.mark.parametrize(
    "arch,lora",  # slow: ~15 s each (test_parallel compiles the blocks in the default suite)
    [pytest.param(a, lo, marks=[SLOW]) for a in FOLDERS for lo in (False, True)],
)
def test_compiled_layers_give_the_eager_step(tmp_path: Path, arch: str, lora: bool) -> None:
    """`[compile] enable` with the aot_eager backend (Dynamo's capture and AOT autograd, no codegen; 2-6 s a
    case on 2 cores), one process, float32: the layers compile (queries and documents of other lengths: a
    dynamic-shape recompile, no graph break) and give the eager step."""
    _compiled_equals_eager(tmp_path, arch, lora, "aot_eager")


@needs("hf")
@SLOW
@pytest.mark.parametrize("arch,lora", [("encoder", False), ("decoder", True)])
def test_inductor_compiled_layers_give_the_eager_step(tmp_path: Path, arch: str, lora: bool) -> None:
    """The default backend, inductor (C++ kernels on CPU, about a minute a model): within float32 rounding."""
    _compiled_equals_eager(tmp_path, arch, lora, "inductor")


def _compiled_under_fsdp2(tmp: str, arch: str, lora: bool) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    _compiled_equals_eager(Path(tmp), arch, lora, "aot_eager", "--training.mixed_precision_param=bfloat16")


@needs("hf")
@SLOW
@pytest.mark.parametrize("arch,lora", [("encoder", False), ("decoder", True)])
def test_compiled_layers_under_fsdp2_and_bf16_give_the_eager_step(tmp_path: Path, arch: str, lora: bool) -> None:
    """torchtitan's order on 2 gloo processes: each layer compiled, then sharded by FSDP2 with bf16 compute;
    the same step eager under the same FSDP2 and bf16 (aot_eager runs the same bf16 ops: within 1e-5)."""
    _folder(tmp_path, arch)
    run_distributed(_compiled_under_fsdp2, 2, str(tmp_path), arch, lora)


def _qwen_vl_bf16_under_fsdp2(tmp: str) -> None:
    from tests.test_qwen_vl import LORA as VL_LORA
    from tests.test_qwen_vl import vl_run

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, folder = dist.get_rank(), Path(tmp) / "tiny-qwen2_vl"
    runs = [
        vl_run(
            Path(tmp) / name,
            "qwen2_vl",
            f"--model.path={folder}",  # one set of weights (dropout off) for both runs
            "--training.dtype=float32",
            "--training.local_batch_size=3",
            *VL_LORA,
            "--lora.dropout=0",
            *extra,
        )
        for name, extra in (("fp32", ()), ("bf16", ("--training.mixed_precision_param=bfloat16",)))
    ]
    fp32, bf16 = runs
    assert bf16.dims.mode == "fsdp" and bf16.precision.compute_dtype == torch.bfloat16
    mine = fp32.train_set.__getitems__(list(range(3 * rank, 3 * rank + 3)))
    (want_loss, want), (loss, got) = _same_step(runs, mine, lora=True)
    assert {p.dtype for p in bf16.model.parameters()} == {torch.float32}
    assert all(g.dtype == torch.float32 for g in got.values()) and got.keys() == want.keys()
    g, w = _flat(got), _flat(want)
    rel, cos = ((g - w).norm() / w.norm()).item(), torch.nn.functional.cosine_similarity(g, w, dim=0).item()
    assert NOT_FP32 < rel <= BF16_GRAD_REL and cos >= BF16_COSINE, (rel, cos)
    assert loss != want_loss and abs(loss - want_loss) <= BF16_LOSS_REL * want_loss, (loss, want_loss)
    for run in runs:
        run.metrics.close()


@needs("hf")
@SLOW
def test_qwen_vl_bf16_under_fsdp2_tracks_float32(tmp_path: Path) -> None:
    """The qwen_vl family (tiny Qwen2-VL, LoRA, images of three sizes) with bf16 mixed precision under FSDP2 on
    2 gloo processes: float32 parameters and gradients, loss and gradient within bf16's accuracy of float32."""
    from tests.hf_folders import vl_folder

    with torch.random.fork_rng():
        torch.manual_seed(0)
        vl_folder(tmp_path, "qwen2_vl", 0.0)
    run_distributed(_qwen_vl_bf16_under_fsdp2, 2, str(tmp_path))
