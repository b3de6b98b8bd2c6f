"""What the checkpoint checksums cost: save time with the SHA-256 of every file against the hashing alone.

    python benchmarks/checkpoint_bench.py [--flavor vit_b32] [--repeats 3]

Builds the clip model of `--flavor` with AdamW state (one zero-lr step), saves it through the real
`CheckpointManager` (DCP files + manifest with checksums) `--repeats` times, and times the whole
save and, separately, hashing the saved files (what `_finalize` adds, and what validation costs on
load). Medians; writes results/checkpoint_bench.json. CPU, one process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from titan_contrastive.checkpoint import CheckpointManager, ModelState, OptimizerState, TrainState
from titan_contrastive.checkpoint.manager import _sha256
from titan_contrastive.config.job_config import Checkpoint
from titan_contrastive.models import get_flavor_args, get_model_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="vit_b32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    model = get_model_spec("clip").build_model(get_flavor_args("clip", args.flavor))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    saves, hashes, sizes = [], [], 0
    with tempfile.TemporaryDirectory() as tmp:
        manager = CheckpointManager(Checkpoint(enable=True, folder="ckpt", interval=1, keep_latest_k=0), dump_folder=tmp, states={"model": ModelState(model), "optimizer": OptimizerState(model, optimizer),
                                    "train_state": TrainState()}, per_rank_states={}, rank=0, dp_rank=0, dp_degree=1)
        for step in range(1, args.repeats + 1):
            start = time.perf_counter()
            manager.save(step)
            saves.append(time.perf_counter() - start)
            files = [p for p in (Path(tmp) / "ckpt" / f"step-{step}").rglob("*") if p.is_file()]
            sizes = sum(p.stat().st_size for p in files)
            start = time.perf_counter()
            for p in files:
                _sha256(p)
            hashes.append(time.perf_counter() - start)
    save, digest = statistics.median(saves), statistics.median(hashes)
    result = {"date": time.strftime("%Y-%m-%d"), "flavor": args.flavor, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "checkpoint_bytes": sizes, "save_s_median": save, "hash_s_median": digest, "hash_share_of_save": digest / save,
              "hash_mb_per_s": sizes / digest / 1e6, "saves_s": saves, "hashes_s": hashes}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "checkpoint_bench.json").write_text(json.dumps(result, indent=1))
    print(f"{args.flavor}: checkpoint {sizes / 2**30:.2f} GiB, save {save:.2f} s of which hashing {digest:.2f} s "
          f"({digest / save:.0%}, {sizes / digest / 1e6:.0f} MB/s); the same hashing runs once when a checkpoint is validated on load")


if __name__ == "__main__":
    main()
