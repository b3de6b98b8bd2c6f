"""A qwen_vl run as a sentence-transformers folder (`--to sentence-transformers`): what `SentenceTransformer(DIR)`
(a ColQwen run: `MultiVectorEncoder(DIR)`) loads, `encode_query` and `encode_document` embedding as the run's two
sides (a side of several kinds, with `[data] retrieval_modes`, each kind as the run read it: `side_template`).

The folder holds the tower (LoRA merged) with its tokenizer and image processor (the run's `min_pixels` /
`max_pixels`), a chat template that writes the run's templates (`chat_template.py`), then the run's Pooling (last
token or mean) and Normalize, or ColQwen's projection on every token and Normalize. sentence-transformers makes
every input a chat message (a text, a PIL image, or `{"image": ..., "text": ...}`) and renders it with that
template, which is told the task: "query" takes the query template, "document" the document's. Without a task, the
document's when it reads just the input's kinds (an image, a text), else the query's when it does, else the one
that reads an image if the input has one. One image per input, as in training.

transformers builds a Qwen-VL processor with its video processor, which imports torchvision: writing the folder,
and loading it, need torchvision beside torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from torch import Tensor, nn

from titan_contrastive.datasets.retrieval import SIDES, side_kinds
from titan_contrastive.models.export_check import compare, packed_tokens, refuse, reloaded
from titan_contrastive.models.qwen_vl.chat_template import chat_template
from titan_contrastive.models.qwen_vl.model import QwenVLArgs
from titan_contrastive.models.qwen_vl.processor import VLProcessor
from titan_contrastive.models.qwen_vl.templates import side_template

__all__ = ["check_loadable", "check_reloaded", "write_sentence_transformers"]


def _side_inputs(
    processor: VLProcessor, kind: str, images: Sequence[np.ndarray] | None, texts: Sequence[str]
) -> list[object]:
    """A side's samples as sentence-transformers takes them: texts, PIL images, or {"image", "text"} dicts (`kind`
    text, image or multi), each text cut as the run cuts it."""
    from PIL import Image

    cut = [processor.cut(t) for t in texts]
    if kind == "text":
        return cut
    pictures = [Image.fromarray(x) for x in images or ()]
    return pictures if kind == "image" else [{"image": p, "text": t} for p, t in zip(pictures, cut, strict=True)]


def check_loadable() -> None:
    """Refuse the export in one line where torchvision does not import: the folder would not load."""
    try:
        import torchvision  # noqa: F401 - transformers' Qwen-VL processor needs it to load
    except Exception as e:  # noqa: BLE001 - not installed, or a build that does not import beside this torch
        refuse(
            f"--to sentence-transformers: sentence-transformers loads a Qwen-VL folder through transformers' "
            f"Qwen-VL processor, whose video processor needs torchvision ({type(e).__name__}); install the "
            "torchvision that pairs with this torch, or use --to hf"
        )


def write_sentence_transformers(plain: nn.Module, head: nn.Linear | None, args: QwenVLArgs, out: Path) -> None:
    """`plain` (the tower, LoRA merged) with the run's processing and chat template, saved into `out` as a
    SentenceTransformer (then the run's Pooling and Normalize) or, with ColBERT's projection `head`, a
    MultiVectorEncoder (then `head` on every token, every token kept, Normalize); where `check_loadable` passes."""
    from sentence_transformers import MultiVectorEncoder, SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask
    from sentence_transformers.sentence_transformer.modules import Pooling

    plain.save_pretrained(str(out))
    processor = VLProcessor(args.path, args.min_pixels, args.max_pixels, args.text_length)
    query, doc = (
        list(dict.fromkeys(side_template(args, side, m) for m in args.modes or (args.mode,))) for side in SIDES
    )
    processor.tokenizer.chat_template = chat_template(query, doc)
    processor.tokenizer.save_pretrained(str(out))
    processor.images.save_pretrained(str(out))
    hidden = {"method": "forward", "method_output_name": "last_hidden_state"}  # texts and images, not videos
    modalities = {"text": hidden, "image": hidden, "message": {**hidden, "format": "structured"}}
    encoder = Transformer(str(out), modality_config=modalities, module_output_name="token_embeddings")
    if head is None:
        mode = {"last_token": "lasttoken"}.get(args.pooling, args.pooling)
        pooling = Pooling(plain.config.get_text_config().hidden_size, pooling_mode=mode)
        SentenceTransformer(modules=[encoder, pooling, Normalize()], device="cpu").save(str(out))
    else:
        tokens = {"module_input_name": "token_embeddings", "module_output_name": "token_embeddings"}
        dense = Dense(
            head.in_features,
            head.out_features,
            bias=True,
            activation_function=nn.Identity(),
            init_weight=head.weight.detach().float().clone(),
            init_bias=head.bias.detach().float().clone(),
            **tokens,
        )
        modules = [encoder, dense, MultiVectorMask(skiplist_words=[]), Normalize(**tokens)]
        MultiVectorEncoder(modules=modules, device="cpu").save(str(out))
    # the processor is loaded with the PIL image processor the run's pixels came from (transformers' default where
    # torchvision imports is its torchvision one, which resizes with another filter); the Transformer module reads
    # `processor_kwargs` from its config file but does not write them
    config = out / "sentence_bert_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "processor_kwargs": {"use_fast": False}}, indent=2))


def check_reloaded(
    out: Path, args: QwenVLArgs, probe: dict[str, tuple], rows: dict[str, list[int]], want: list[Tensor]
) -> None:
    """Load `out` with sentence-transformers and refuse unless its query and document embeddings of `rows` of the
    probe's raw samples (`probe[side]`: images, texts) are `want` (the run's, a ColQwen run's tokens laid out)."""
    from sentence_transformers import MultiVectorEncoder, SentenceTransformer

    library = MultiVectorEncoder if args.token_dim else SentenceTransformer
    model = reloaded("sentence-transformers", lambda: library(str(out), device="cpu"))
    processor = VLProcessor(args.path, args.min_pixels, args.max_pixels, args.text_length)
    kinds = side_kinds(args.mode)
    encode = {"query": model.encode_query, "doc": model.encode_document}
    for side, mine in zip(SIDES, want):
        images, texts = probe[side]
        samples = _side_inputs(processor, kinds[side], images, texts)
        got = encode[side]([samples[i] for i in rows[side]], batch_size=2)
        if args.token_dim:  # each sample's tokens: ours lay them out with zero vectors after, theirs leave those out
            mine = packed_tokens([t[(t != 0).any(1)] for t in mine.view(len(mine), -1, args.token_dim)])
            got = packed_tokens(got)
        compare("sentence-transformers", side, mine, got, "sentence-transformers")
