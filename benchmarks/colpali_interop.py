"""colpali-engine <-> titan_contrastive for ColQwen: our `--to colpali` export read by colpali-engine, the same token
embeddings and the same ColbertLoss; and how far transformers' own ColQwen2ForRetrieval is from both.

    bash benchmarks/colpali_venv.sh                                  # once: /tmp/colpali_venv
    .venv/bin/python -m benchmarks.colpali_interop [--colpali-python /tmp/colpali_venv/bin/python]

colpali-engine 0.3 pins peft < 0.21 and imports torchvision, so it runs in its own venv, called as a subprocess
(`benchmarks/_colpali_side.py`); files carry the folder, the inputs and the embeddings between the two. Nothing
downloads: the model is a random small Qwen2-VL (`models.qwen_vl.random_folder`) with the emoji words' tokenizer.
Nothing is timed: the harness gives the metadata.

What it checks (CPU, float32, eval), on a batch of the bundled emoji's images of 28, 56 and 84 px (queries) and their
captions (documents; i2t, so that a random model's documents do not all score alike through the template's first
tokens), a ColQwen run of ours (`pooling = "colbert"`, 128-wide tokens) after 30 steps, exported `--to colpali`:
a) ColQwen2.from_pretrained on the export: each side's tokens against the run's; max |difference|.
b) colpali-engine's ColbertLoss (temperature 0.02, scores over each query's length) on its embeddings against our
   objective with `loss.maxsim_normalize` at t = 50 on the run's (one-way): on a batch whose captions have one
   length, and on the mixed batch of (a). colpali-engine's MaxSim reads a padded document's zero tokens as
   candidates (a query token scores at least 0 against a shorter document); ours, as PyLate's, leaves them out.
   The same for its ColbertPairwiseCELoss (temperature 1) against our pairwise loss at t = 1, and its
   ColbertPairwiseNegativeCELoss (temperature 0.02, in-batch weight 0.5) against ours at t = 50 with each query's hard
   negative the next query's document.
c) transformers' ColQwen2ForRetrieval with the same weights: its tokens against the run's (its language model runs
   on embeddings without the ids, so image tokens get text positions: the documents differ).
d) `train_configs/colqwen.toml`'s templates against colpali-engine's processor (`ColQwen2Processor.from_pretrained`
   on the export: its query augmentation and page prompt, its image processor, here with the small model's
   word-level tokenizer): our batch of captions and images at 28 to 84 px against its `process_queries` and
   `process_images`; ids and grids equal or not, pixel values' max |difference|.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from benchmarks import harness

NAME = "colpali_interop"
BATCH = 6


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--colpali-python", default="/tmp/colpali_venv/bin/python")
    p.add_argument("--out", default=str(harness.RESULTS))
    return p.parse_args(argv)


def _trained(work: Path, folder: Path):
    """A ColQwen run of ours on `folder`, 30 optimizer steps and a checkpoint: (the trainer, its step folder)."""
    from titan_contrastive.config import parse_args
    from titan_contrastive.train import Trainer

    trainer = Trainer(
        parse_args(
            [
                "--model.name=qwen_vl",
                f"--model.path={folder}",
                "--model.pooling=colbert",
                "--data.dataset=emoji",
                "--data.retrieval_mode=i2t",
                "--data.image_sizes",
                "28",
                "56",
                "84",
                f"--data.max_pixels={84 * 84}",
                "--data.context_length=12",
                f"--training.local_batch_size={BATCH}",
                "--training.steps=30",
                "--training.dtype=float32",
                "--optimizer.lr=3e-3",
                "--lr_scheduler.warmup_steps=0",
                "--eval.enable=false",
                "--checkpoint.enable=true",
                "--metrics.enable_tensorboard=false",
                f"--job.dump_folder={work / 'run'}",
            ]
        )
    )
    trainer.train()
    trainer.metrics.close()
    return trainer, work / "run" / "checkpoint" / "step-30"


def _inputs(batch: dict, image_token_id: int) -> dict:
    """The batch as ColQwen2Processor gives it: ids padded with 0 beside an attention mask, mm_token_type_ids, each
    image's patches padded to the longest [B, patches, C]."""
    import torch

    out = {}
    for side in ("query", "doc"):
        ids = batch[side]
        mask = ids != -1
        out[f"{side}_input_ids"] = ids.masked_fill(~mask, 0)
        out[f"{side}_attention_mask"] = mask.long()
        out[f"{side}_mm_token_type_ids"] = (ids == image_token_id).long()
        grid = batch[f"{side}_image_grid_thw"]
        if len(grid):
            parts = torch.split(batch[f"{side}_pixel_values"], grid.prod(-1).tolist())
            longest = max(len(p) for p in parts)
            padded = [torch.cat([p, p.new_zeros(longest - len(p), p.shape[1])]) for p in parts]
            out[f"{side}_pixel_values"], out[f"{side}_image_grid_thw"] = torch.stack(padded), grid
    return {k: v.contiguous() for k, v in out.items()}


def _one_length(data) -> list[int]:
    """BATCH samples whose captions (the documents) have one token length: the most common among the first 200."""
    from collections import defaultdict

    by_length = defaultdict(list)
    for i in range(200):
        by_length[int((data.__getitems__([i])["doc"] != -1).sum())].append(i)
    return max(by_length.values(), key=len)[:BATCH]


def _gap(theirs, ours, dim: int) -> float:
    """The largest |difference| of their tokens [B, L, dim] and our rows [B, L' * dim] (ours past L all zero)."""
    tokens = ours.view(len(ours), -1, dim)
    length = theirs.shape[1]
    rest = tokens[:, length:].abs().max().item() if tokens.shape[1] > length else 0.0
    return max((tokens[:, :length] - theirs).abs().max().item(), rest)


def _transformers_colqwen2(tower, head, inputs: dict) -> dict:
    """transformers' ColQwen2ForRetrieval holding `tower` and `head`: each side's tokens."""
    import torch
    from transformers import ColQwen2Config, ColQwen2ForRetrieval

    model = ColQwen2ForRetrieval(ColQwen2Config(vlm_config=tower.config.to_dict(), embedding_dim=head.out_features))
    state = {f"vlm.{k}": v for k, v in tower.state_dict().items()}
    state.update({f"embedding_proj_layer.{k}": v for k, v in head.state_dict().items()})
    model.load_state_dict(state)
    model.eval()
    out = {}
    with torch.no_grad():
        for side in ("query", "doc"):
            kwargs = {k.removeprefix(f"{side}_"): v for k, v in inputs.items() if k.startswith(f"{side}_")}
            kwargs.pop("mm_token_type_ids")
            out[side] = model(**kwargs).embeddings
    return out


def _processing(opts, args, exported: Path, work: Path) -> dict:
    """(d): our SideProcessor with the ColQwen recipe's templates against colpali-engine's processor."""
    import dataclasses

    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    from titan_contrastive.config import parse_args
    from titan_contrastive.models.qwen_vl.model import SideProcessor

    recipe = parse_args(["--job.config_file", str(harness.REPO / "train_configs" / "colqwen.toml")]).model
    ours = SideProcessor(
        dataclasses.replace(args, mode="t2i", query_template=recipe.query_prompt, doc_template=recipe.doc_prompt)
    )
    g = np.random.default_rng(0)
    images = [g.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((28, 56), (84, 84), (56, 40))]
    texts = ["a photo of a cat", "dog", "a small bus with wheels"]
    save_file({f"image{i}": torch.from_numpy(x) for i, x in enumerate(images)}, str(work / "samples.safetensors"))
    (work / "texts.json").write_text(json.dumps(texts))
    subprocess.run(
        [opts.colpali_python, "-m", "benchmarks._colpali_side", "process", str(exported),
         str(work / "samples.safetensors"), str(work / "texts.json"), str(work / "processed.safetensors")],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    theirs = load_file(str(work / "processed.safetensors"))
    batch = ours.sides(None, texts, images, None)
    out: dict = {}
    for side in ("query", "doc"):
        mask = theirs[f"{side}_attention_mask"].bool()
        out[f"{side}_ids_equal"] = all(
            batch[side][i][batch[side][i] != -1].tolist() == theirs[f"{side}_input_ids"][i][mask[i]].tolist()
            for i in range(len(texts))
        )
    grid = batch["doc_image_grid_thw"]
    out["grid_equal"] = grid.tolist() == theirs["doc_image_grid_thw"].tolist()
    ours_pixels = torch.split(batch["doc_pixel_values"], grid.prod(-1).tolist())
    out["pixel_values"] = max(
        (p - theirs["doc_pixel_values"][i, : len(p)]).abs().max().item() for i, p in enumerate(ours_pixels)
    )
    return out


def main(argv: list[str] | None = None) -> None:
    opts = parse(argv)
    import torch
    from safetensors.torch import load_file, save_file

    from benchmarks._qwen_vl_trainer import build_folder
    from titan_contrastive.export import main as export_main
    from titan_contrastive.losses.late_interaction import LateInteraction, LatePairwise
    from titan_contrastive.models.weights import read_ours

    torch.manual_seed(0)
    meta = harness.metadata(torch.device("cpu"))
    work = Path(tempfile.mkdtemp(prefix="colpali_interop_"))
    try:
        folder = build_folder(work / "small", "small")
        trainer, step = _trained(work, folder)
        exported = work / "colqwen"
        assert export_main([str(step), "--to", "colpali", "--out", str(exported)]) == 0
        _, run_args, model = read_ours(step)
        model.eval()
        dim = model.token_dim
        result: dict = {"side_tokens": model.lengths, "dim": dim}
        for name, rows in (("mixed", list(range(BATCH))), ("one_length", _one_length(trainer.train_set))):
            batch = {k: v for k, v in trainer.train_set.__getitems__(rows).items() if torch.is_tensor(v)}
            with torch.no_grad():
                q, d, _ = model(*(batch[k] for k in ("query", "doc")), *(batch[f"{s}_{f}"] for s in ("query", "doc")
                                for f in ("pixel_values", "image_grid_thw")))  # fmt: skip
            inputs = _inputs(batch, model.tower.config.image_token_id)
            save_file(inputs, str(work / "inputs.safetensors"))
            subprocess.run(
                [opts.colpali_python, "-m", "benchmarks._colpali_side", str(exported), str(work / "inputs.safetensors"),
                 str(work / "theirs.safetensors"), str(work / "loss.json")],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            theirs = load_file(str(work / "theirs.safetensors"))
            colpali = json.loads((work / "loss.json").read_text())
            ours = {
                "loss": LateInteraction(dim, normalize=True).dense(q, d, torch.tensor(50.0)).item(),
                "pairwise": LatePairwise(token_dim=dim, normalize=True).dense(q, d, torch.tensor(1.0)).item(),
                "pairwise_negatives": LatePairwise(token_dim=dim, normalize=True)
                .dense(q, torch.cat([d, d.roll(1, 0)]), torch.tensor(50.0))
                .item(),
            }
            hf = _transformers_colqwen2(model.tower, model.head, inputs)
            result[name] = {
                "samples": rows,
                "tokens": {"query": int(batch["query"].shape[1]), "doc": int(batch["doc"].shape[1])},
                "a_ours_to_colpali": {side: _gap(theirs[side], r, dim) for side, r in (("query", q), ("doc", d))},
                **{
                    f"b_{key}": {
                        "colpali": colpali[name],
                        "ours": ours[name],
                        "difference": abs(colpali[name] - ours[name]),
                    }
                    for key, name in (
                        ("colbert_loss", "loss"),
                        ("pairwise_loss", "pairwise"),
                        ("pairwise_negatives_loss", "pairwise_negatives"),
                    )
                },
                "c_transformers_colqwen2": {side: _gap(hf[side], r, dim) for side, r in (("query", q), ("doc", d))},
            }
        result["d_processing"] = _processing(opts, run_args, exported, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2))
    harness.write_results(opts.out, NAME, meta, {"config": vars(opts), "result": result})


if __name__ == "__main__":
    main()
