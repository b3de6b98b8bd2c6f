"""The tiles the fused Triton kernels (`kernels/streaming_triton.py`) are autotuned over.

Two kinds. *Streamed*: a program's row block and column tile are both loaded in BLOCK_D-slices of d
for every tile. *Resident*: the row block's whole d (BLOCK_D >= d) is loaded once into shared
memory and the program sweeps columns with it, so each tile reads only its columns (BLOCK_M FLOPs
per byte instead of BLOCK_M BLOCK_N / (BLOCK_M + BLOCK_N); docs/kernels.md). `prune_resident`
keeps the resident tiles where they fit; the autotuner times what is left per (d, dtype) on CUDA.
Under Triton's interpreter (TRITON_INTERPRET=1) each kernel gets one small tile of each kind, and
exactly one survives pruning, so CPU tests cross tile, panel and program boundaries without timing.
"""

from __future__ import annotations

import os

import triton

__all__ = [
    "INTERPRET",
    "LSE_CONFIGS",
    "RESIDENT_BYTES",
    "SIGMOID_CONFIGS",
    "WEIGHT_CONFIGS",
    "prune_resident",
    "resident_fits",
]

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


Shape = tuple[int, int, int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_D, warps, stages


def _configs(streamed: list[Shape], resident: list[Shape], col_tiles: int = 0) -> list[triton.Config]:
    """Both kinds as autotune configs (RESIDENT False / True); with `col_tiles` (a kernel that takes
    COL_TILES) a resident program sweeps that many column tiles, a streamed one one tile."""
    if INTERPRET:
        streamed, resident, col_tiles = [(16, 16, 32, 1, 1)], [(16, 16, 128, 1, 1)], min(col_tiles, 2)
    tiles = ({"COL_TILES": 1}, {"COL_TILES": col_tiles}) if col_tiles else ({}, {})
    groups = [({"RESIDENT": False, **tiles[0]}, streamed), ({"RESIDENT": True, **tiles[1]}, resident)]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_D": k, **extra}, num_warps=w, num_stages=s)
        for extra, group in groups
        for m, n, k, w, s in group
    ]


RESIDENT_BYTES = 128 * 1024  # a resident row block's embeddings in shared memory, at most


def resident_fits(config: triton.Config, itemsize: int, exact: bool) -> bool:
    """Whether a resident config can run well: tensor-core dots on 2-byte inputs (the exact dot
    upcasts its operands in registers, where a whole row block spills), and a row block
    (BLOCK_M x BLOCK_D) within RESIDENT_BYTES, leaving room for the pipelined column tiles in a
    Hopper SM's 227 KiB."""
    size = config.kwargs["BLOCK_M"] * config.kwargs["BLOCK_D"] * itemsize
    return not exact and itemsize == 2 and size <= RESIDENT_BYTES


def prune_resident(configs: list[triton.Config], named_args: dict, **_: object) -> list[triton.Config]:
    """The streamed configs, and the resident ones whose BLOCK_D holds d (on a GPU with at most half
    of it padding) and that fit (`resident_fits`). Under the interpreter exactly one remains, so
    nothing is timed: d <= 128 takes the resident path, larger d the streamed one (the tests cover
    both)."""
    d, itemsize, exact = named_args["d"], named_args["q_ptr"].element_size(), named_args["EXACT"]

    def holds(config: triton.Config) -> bool:
        block = config.kwargs["BLOCK_D"]
        return d <= block and (INTERPRET or (2 * d > block and resident_fits(config, itemsize, exact)))

    fits = [c for c in configs if not c.kwargs["RESIDENT"] or holds(c)]
    if INTERPRET:
        return [c for c in fits if c.kwargs["RESIDENT"]] or fits
    return fits


# Hopper candidates (H100: 227 KiB of shared memory per block)
_RESIDENT = [(128, 32, 512, 8, 2), (128, 64, 256, 8, 2)]
LSE_CONFIGS = _configs(
    [
        (128, 64, 64, 8, 3),
        (128, 128, 64, 8, 3),
        (64, 128, 64, 4, 3),
        (128, 64, 128, 8, 2),
        (64, 64, 64, 4, 4),
        # one warpgroup over 128 rows: each thread holds 4 rows of a column where the 64-row tiles
        # hold 2, so the column statistics take half the shuffles per logit (benchmarks/kernel_sass.py)
        (128, 64, 64, 4, 3),
        (128, 128, 64, 4, 2),
    ],
    _RESIDENT,
)
_W_STREAMED = [
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (128, 128, 128, 8, 2),
    (64, 128, 64, 4, 4),
]
WEIGHT_CONFIGS = _configs(_W_STREAMED, _RESIDENT, col_tiles=8)  # the softmax W
# SigLIP's W holds more values per logit (its loss terms): the 8-warp tiles of 32K logits spill most
# of their epilogue there (benchmarks/kernel_sass.py), so they are no candidates
SIGMOID_CONFIGS = _configs([t for t in _W_STREAMED if t[0] * t[1] <= 128 * 128], _RESIDENT, col_tiles=8)
