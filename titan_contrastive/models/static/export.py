"""The static family's exports (`python -m titan_contrastive.export STEP --to FORMAT`), one table each (`--tower
query|doc`, the same one when shared):

- `sentence-transformers`: a StaticEmbedding and a Normalize, with the run's prompts; its tokenizer cuts texts at that
  side's length, as the run did. Loaded back by `SentenceTransformer(DIR)`, it must embed the probe texts as the run.
  A run of two tables (`model.flavor = "dual"`) without `--tower` is a Router of both, each side by its own table
  (`encode_query`, `encode_document`).
- `model2vec`: model2vec's own folder (`StaticModel.save_pretrained`), normalizing, cut at that side's length. A
  model2vec model leaves unknown tokens out of a text's mean, where StaticEmbedding and the run count them: loaded
  back by `StaticModel.from_pretrained(DIR)`, it must embed the probe texts as the run does with those tokens left
  out. It holds no prompts: a side with one is refused.

The checks are `models.export_check`'s. `ADAPTER` is the family's state-dict adapter: these writers, and no
`[model] init_from` reader (the family starts from `[model] path`)."""

from __future__ import annotations

from pathlib import Path

import torch

from titan_contrastive.models.export_check import PROBE_TEXTS, compare, refuse, reloaded
from titan_contrastive.models.registry import StateDictAdapter
from titan_contrastive.models.static.args import StaticArgs
from titan_contrastive.models.static.folder import read_static_folder, read_tokenizer
from titan_contrastive.models.static.model import PAD, StaticEmbedder, build_tokenizer
from titan_contrastive.models.weights import read_ours

__all__ = ["ADAPTER", "write", "write_model2vec"]


def _side(src: str, side: str) -> tuple[StaticArgs, StaticEmbedder, int, str]:
    """(args, model in eval mode, the side's length, its prompt) of the static step folder `src`."""
    family, args, model = read_ours(Path(src).expanduser())
    if family != "static":
        refuse(f"{src}: a {family} checkpoint; this writer exports the static family")
    model.eval()
    return args, model, _length(args, side), args.query_prompt if side == "query" else args.doc_prompt


def _length(args: StaticArgs, side: str) -> int:
    """The tokens the run kept of a `side` text."""
    return args.query_length if side == "query" else args.doc_length


def _run_embeddings(args: StaticArgs, model: StaticEmbedder, side: str, unknown: int | None = None) -> torch.Tensor:
    """The run's `side` embeddings of `PROBE_TEXTS` (its prompt, its length); token `unknown` left out of the mean."""
    tokenizer = build_tokenizer(args)
    ids = (
        tokenizer.encode_queries(PROBE_TEXTS, args.query_length)
        if side == "query"
        else tokenizer.encode_docs(PROBE_TEXTS)
    )
    if unknown is not None:
        ids = ids.masked_fill(ids == unknown, PAD)
    with torch.no_grad():
        return model.embed_side(side, ids).float()


def _table(model: StaticEmbedder, side: str) -> torch.Tensor:
    return getattr(model, f"{side}_embedding").weight.detach().float().clone()


def write(src: str, out: Path, side: str | None = None) -> None:
    """Write `side`'s table of the static step folder `src` into `out` as a SentenceTransformer folder (None: both
    tables of a two-table run as a Router, else the query table), then load it back and compare its embeddings of
    `PROBE_TEXTS` (with each side's prompt) with the run's."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Router
    from sentence_transformers.sentence_transformer.modules import Normalize, StaticEmbedding

    args, model, _, prompt = _side(src, side or "query")
    sides = ["query", "doc"] if side is None and not args.shared else [side or "query"]

    def table(key: str) -> StaticEmbedding:
        backend = read_tokenizer(read_static_folder(args.path), args.trust_remote_code)
        backend.no_padding()
        backend.enable_truncation(max_length=_length(args, key))  # where the run cut this side's texts
        return StaticEmbedding(backend, embedding_weights=_table(model, key))

    if len(sides) == 2:
        modules = [
            Router.for_query_document(query_modules=[table("query")], document_modules=[table("doc")]),
            Normalize(),
        ]
    else:
        modules = [table(sides[0]), Normalize()]
    prompts = {name: p for name, p in (("query", args.query_prompt), ("document", args.doc_prompt)) if p}
    SentenceTransformer(modules=modules, device="cpu", prompts=prompts).save(str(out))
    theirs = reloaded("sentence-transformers", lambda: SentenceTransformer(str(out), device="cpu"))
    if len(sides) == 2:  # each side by its route, with its prompt
        for key, encode in (("query", theirs.encode_query), ("doc", theirs.encode_document)):
            got = encode(PROBE_TEXTS, convert_to_tensor=True)
            compare("sentence-transformers", key, _run_embeddings(args, model, key), got, "sentence-transformers")
        return
    name = ("query" if sides[0] == "query" else "document") if prompt else None
    got = theirs.encode(PROBE_TEXTS, convert_to_tensor=True, prompt_name=name)
    compare("sentence-transformers", sides[0], _run_embeddings(args, model, sides[0]), got, "sentence-transformers")


def write_model2vec(src: str, out: Path, side: str | None = None) -> None:
    """Write `side`'s table of the static step folder `src` into `out` as a model2vec folder, then load it back
    and compare its embeddings of `PROBE_TEXTS` with the run's, unknown tokens left out (as model2vec leaves them)."""
    from model2vec import StaticModel

    side = side or "query"
    args, model, length, prompt = _side(src, side)
    if prompt:
        refuse(
            f"--to model2vec: {src} prepends the {side} prompt {prompt!r}, which a model2vec model cannot hold; "
            "export --to sentence-transformers (it keeps the prompts)"
        )
    backend = read_tokenizer(read_static_folder(args.path), args.trust_remote_code)
    backend.no_padding()
    backend.no_truncation()  # model2vec cuts at its max_length
    mine = StaticModel(_table(model, side).numpy(), backend, normalize=True, max_length=length)
    mine.save_pretrained(out)
    theirs = reloaded("model2vec", lambda: StaticModel.from_pretrained(out, force_download=False))
    got = theirs.encode(PROBE_TEXTS)
    compare("model2vec", side, _run_embeddings(args, model, side, theirs.unk_token_id), got, "model2vec")


ADAPTER = StateDictAdapter(writes={"sentence-transformers": write, "model2vec": write_model2vec})
