"""The fused loss kernels' machine instructions per logit on an H100, counted without one.

    python -m benchmarks.kernel_sass --out benchmarks/results                  # this tree
    python -m benchmarks.kernel_sass --baseline 60f25a4 --out benchmarks/results  # and a revision beside it

Every Triton kernel of `kernels/streaming_triton.py` in every autotune config that runs at d = 512
in bf16 is compiled for sm_90a (Triton's PTX, the wheel's ptxas) and disassembled (the wheel's
cuobjdump), and its SASS is counted by instruction class. A tile's epilogue (scaling, maxima,
exponentials, sums, the W store) is code unrolled over the thread's logits, so its count per logit
is what each logit costs. Static counts: the d-loop (copies, wgmma) is counted once though it runs
d / BLOCK_D times, and the branches only edge and diagonal tiles take are counted though most tiles
skip them (for the epilogue, an upper bound on an interior tile). From them, a static model per
tile and SM: issue cycles (instructions x warps / 4 schedulers) against the tensor cores' (2 BLOCK_M
BLOCK_N d FLOP at 4,096 per clock, dense bf16), the MUFU's (16 results per clock) and the shuffles'
(32). Where issue exceeds the tensor cores, the epilogue, not the wgmma, sets the pace unless another
tile's wgmma overlaps it. Nothing is timed here: `loss_profile` and `loss_bench` on a GPU decide.
`--picks` marks the configs an H100's autotuner chose (a loss_bench JSON's `autotuned`). Writes
kernel_sass_triton<major.minor>.{json,csv,png}: the SASS depends on the Triton that compiled it.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import harness

ROOT = Path(__file__).resolve().parent.parent
D, N_PROGRAMS = 512, 264  # the benchmarks' embedding width; two forward programs per H100 SM (132)
TENSOR_FLOP_PER_CLOCK, MUFU_PER_CLOCK, SHUFFLE_PER_CLOCK, SCHEDULERS = 4096, 16, 32, 4
KERNELS = {"forward LSE": "_lse_pass_kernel", "W (softmax)": "_weights_kernel", "W (sigmoid)": "_sigmoid_kernel"}
CLASSES = {  # SASS opcode (before the first dot) -> class; the rest is "other"
    "tensor": {"HGMMA"},
    "mufu": {"MUFU"},
    "shuffle": {"SHFL"},
    "barrier": {"BAR"},
    "fp32": {"FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "FCHK", "F2FP", "F2F"},
    "integer": {"ISETP", "IADD3", "IMAD", "LOP3", "SEL", "LEA", "SHF", "VIADD", "PRMT", "IABS", "IMNMX", "P2R", "R2P"},
    "memory": {"LDG", "STG", "LDS", "STS", "LDSM", "LDGSTS", "ATOM", "ATOMG", "RED", "REDG", "LDGDEPBAR", "DEPBAR"},
    "spill": {"LDL", "STL"},
}
_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def classify(sass: str) -> dict[str, int]:
    """Instruction counts of a disassembly by class (CLASSES, "other"), and "total"."""
    counts = collections.Counter()
    for opcode in _OPCODE.findall(sass):
        counts[next((c for c, ops in CLASSES.items() if opcode in ops), "other")] += 1
    return {c: counts[c] for c in [*CLASSES, "other"]} | {"total": sum(counts.values())}


def _signature(fn: Any, dtype: str, exact: bool) -> tuple[dict[str, str], dict[tuple[int], list]]:
    """Triton's signature of a fused-loss kernel from its argument names (embeddings in `dtype`, W in
    it too or float32 when `exact`, float32 statistics), and the 16-divisible arguments that a launch
    at N = 64K, d = 512 specializes (vectorized, pipelined copies: the shared memory it needs)."""
    sig, aligned = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name.isupper():
            sig[name] = "constexpr"
            continue
        if name in ("q_ptr", "k_ptr"):
            sig[name] = f"*{dtype}"
        elif name.endswith("_ptr"):
            sig[name] = f"*{'fp32' if exact else dtype}" if name == "w_ptr" else "*fp32"
        else:
            sig[name] = "fp32" if name in ("scale", "scale2", "bias") else "i32"
        if sig[name] != "fp32" and name != "diag_offset":
            aligned[(i,)] = [["tt.divisibility", 16]]
    return sig, aligned


def compile_for_hopper(fn: Any, cfg: Any, dtype: str = "bf16", exact: bool = False) -> Any:
    """`fn` (a kernel's jit function) in autotune config `cfg`, compiled for sm_90a without a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, aligned = _signature(fn, dtype, exact)
    constexprs = {"EXACT": exact, **cfg.kwargs, **({"N_PROGRAMS": N_PROGRAMS} if "N_PROGRAMS" in sig else {})}
    source = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=aligned)
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def disassemble(kernel: Any) -> str:
    """The SASS of a compiled kernel (the Triton wheel's cuobjdump)."""
    import triton

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.cubin").write_bytes(kernel.asm["cubin"])
        tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
        return subprocess.run([str(tool), "-sass", f"{tmp}/k.cubin"], capture_output=True, text=True, check=True).stdout


def _package(root: Path | None) -> Any:
    """kernels/streaming_triton of the package under `root` (default: the installed one)."""
    if root is not None:
        init = root / "titan_contrastive/__init__.py"
        spec = importlib.util.spec_from_file_location(
            "titan_contrastive", init, submodule_search_locations=[str(init.parent)]
        )
        sys.modules["titan_contrastive"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return importlib.import_module("titan_contrastive.kernels.streaming_triton")


def count(
    root: Path | None = None, picks: dict[str, set[str]] | None = None, kernels: list[str] | None = None
) -> list[dict[str, Any]]:
    """One row per kernel x config that runs at d = 512 in bf16: its SASS by class, per logit and
    in the static model."""
    import torch

    st = _package(root)
    named = {"d": D, "q_ptr": torch.empty(0, dtype=torch.bfloat16), "EXACT": False}
    rows = []
    for family in kernels or KERNELS:
        tuner = getattr(st, KERNELS[family])
        for cfg in st.prune_resident(tuner.configs, named):
            kernel = compile_for_hopper(tuner.fn, cfg)
            rows.append(model(family, cfg, classify(disassemble(kernel)), kernel.metadata.shared, picks or {}))
    return rows


def model(family: str, cfg: Any, counts: dict[str, int], shared: int, picks: dict[str, set[str]]) -> dict[str, Any]:
    """The row of one compiled config: counts per logit and the tile's cycles per unit."""
    m, n, warps = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_warps
    threads = 32 * warps
    per_thread = m * n / threads
    tile = "x".join(str(cfg.kwargs[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_D"))
    config = (
        f"{tile} {'resident' if cfg.kwargs.get('RESIDENT') else 'streamed'}, {warps} warps, {cfg.num_stages} stages"
    )
    cycles = {
        "issue": counts["total"] * warps / SCHEDULERS,
        "tensor": 2 * m * n * D / TENSOR_FLOP_PER_CLOCK,
        "mufu": counts["mufu"] * threads / MUFU_PER_CLOCK,
        "shuffle": counts["shuffle"] * threads / SHUFFLE_PER_CLOCK,
    }
    key = f"BLOCK_M: {m}, BLOCK_N: {n}, BLOCK_D: {cfg.kwargs['BLOCK_D']}, RESIDENT: {cfg.kwargs.get('RESIDENT')}"
    return {
        "kernel": family,
        "config": config,
        "h100_pick": any(p.startswith(key) and f"num_warps: {warps}," in p for p in picks.get(family, ())),
        "logits_per_thread": per_thread,
        "shared_kib": shared / 1024,
        **counts,
        **{f"{c}_per_logit": round(counts[c] / per_thread, 2) for c in [*CLASSES, "other", "total"]},
        **{f"{u}_cycles": round(v) for u, v in cycles.items()},
        "issue_over_tensor": round(cycles["issue"] / cycles["tensor"], 2),
    }


def h100_picks(path: Path) -> dict[str, set[str]]:
    """The autotuner's choices recorded in a loss_bench JSON, by kernel family."""
    tuned = json.loads(path.read_text()).get("autotuned", {})
    names = {"lse": "forward LSE", "weights": "W (softmax)", "sigmoid": "W (sigmoid)"}
    return {names[k]: set(v.values()) for k, v in tuned.items() if k in names}


def _run_worker(root: Path | None, picks: Path | None, kernels: list[str]) -> list[dict[str, Any]]:
    """`count` in a child without TRITON_INTERPRET (a real compile), for the package under `root`."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, named to silence its warning
    command = [sys.executable, "-m", "benchmarks.kernel_sass", "--worker", str(root or ""), "--picks", str(picks or "")]
    command += ["--kernels", *kernels]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"compiling the kernels{f' of {root}' if root else ''} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def plot(rows: list[dict[str, Any]], title: str) -> Any:
    """Instructions per logit by class: per revision and kernel, the config an H100 chose and the
    one with the fewest issue cycles per tensor-core cycle in the model."""
    plt = harness.pyplot()
    shown = []
    for key in dict.fromkeys((r["revision"], r["kernel"]) for r in rows):
        group = [r for r in rows if (r["revision"], r["kernel"]) == key]
        best = min(group, key=lambda r: r["issue_over_tensor"])
        shown += [(r, "H100's pick") for r in group if r["h100_pick"] and r is not best]
        shown.append((best, "H100's pick, fewest issue cycles" if best["h100_pick"] else "fewest issue cycles"))
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.42 * len(shown)))
    labels = [f"{r['revision']}: {r['kernel']} {r['config']} ({why})" for r, why in shown]
    left = [0.0] * len(shown)
    for c in [*CLASSES, "other"]:
        widths = [r[f"{c}_per_logit"] for r, _ in shown]
        ax.barh(labels, widths, left=left, label=c)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    ax.set_xlabel("SASS instructions per logit (per thread, sm_90a)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=9, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / len(shown)))
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="a git revision whose kernels are counted beside this tree's")
    parser.add_argument("--picks", type=Path, default=ROOT / "benchmarks/results/loss_bench_cuda.json")
    parser.add_argument("--kernels", nargs="+", choices=list(KERNELS), default=list(KERNELS))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:  # the child: compile and print the rows
        picks = h100_picks(args.picks) if args.picks and args.picks.is_file() else {}
        print(json.dumps(count(Path(args.worker) if args.worker else None, picks, args.kernels)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        try:  # an unreadable revision stops the run before anything compiles
            base = harness.package_at(args.baseline, Path(tmp)) if args.baseline else None
        except ValueError as e:
            parser.error(str(e))
        rows = [{"revision": "this tree", **r} for r in _run_worker(None, args.picks, args.kernels)]
        if base is not None:
            rows = [{"revision": args.baseline, **r} for r in _run_worker(base, args.picks, args.kernels)] + rows
    import triton

    meta = harness.metadata("cpu", target="sm_90a (compiled, not run)", triton=triton.__version__, d=D)
    meta["baseline"] = args.baseline
    title = f"Fused-loss kernels, bf16, d = {D}, Triton {triton.__version__}: SASS per logit"
    name = f"kernel_sass_triton{triton.__version__.rsplit('.', 1)[0]}"
    for path in harness.write_results(args.out, name, meta, rows=rows, figure=lambda: plot(rows, title)):
        print(f"wrote {path}")
    for r in rows:
        print(
            f"{r['revision'][:10]:10} {r['kernel']:12} {r['config']:40} pick={r['h100_pick']!s:5} "
            f"{r['total_per_logit']:5.1f}/logit  mufu {r['mufu_per_logit']:4.2f}  shfl {r['shuffle_per_logit']:4.2f}  "
            f"issue/tensor {r['issue_over_tensor']:.2f}"
        )


if __name__ == "__main__":
    main()
