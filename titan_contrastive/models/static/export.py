"""The static family's export (`python -m titan_contrastive.export STEP --to sentence-transformers`): one table
(`--tower query|doc`, the same one when shared) as a sentence-transformers folder of a StaticEmbedding and a
Normalize, with the run's prompts; its tokenizer cuts texts at that side's length, as the run did. The folder is
loaded back by `SentenceTransformer(DIR)` and must embed the probe texts as the run does (`models.export_check`).
`ADAPTER` is the family's state-dict adapter: this writer, and no `[model] init_from` reader (the family starts from
`[model] path`)."""

from __future__ import annotations

from pathlib import Path

import torch

from titan_contrastive.models.export_check import PROBE_TEXTS, compare, refuse, reloaded
from titan_contrastive.models.registry import StateDictAdapter
from titan_contrastive.models.static.folder import read_static_folder, read_tokenizer
from titan_contrastive.models.static.model import build_tokenizer
from titan_contrastive.models.weights import read_ours

__all__ = ["ADAPTER", "write"]


def write(src: str, out: Path, side: str = "query") -> None:
    """Write `side`'s table of the static step folder `src` into `out` as a SentenceTransformer folder, then load
    it back and compare its embeddings of `PROBE_TEXTS` (with the side's prompt) with the run's."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, StaticEmbedding

    family, args, model = read_ours(Path(src).expanduser())
    if family != "static":
        refuse(f"{src}: a {family} checkpoint; this writer exports the static family")
    model.eval()
    tokenizer = build_tokenizer(args)
    length = args.query_length if side == "query" else args.doc_length
    ids = tokenizer.encode_queries(PROBE_TEXTS, length) if side == "query" else tokenizer.encode_docs(PROBE_TEXTS)
    with torch.no_grad():
        want = model.embed_side(side, ids).float()
    backend = read_tokenizer(read_static_folder(args.path))
    backend.no_padding()
    backend.enable_truncation(max_length=length)  # where the run cut this side's texts
    table = getattr(model, f"{side}_embedding").weight.detach().float().clone()
    prompts = {name: p for name, p in (("query", args.query_prompt), ("document", args.doc_prompt)) if p}
    modules = [StaticEmbedding(backend, embedding_weights=table), Normalize()]
    SentenceTransformer(modules=modules, device="cpu", prompts=prompts).save(str(out))
    theirs = reloaded("sentence-transformers", lambda: SentenceTransformer(str(out), device="cpu"))
    prompt = args.query_prompt if side == "query" else args.doc_prompt
    name = ("query" if side == "query" else "document") if prompt else None
    got = theirs.encode(PROBE_TEXTS, convert_to_tensor=True, prompt_name=name)
    compare("sentence-transformers", side, want, got, "sentence-transformers")


ADAPTER = StateDictAdapter(writes={"sentence-transformers": write})
