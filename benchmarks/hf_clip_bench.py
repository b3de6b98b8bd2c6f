"""The same CLIP through two implementations: the clip family's own ViT and text tower against
transformers' `CLIPModel` in the hf_clip family, one trainer step each, side by side.

    python -m benchmarks.hf_clip_bench                                              # CPU: vit_b32, batch 16
    python -m benchmarks.hf_clip_bench --batch 1024 --chunk 256 --repeats 5         # one GPU (bf16 autocast)

One random-init clip/`--flavor` model (seed 0) is written as a transformers folder the way `export --to
hf` writes one (`CLIPModel`, CLIP's BPE tokenizer, the image processor), and trained from that folder
by both families (`clip` with `[model] init_from`, `hf_clip` with `path`): the same weights, the same
synthetic batch (generated JPEGs decoded and cropped as files are, CLIP BPE captions). Step kinds:
`plain` (one forward and backward of the batch) and `gradcache` (chunks of `--chunk`). Each variant
is `Trainer.train_step` on that batch (optimizer step included), `--repeats` timed calls after one
warm-up, interleaved (`harness.round_robin`); rows: median seconds per step, samples/s, peak memory
(CUDA allocator; peak RSS on CPU), the step's loss, and hf_clip's time over clip's for each step kind.
The two families' first losses agree to float32 rounding (the float64 equality is a test:
`tests/test_hf_clip.py`). Writes hf_clip_bench.{json,csv,png}.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import harness

NAME = "hf_clip_bench"
FAMILIES = ("clip", "hf_clip")
KINDS = ("plain", "gradcache")
FIELDS = ["family", "kind", "batch", "chunk", "median_s", "samples_per_s", "peak_gib", "peak_rss_mib", "loss", "ratio"]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="vit_b32", help="clip flavor whose architecture both families run")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--chunk", type=int, default=8, help="GradCache chunk size")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(harness.RESULTS))
    return p.parse_args(argv)


def write_folder(folder: Path, flavor: str) -> int:
    """clip/`flavor` at random init (seed 0) as a transformers CLIP folder; returns its image size."""
    import torch
    from transformers import CLIPModel

    from titan_contrastive.models import get_flavor_args
    from titan_contrastive.models.clip.hf import hf_config_from_args, to_hf_state_dict
    from titan_contrastive.models.clip.model import CLIP
    from titan_contrastive.models.clip.state_dict_adapter import write_hf_image_processor, write_hf_tokenizer

    flavor_args = get_flavor_args("clip", flavor)
    size = flavor_args.image_size  # RGB, CLIP's BPE: what an exportable run of the flavor has
    args = flavor_args.update_from_data(image_shape=(3, size, size), vocab_size=49408, context_length=77, eos_id=49407)
    torch.manual_seed(0)
    ours = CLIP(args)
    ours.init_weights()
    model = CLIPModel(hf_config_from_args(args))
    model.load_state_dict(to_hf_state_dict(ours.state_dict(), args), strict=False)
    model.save_pretrained(str(folder))
    write_hf_tokenizer(folder, args.context_length)
    write_hf_image_processor(folder, args)
    return args.image_size


def trainer_args(family: str, kind: str, folder: Path, size: int, args: argparse.Namespace, dump: Path, cuda: bool):
    model = (
        ["--model.name=clip", f"--model.init_from={folder}", "--data.tokenizer=clip_bpe", f"--data.image_size={size}"]
        if family == "clip"
        else ["--model.name=hf_clip", "--model.flavor=folder", f"--model.path={folder}", "--data.image_size=0"]
    )
    return [
        *model,
        *harness.step_flags(dump, args.batch, cuda),
        *(["--gradcache.enabled=true", f"--gradcache.chunk_sizes={args.chunk}"] if kind == "gradcache" else []),
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    import torch

    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
    from titan_contrastive.config import parse_args
    from titan_contrastive.train import Trainer

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    meta = harness.metadata(device)
    with tempfile.TemporaryDirectory(prefix="hf_clip_bench_") as tmp:
        folder = Path(tmp) / "clip"
        size = write_folder(folder, args.flavor)
        trainers: dict[str, Any] = {}
        batches: dict[str, Any] = {}
        for family in FAMILIES:
            for kind in KINDS:
                name = f"{family}/{kind}"
                dump = Path(tmp) / name.replace("/", "-")
                trainers[name] = Trainer(parse_args(trainer_args(family, kind, folder, size, args, dump, cuda)))
                data = trainers[name].train_set.__getitems__(list(range(args.batch)))
                batches[name] = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        first = {name: trainers[name].train_step([batches[name]])["loss"] for name in trainers}  # the same weights
        measured = harness.round_robin(
            {name: (lambda name=name: trainers[name].train_step([batches[name]])) for name in trainers},
            args.repeats,
            device=device,
            rss=not cuda,
            keep_values=True,
        )
    rows = []
    for name, m in measured.items():
        family, kind = name.split("/")
        rows.append(
            {
                "family": family,
                "kind": kind,
                "batch": args.batch,
                "chunk": args.chunk if kind == "gradcache" else None,
                "median_s": m.median_s,
                "samples_per_s": args.batch / m.median_s,
                "peak_gib": None if m.cuda_peak_bytes is None else m.cuda_peak_bytes / 2**30,
                "peak_rss_mib": m.peak_rss_mib,
                "loss": first[name],
                "times_s": m.times_s,
            }
        )
    for row in rows:
        base = next(r for r in rows if r["family"] == "clip" and r["kind"] == row["kind"])
        row["ratio"] = row["median_s"] / base["median_s"]
    agreement = max(abs(first[f"hf_clip/{k}"] - first[f"clip/{k}"]) / abs(first[f"clip/{k}"]) for k in KINDS)

    def figure() -> Any:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for i, family in enumerate(FAMILIES):
            values = [next(r["samples_per_s"] for r in rows if r["family"] == family and r["kind"] == k) for k in KINDS]
            ax.bar([j + 0.38 * i for j in range(len(KINDS))], values, width=0.38, label=family)
        ax.set_xticks([j + 0.19 for j in range(len(KINDS))], [f"{k} (batch {args.batch})" for k in KINDS])
        ax.set_ylabel("samples/s (median)")
        ax.set_title(f"clip/{args.flavor}: our modules vs transformers' CLIPModel, {harness.device_name(device)}")
        ax.legend()
        return fig

    payload = {"config": vars(args), "image_size": size, "first_loss_rel_diff": agreement}
    harness.write_results(args.out, NAME, meta, payload, rows=rows, fields=FIELDS, figure=figure)
    for row in rows:
        print(
            f"{row['family']:8s} {row['kind']:9s} {row['median_s']:.3f} s/step  {row['samples_per_s']:.1f} samples/s  "
            f"x{row['ratio']:.2f}  loss {row['loss']:.6f}"
        )
    print(f"first losses agree to {agreement:.2e} (relative)")


if __name__ == "__main__":
    main()
