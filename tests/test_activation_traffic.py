"""Bytes moved outside the GEMMs (benchmarks/activation_traffic.py, counted through the trainer's own
gradient step on clip/debug, so machine-independent): FSDP2 on one device runs the same bf16 GEMMs as
autocast and moves fewer bytes per sample around them (no float32 residual stream, no per-forward
activation casts), the point of `parallelism.fsdp_one_device`."""

from __future__ import annotations

from benchmarks.activation_traffic import account


def test_fsdp_on_one_device_moves_fewer_bytes_around_the_same_gemms() -> None:
    rows = {(r["mode"], r["family"]): r for r in account("debug", [4, 8], image_size=0, predict=1024)}
    auto, fsdp = "autocast", "fsdp_one_device"
    gemm = [rows[mode, "gemm_attention"]["per_sample_bytes"] for mode in (auto, fsdp)]
    assert gemm[0] > 0 and abs(gemm[0] - gemm[1]) <= 1e-9 * gemm[0], gemm  # the same bf16 matmuls
    assert rows[auto, "fsdp"]["fixed_bytes"] == 0 < rows[fsdp, "fsdp"]["fixed_bytes"]  # FSDP2 really ran
    around = {mode: sum(rows[mode, f]["per_sample_bytes"] for f in ("cast", "fsdp", "other")) for mode in (auto, fsdp)}
    assert around[fsdp] < 0.8 * around[auto], around
