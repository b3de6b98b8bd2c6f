"""The qwen_vl family's exports (`python -m titan_contrastive.export STEP --to ...`) and its
state-dict adapter.

- `sentence-transformers`: the tower (LoRA merged) as a `SentenceTransformer` folder (a ColBERT run's: a
  `MultiVectorEncoder`) whose chat template writes the run's query and document templates (`st_folder.py`;
  loading it needs torchvision);
- `hf`: the tower as a transformers folder with its tokenizer and image processor (at the run's
  `min_pixels` / `max_pixels`; `AutoModel.from_pretrained(DIR)`), with LoRA the merged weights
  (peft's `merge_and_unload`);
- `peft`: the LoRA adapters alone (`PeftModel.from_pretrained(base, DIR)` over the run's
  `[model] path`);
- `colpali`: a ColBERT run (`[model] pooling = "colbert"`) as colpali-engine's ColQwen folder
  (`ColQwen2.from_pretrained(DIR)`, `colpali.py`), with LoRA the merged weights (transformers'
  `ColQwen2ForRetrieval` is not written: it gives image tokens text positions, not the run's M-RoPE).

Each folder is loaded back and must give the run's query and document embeddings (a ColBERT run's
tokens) of a few probe captions and images of different sizes (`models.export_check`).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import torch

from titan_contrastive.datasets.retrieval import SIDES
from titan_contrastive.models.bi_encoder.export import adapted, plain_tower
from titan_contrastive.models.bi_encoder.folder import load_config
from titan_contrastive.models.bi_encoder.tower import load_text_tower
from titan_contrastive.models.export_check import PROBE_TEXTS, compare, refuse, reloaded
from titan_contrastive.models.qwen_vl.colpali import CLASSES, reload_colpali, write_colpali
from titan_contrastive.models.qwen_vl.model import QwenVLArgs, vl_embed
from titan_contrastive.models.qwen_vl.processor import PAD, VLProcessor
from titan_contrastive.models.qwen_vl.st_folder import (
    check_loadable,
    check_reloaded,
    write_sentence_transformers,
)
from titan_contrastive.models.registry import StateDictAdapter
from titan_contrastive.models.weights import read_ours

__all__ = ["ADAPTER", "FORMATS", "write"]

FORMATS = ("sentence-transformers", "hf", "peft", "colpali")


def _probe() -> dict[str, tuple[list[np.ndarray], list[str]]]:
    """Probe samples of every field a side may read, per side: images of different sizes and texts (one empty)."""
    g = np.random.default_rng(0)
    images = [g.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((32, 48), (64, 64), (40, 96))]
    return {"query": (images, PROBE_TEXTS), "doc": (images[::-1], PROBE_TEXTS[::-1])}


def _embeddings(
    tower: torch.nn.Module, args: QwenVLArgs, batch: dict[str, torch.Tensor], head: torch.nn.Module | None = None
) -> list[torch.Tensor]:
    """The query and document embeddings of the probe batch, each side with its images if it has any; a ColBERT
    run's tokens through `head`."""
    out = []
    with torch.no_grad():
        for side in SIDES:
            grid = batch[f"{side}_image_grid_thw"]
            images = (batch[f"{side}_pixel_values"].to(tower.dtype), grid) if len(grid) else (None, None)
            late = (head, args.side_tokens[side]) if head is not None else None
            out.append(vl_embed(tower, batch[side], args.pooling, *images, late))
    return out


def _check_colpali(to: str, args: QwenVLArgs) -> None:
    """A ColBERT run goes `--to colpali` at colpali-engine's width, or `--to sentence-transformers`; `--to colpali`
    takes only it: else a one-line refusal."""
    if to != "sentence-transformers" and bool(args.token_dim) != (to == "colpali"):
        refuse(
            f"--to {to}: this run is a ColBERT run (model.pooling='colbert'); use --to colpali or "
            "--to sentence-transformers"
            if args.token_dim
            else "--to colpali: this run is not a ColBERT run (model.pooling='colbert'); use --to "
            "sentence-transformers, --to hf or --to peft"
        )
    model_type = load_config(args.path).model_type
    name, width = CLASSES.get(model_type, ("", 0))
    if to == "colpali" and args.colbert_dim != width:
        fix = f"train with model.colbert_dim={width}" if width else "no ColQwen class holds it"
        refuse(
            f"--to colpali: colpali-engine's {name or model_type} has {width or 'no'}-wide tokens, this run's are "
            f"{args.colbert_dim}; {fix}"
        )


def _save_processing(args: QwenVLArgs, out: Path) -> None:
    """The folder's tokenizer and its image processor at the run's `min_pixels` / `max_pixels`."""
    processor = VLProcessor(args.path, args.min_pixels, args.max_pixels, args.text_length)
    processor.tokenizer.save_pretrained(str(out))
    processor.images.save_pretrained(str(out))


def write(to: str, src: str, out: Path, tower_name: str = "") -> None:
    """Write the qwen_vl step folder `src` as `to` into `out`, then load it back and compare embeddings."""
    family, args, model = read_ours(Path(src).expanduser())
    if family != "qwen_vl":
        refuse(f"{src}: a {family} checkpoint; --to {to} exports the qwen_vl family here")
    _check_colpali(to, args)
    if to == "sentence-transformers":
        check_loadable()
    model.eval()
    probe = _probe()
    batch = args.processor().sides(*probe["query"], *probe["doc"])
    want = _embeddings(model.tower, args, batch, model.head)
    head = None
    if to == "colpali":
        write_colpali(plain_tower(args, model.tower), model.head, out)
        _save_processing(args, out)
        theirs, head = reloaded("transformers", lambda: reload_colpali(out))
        library = "transformers"
    elif to == "peft":
        if not args.lora_rank:
            refuse("--to peft exports LoRA adapters; this run trained without [lora] (use --to hf)")
        from peft import PeftModel

        adapted(args, model.tower).save_pretrained(str(out))
        theirs = reloaded("peft", lambda: PeftModel.from_pretrained(load_text_tower(args.path), str(out)).eval())
        library = "peft"
    elif to == "sentence-transformers":
        write_sentence_transformers(plain_tower(args, model.tower), model.head, args, out)
        rows = {side: (batch[side] != PAD).any(1).nonzero().flatten().tolist() for side in SIDES}  # not the empty
        check_reloaded(out, args, probe, rows, [mine[rows[side]] for side, mine in zip(SIDES, want)])
        return
    else:
        from transformers import AutoModel

        plain_tower(args, model.tower).save_pretrained(str(out))
        _save_processing(args, out)
        theirs = reloaded("transformers", lambda: AutoModel.from_pretrained(str(out)).eval())
        library = "transformers"
    for side, mine, got in zip(SIDES, want, _embeddings(theirs, args, batch, head)):
        compare(to, side, mine, got, library)


ADAPTER = StateDictAdapter(writes={to: partial(write, to) for to in FORMATS})
