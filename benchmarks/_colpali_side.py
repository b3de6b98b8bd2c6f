"""colpali-engine's side of `benchmarks/colpali_interop.py`, run by the colpali venv's Python
(`benchmarks/colpali_venv.sh`): it imports only torch, safetensors and colpali-engine, never titan_contrastive, and
exchanges files with the other side.

    python -m benchmarks._colpali_side FOLDER INPUTS.safetensors OUT.safetensors LOSS.json
    python -m benchmarks._colpali_side process FOLDER SAMPLES.safetensors TEXTS.json OUT.safetensors

`ColQwen2.from_pretrained(FOLDER)` embeds each side of INPUTS (`{side}_input_ids`, `_attention_mask`,
`_mm_token_type_ids`; an image side's `pixel_values` [B, patches, C] padded per image as ColQwen2Processor pads
them, and `image_grid_thw`); OUT gets the token embeddings, LOSS colpali-engine's ColbertLoss (its defaults:
temperature 0.02, scores over each query's length) on them, its ColbertPairwiseCELoss (temperature 1, the same
scores) and its ColbertPairwiseNegativeCELoss (temperature 0.02, in-batch weight 0.5) with each query's hard negative
the next query's document (the documents rolled by one). `process`: `ColQwen2Processor.from_pretrained(FOLDER)`
on the texts as queries and the uint8 HWC images of SAMPLES (`image0`, `image1`, ...) as pages.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> None:
    import torch
    from colpali_engine.loss import ColbertLoss, ColbertPairwiseCELoss, ColbertPairwiseNegativeCELoss
    from colpali_engine.models import ColQwen2
    from safetensors.torch import load_file, save_file

    if argv[0] == "process":
        process(*argv[1:])
        return
    folder, inputs, out, loss_file = argv
    model = ColQwen2.from_pretrained(folder, torch_dtype=torch.float32).eval()
    given = load_file(inputs)
    embeddings = {}
    with torch.no_grad():
        for side in ("query", "doc"):
            kwargs = {key.removeprefix(f"{side}_"): v for key, v in given.items() if key.startswith(f"{side}_")}
            embeddings[side] = model(**kwargs).float().contiguous()
        query, doc = embeddings["query"], embeddings["doc"]
        loss = ColbertLoss()(query, doc)
        pairwise = ColbertPairwiseCELoss()(query, doc)
        negatives = ColbertPairwiseNegativeCELoss()(query, doc, doc.roll(1, 0)[:, None])
    save_file(embeddings, out)
    losses = {"loss": float(loss), "pairwise": float(pairwise), "pairwise_negatives": float(negatives)}
    open(loss_file, "w").write(json.dumps({**losses, "dim": int(model.dim)}))


def process(folder: str, samples: str, texts: str, out: str) -> None:
    from colpali_engine.models import ColQwen2Processor
    from PIL import Image
    from safetensors.torch import load_file, save_file

    processor = ColQwen2Processor.from_pretrained(folder)
    images = load_file(samples)
    pages = [Image.fromarray(images[f"image{i}"].numpy()) for i in range(len(images))]
    result = {f"query_{k}": v for k, v in processor.process_queries(json.loads(open(texts).read())).items()}
    result.update({f"doc_{k}": v for k, v in processor.process_images(pages).items()})
    save_file({k: v.contiguous() for k, v in result.items()}, out)


if __name__ == "__main__":
    main(sys.argv[1:])
