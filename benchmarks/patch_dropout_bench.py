"""FLIP's patch dropout through the trainer: one clip step at each `[model] patch_dropout`, side by side.

    python -m benchmarks.patch_dropout_bench                                            # CPU: vit_b32, batch 16
    python -m benchmarks.patch_dropout_bench --flavor vit_b16 --batch 8
    python -m benchmarks.patch_dropout_bench --flavor vit_b16 --batch 1024 --repeats 5  # one GPU (bf16 autocast)

One random-init clip/`--flavor` model per rate (seed 0: the same weights), the same synthetic batch (generated
JPEGs decoded and cropped as files are, CLIP BPE captions), each rate's `Trainer.train_step` on it (optimizer
step included), `--repeats` timed calls after one warm-up, interleaved (`harness.round_robin`). Rows: median
seconds per step, samples/s, the speed-up over rate 0 beside the analytic prediction (the ratio of
`flops_per_sample`, which counts only the tokens patch dropout keeps), the activations one forward of the batch
saves for its backward (`SavedActivations`: counted, so the same on any device) and the step's peak memory
(CUDA allocator; on CPU the process's peak RSS, over all rates). Writes patch_dropout_bench_FLAVOR.{json,csv,png}.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import harness

NAME = "patch_dropout_bench"
FIELDS = [
    "flavor",
    "patch_dropout",
    "batch",
    "median_s",
    "samples_per_s",
    "speedup",
    "predicted",
    "saved_mib",
    "peak_gib",
    "peak_rss_mib",
]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="vit_b32", help="clip flavor")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.5, 0.75], help="patch_dropout values")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(harness.RESULTS))
    return p.parse_args(argv)


def trainer_args(rate: float, args: argparse.Namespace, dump: Path, cuda: bool) -> list[str]:
    return [
        "--model.name=clip",
        f"--model.flavor={args.flavor}",
        f"--model.patch_dropout={rate}",
        "--data.tokenizer=clip_bpe",
        f"--data.image_size={args.image_size}",
        *harness.step_flags(dump, args.batch, cuda),
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    import torch

    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
    from titan_contrastive.components.memory_probe import SavedActivations
    from titan_contrastive.config import parse_args
    from titan_contrastive.train import Trainer

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    meta = harness.metadata(device)
    with tempfile.TemporaryDirectory(prefix="patch_dropout_bench_") as tmp:
        trainers: dict[float, Any] = {}
        for rate in args.rates:
            trainers[rate] = Trainer(parse_args(trainer_args(rate, args, Path(tmp) / str(rate), cuda)))
        data = trainers[args.rates[0]].train_set.__getitems__(list(range(args.batch)))
        batch = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        flops = {rate: trainers[rate].model_args.flops_per_sample() for rate in args.rates}
        saved = {}
        for rate, trainer in trainers.items():
            with SavedActivations(trainer.model.parameters()) as probe:
                out = trainer.step_context.encode(batch)
            saved[rate] = probe.peak
            del out
        measured = harness.round_robin(
            {rate: (lambda rate=rate: trainers[rate].train_step([batch])) for rate in args.rates},
            args.repeats,
            device=device,
            rss=not cuda,
        )
    base = measured[args.rates[0]].median_s
    rows = [
        {
            "flavor": args.flavor,
            "patch_dropout": rate,
            "batch": args.batch,
            "median_s": m.median_s,
            "samples_per_s": args.batch / m.median_s,
            "speedup": base / m.median_s,
            "predicted": flops[args.rates[0]] / flops[rate],
            "saved_mib": saved[rate] / 2**20,
            "peak_gib": None if m.cuda_peak_bytes is None else m.cuda_peak_bytes / 2**30,
            "peak_rss_mib": m.peak_rss_mib,
            "times_s": m.times_s,
        }
        for rate, m in measured.items()
    ]

    def figure() -> Any:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        at = range(len(rows))
        ax.bar([i - 0.2 for i in at], [r["speedup"] for r in rows], width=0.4, label="measured")
        ax.bar([i + 0.2 for i in at], [r["predicted"] for r in rows], width=0.4, label="FLOPs ratio")
        ax.set_xticks(list(at), [f"patch_dropout {r['patch_dropout']}" for r in rows])
        ax.set_ylabel("step speed-up over 0 (median)")
        ax.set_title(f"clip/{args.flavor}, batch {args.batch}, {harness.device_name(device)}")
        ax.legend()
        return fig

    harness.write_results(
        args.out, f"{NAME}_{args.flavor}", meta, {"config": vars(args)}, rows=rows, fields=FIELDS, figure=figure
    )
    for row in rows:
        print(
            f"patch_dropout {row['patch_dropout']:.2f}  {row['median_s']:.3f} s/step  {row['samples_per_s']:.1f} "
            f"samples/s  x{row['speedup']:.2f} (FLOPs: x{row['predicted']:.2f})  saved for backward "
            f"{row['saved_mib']:.0f} MiB"
        )


if __name__ == "__main__":
    main()
