"""Where a call's time goes, by kernel family: `kernel_times(fn, device, families)`.

On CUDA it profiles `fn` with torch.profiler and sums the device time of every kernel (and
memcpy/memset) by the first family whose pattern matches the kernel's name; on the CPU, which has
no kernels, it sums the self time of each operator the same way (so the CPU tests run the same code).
Families are {name: regular expression}, searched in order; what none matches is "other".
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

__all__ = ["LOSS_FAMILIES", "STEP_FAMILIES", "kernel_times"]

# the fused loss (kernels/streaming_triton.py) and what its panels call
LOSS_FAMILIES = {
    "forward LSE": r"_lse_pass_kernel",
    "W (softmax)": r"_weights_kernel",
    "W (sigmoid)": r"_sigmoid_kernel",
    "GEMM": r"gemm|xmma|cutlass|nvjet|cublas|aten::(addmm|mm|bmm)$",
    "copies and fills": r"Memcpy|Memset|copy|fill|zero",
}
# a training step (models/transformer.py, the optimizer, the loss)
STEP_FAMILIES = {
    "attention": r"flash|fmha|sdpa|attention",
    "fused loss": r"_lse_pass_kernel|_weights_kernel|_sigmoid_kernel",
    "GEMM": r"gemm|xmma|cutlass|nvjet|cublas|aten::(addmm|mm|bmm)$",
    "compiled (inductor)": r"^triton_",
    "optimizer": r"multi_tensor|fused_adam|adamw|FusedAdam",
    "normalization": r"norm",
    "copies and fills": r"Memcpy|Memset|copy|fill|zero|cat",
    "elementwise and reductions": r"elementwise|vectorized|unrolled|reduce|softmax|gelu|dropout|aten::",
}


def kernel_times(
    fn: Callable[[], Any], device: torch.device, families: Mapping[str, str], calls: int = 1, top: int = 12
) -> dict[str, Any]:
    """Profile `calls` calls of `fn`; per call: milliseconds and launches by family (`families_ms`,
    `families_launches`), the total (`total_ms`), and the `top` kernels (name, ms, launches) by time,
    overall and (`top_other`) of those no family names."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
    times: Counter[str] = Counter()
    launches: Counter[str] = Counter()
    for event in prof.events():
        if cuda and event.device_type != DeviceType.CUDA:
            continue
        us = event.device_time_total if cuda else event.self_cpu_time_total
        times[event.name] += us / 1e3 / calls
        launches[event.name] += 1
    patterns = [(name, re.compile(pattern, re.IGNORECASE)) for name, pattern in families.items()]
    by_family: dict[str, float] = {name: 0.0 for name in [*families, "other"]}
    calls_by_family: Counter[str] = Counter()
    unnamed: Counter[str] = Counter()
    for name, ms in times.items():
        family = next((f for f, pattern in patterns if pattern.search(name)), "other")
        by_family[family] += ms
        calls_by_family[family] += launches[name] // calls
        if family == "other":
            unnamed[name] = ms
    return {
        "families_ms": by_family,
        "families_launches": dict(calls_by_family),
        "total_ms": sum(times.values()),
        "top": [[name, ms, launches[name] // calls] for name, ms in times.most_common(top)],
        "top_other": [[name, ms, launches[name] // calls] for name, ms in unnamed.most_common(top)],
        "measure": "CUDA kernel time" if cuda else "CPU operator self time",
    }
