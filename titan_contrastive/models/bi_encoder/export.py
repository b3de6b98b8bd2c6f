"""The bi_encoder's exports (`python -m titan_contrastive.export STEP --to ...`), one tower at a time (`--tower`).

- `sentence-transformers`: the tower with its tokenizer, Pooling (our mode), the folder's Dense
  layers as trained, Normalize and the run's prompts, what `SentenceTransformer(DIR)` loads (SPLADE: a
  SparseEncoder; inference-free SPLADE: a Router of the query weights and the masked LM, both sides at once;
  ColBERT: a MultiVectorEncoder, `multi_vector.write_multi_vector`, both sides at once). A run of two towers
  (`model.flavor = "dual"`) without `--tower` is a Router of both, each side by its own tower: `encode_query`
  and `encode_document` embed as the run's two sides;
- `hf`: the tower as a transformers folder with its tokenizer (`AutoModel.from_pretrained(DIR)`; an
  encoder-decoder's encoder: `AutoModelForTextEncoding`); refused for a folder with Dense layers;
- `peft`: the LoRA adapters alone as a PEFT folder (`PeftModel.from_pretrained(base, DIR)`, the
  base being the run's `[model] path`);
- `pylate`: a ColBERT run (`[model] pooling = "colbert"`) as a PyLate folder, both sides at once
  (`colbert.write_pylate`). PyLate pins an older
  sentence-transformers than the one installed, so the folder is read back by our PyLate reader
  (`colbert.read_pylate`, held to PyLate's computation by the tests; `benchmarks/pylate_interop.py` reads the
  folders with PyLate itself, in its own venv).

With LoRA the first two hold the merged weights (W + B A alpha / r, peft's `merge_and_unload`).
Each folder is loaded back by its library and must give the run's embeddings of fixed texts
(`models.export_check`; `titan_contrastive.export` installs the folder only then). `ADAPTER` is the
family's state-dict adapter: these writers, and no `[model] init_from` reader (the family starts
from `[model] path`).
"""

from __future__ import annotations

import copy
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from titan_contrastive.components.lora import lora_config
from titan_contrastive.config import ConfigError
from titan_contrastive.models.bi_encoder.args import BiEncoderArgs
from titan_contrastive.models.bi_encoder.colbert import colbert_embed, write_pylate
from titan_contrastive.models.bi_encoder.cut import cut_to
from titan_contrastive.models.bi_encoder.embedding import embed
from titan_contrastive.models.bi_encoder.folder import ST_POOLING_NAMES, read_text_folder
from titan_contrastive.models.bi_encoder.model import BiEncoder, build_tokenizer
from titan_contrastive.models.bi_encoder.multi_vector import write_multi_vector
from titan_contrastive.models.bi_encoder.tower import load_text_tower, text_model_class
from titan_contrastive.models.export_check import PROBE_TEXTS, compare, packed_tokens, refuse, reloaded
from titan_contrastive.models.registry import StateDictAdapter
from titan_contrastive.models.weights import read_ours

__all__ = ["ADAPTER", "FORMATS", "write"]

FORMATS = ("sentence-transformers", "hf", "peft", "pylate")


def adapted(args: Any, tower: nn.Module) -> Any:
    """A fresh base from the model folder with `tower`'s adapters, as a peft `PeftModel` (`args`: a bi_encoder's or
    qwen_vl's, whose folder's own code never runs)."""
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    base = load_text_tower(
        args.model_dir,
        getattr(args, "trust_remote_code", False),
        bool(getattr(args, "bidirectional", False)),
        getattr(args, "pooling", "") == "splade",
    )
    wrapped = get_peft_model(base, lora_config(args))
    adapters = {f"base_model.model.{k}": v for k, v in get_peft_model_state_dict(tower).items()}
    # what trained in full ([lora] modules_to_save), under the names peft saves them by
    adapters |= {
        f"base_model.model.{n}": p.detach()
        for n, p in tower.named_parameters()
        if p.requires_grad and ".lora_" not in n
    }
    result = set_peft_model_state_dict(wrapped, adapters)
    if result.unexpected_keys:  # peft skips what it does not place: a silent base model otherwise
        raise ValueError(f"peft placed no adapter for {result.unexpected_keys[:3]}; nothing was written")
    return wrapped.eval()


def plain_tower(args: Any, tower: nn.Module) -> nn.Module:
    """The tower as a plain transformers model: itself, or with LoRA its merged copy."""
    return adapted(args, tower).merge_and_unload() if args.lora_rank else tower


def _probe(model: BiEncoder, args: BiEncoderArgs, side: str, texts: list[str]) -> tuple[Tensor, Tensor]:
    """(the probe texts' ids as the run tokenizes them, the run's embeddings of them) for `side`."""
    tokenizer = build_tokenizer(args)
    ids = tokenizer.encode_queries(texts, args.query_length) if side == "query" else tokenizer.encode_docs(texts)
    with torch.no_grad():
        return ids, model.embed_side(side, ids)


def write(to: str, src: str, out: Path, side: str | None = None, layers: int = 0) -> None:
    """Write `side`'s tower of the bi_encoder step folder `src` as `to` into `out` (None: both of a two-tower run
    as a sentence-transformers Router, else the query tower), then load it back with its library and compare its
    embeddings of `PROBE_TEXTS` with the run's; `layers`: the towers cut to their first `layers` layers, a run's
    earlier exit (`cut.py`)."""
    family, args, model = read_ours(Path(src).expanduser())
    if family != "bi_encoder":
        refuse(f"{src}: a {family} checkpoint; --to {to} exports the bi_encoder family here")
    model.eval()
    if layers:
        if to not in ("sentence-transformers", "hf"):
            refuse(f"--layers {layers} --to {to}: a cut model goes --to sentence-transformers or --to hf, merged")
        model, args = cut_to(model, args, layers, plain_tower, _probe)
    both = side is None and not args.shared and to == "sentence-transformers"
    side = side or "query"
    tower = getattr(model, f"{side}_tower")
    texts = PROBE_TEXTS
    head = getattr(model, f"{side}_head")
    colbert = bool(model.colbert_sides)
    if colbert and to == "hf":
        refuse(
            "--to hf: this run is a ColBERT model (model.pooling='colbert'), whose projection a transformers folder "
            "cannot hold; use --to sentence-transformers (a MultiVectorEncoder), --to pylate or --to peft"
        )
    if not colbert and to == "pylate":
        refuse(
            "--to pylate: this run is not a ColBERT model (model.pooling='colbert'); --to pylate is for ColBERT runs"
        )
    if colbert and to != "peft":
        _write_colbert(model, args, out, to)
        return
    if to == "hf" and head is not None:
        refuse(
            f"--to hf: {args.path} ends in Dense modules, which a transformers folder cannot hold; use --to "
            "sentence-transformers"
        )
    static = model.static_query
    if static is not None and to != "sentence-transformers" and side == "query":
        refuse(
            f"--to {to} --tower query: this inference-free run embeds its queries by a weight per token, which a "
            f"{to} folder cannot hold; export the documents' masked LM (--tower doc), or both as a SparseEncoder "
            "(--to sentence-transformers)"
        )
    ids, want = _probe(model, args, side, texts)
    pad, skip = model.pad_id, model.prompt_skip[0 if side == "query" else 1]
    splade = (args.splade_pooling, args.splade_activation)
    check = partial(compare, to, side, want)
    if to == "peft":
        if not args.lora_rank:
            refuse("--to peft exports LoRA adapters; this run trained without [lora] (use --to hf)")
        from peft import PeftModel

        adapted(args, tower).save_pretrained(str(out))
        base = load_text_tower(args.model_dir, args.trust_remote_code, args.bidirectional, args.pooling == "splade")
        theirs = reloaded("peft", lambda: PeftModel.from_pretrained(base, str(out)).eval())
        with torch.no_grad():  # a head from the folder is frozen under LoRA; ColBERT's new one is not, kept as trained
            if colbert:
                got = colbert_embed(theirs, ids, pad, head, model.colbert_sides[0 if side == "query" else 1])
            else:
                got = embed(theirs, ids, pad, args.pooling, 0, head=head, skip=skip, splade=splade)
            check(got, "peft")
        return
    towers = {side: (plain_tower(args, tower), head)}
    if to == "hf":
        plain = towers[side][0]
        plain.save_pretrained(str(out))
        args.tokenizer.save_pretrained(str(out))
        auto = text_model_class(plain.config, str(out), args.pooling == "splade")
        trust = args.trust_remote_code  # the folder's code, copied beside the weights by save_pretrained
        theirs = reloaded("transformers", lambda: auto.from_pretrained(str(out), trust_remote_code=trust).eval())
        with torch.no_grad():
            check(embed(theirs, ids, pad, args.pooling, 0, skip=skip, splade=splade), "transformers")
        return
    if both:  # the doc side's tower and head beside the query side's
        towers["doc"] = (plain_tower(args, model.doc_tower), model.doc_head)
    _write_sentence_transformers(towers, args, out, None if static is None else static.weight)
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sparse_encoder import SparseEncoder

    trust = args.trust_remote_code
    splade = args.pooling == "splade"
    library = SparseEncoder if splade else SentenceTransformer
    theirs = reloaded("sentence-transformers", lambda: library(str(out), device="cpu", trust_remote_code=trust))
    sparse = {"convert_to_sparse_tensor": False} if splade else {}
    if static is not None or both:  # a Router: each side by its route, with its prompt
        for route, encode in (("query", theirs.encode_query), ("doc", theirs.encode_document)):
            got = encode(texts, convert_to_tensor=True, **sparse)
            compare(to, route, _probe(model, args, route, texts)[1], got, "sentence-transformers")
        return
    prompt = args.query_prompt if side == "query" else args.doc_prompt
    name = ("query" if side == "query" else "document") if prompt else None
    check(theirs.encode(texts, convert_to_tensor=True, prompt_name=name, **sparse), "sentence-transformers")


def _write_colbert(model: BiEncoder, args: BiEncoderArgs, out: Path, to: str) -> None:
    """A ColBERT run as a PyLate folder, read back by our PyLate reader, or as a sentence-transformers
    MultiVectorEncoder, read back by sentence-transformers: both sides' probe embeddings compared."""
    what = "a PyLate folder" if to == "pylate" else "a MultiVectorEncoder"
    if not args.shared:
        refuse(f"--to {to}: this run trained two towers (model.flavor=dual); {what} holds one model")
    writer = write_pylate if to == "pylate" else write_multi_vector
    try:
        late = read_text_folder(args.path).colbert
        writer(plain_tower(args, model.query_tower), model.query_head, args, late, out)
    except ConfigError as e:
        refuse(str(e))
    if to == "pylate":
        written = BiEncoderArgs(path=str(out), query_length=args.query_length)
        theirs = reloaded("our PyLate reader", lambda: BiEncoder(written.resolve()).eval())
    else:
        from sentence_transformers import MultiVectorEncoder

        trust = args.trust_remote_code
        library = reloaded(
            "sentence-transformers", lambda: MultiVectorEncoder(str(out), device="cpu", trust_remote_code=trust)
        )
    for side in ("query", "doc"):
        ids, want = _probe(model, args, side, PROBE_TEXTS)
        with torch.no_grad():
            if to == "pylate":
                compare(to, side, want.float(), theirs.embed_side(side, ids), "our PyLate reader")
                continue
            encode = library.encode_query if side == "query" else library.encode_document
            rows = [row.view(-1, model.token_dim) for row in want.float()]
            length = len(rows[0])
            ours = packed_tokens([row[(row != 0).any(1)] for row in rows], length)
            compare(
                to,
                side,
                ours,
                packed_tokens(encode(PROBE_TEXTS, convert_to_numpy=False), length),
                "sentence-transformers",
            )


def _write_sentence_transformers(
    towers: dict[str, tuple[nn.Module, nn.Sequential | None]], args: BiEncoderArgs, out: Path, static: Tensor | None
) -> None:
    """A SentenceTransformer folder of each side's (tower, head) in `towers` (one side; or query and doc, a Router of
    the two); SPLADE's a SparseEncoder, which with the `static` query weights of inference-free SPLADE routes queries
    to a SparseStaticEmbedding of them."""
    import tempfile

    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Router
    from sentence_transformers.sparse_encoder import SparseEncoder

    splade = args.pooling == "splade"
    prompts = {name: p for name, p in (("query", args.query_prompt), ("document", args.doc_prompt)) if p}
    with tempfile.TemporaryDirectory() as tmp:
        sides = {
            side: _tower_modules(plain, head, args, side if static is None else "doc", Path(tmp) / side)
            for side, (plain, head) in towers.items()
        }
        if static is not None:
            from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding

            documents = next(iter(sides.values()))  # the masked LM, whichever --tower named it
            mlm = documents[0]
            weight, tokenizer = static.detach().float().clone(), copy.deepcopy(mlm.tokenizer)
            # it tokenizes without special tokens: cut where the run's queries, which hold them, were cut
            tokenizer.model_max_length = args.query_length - tokenizer.num_special_tokens_to_add()
            query = SparseStaticEmbedding(tokenizer=tokenizer, weight=weight, frozen=False)
            modules = [Router.for_query_document(query_modules=[query], document_modules=documents)]
        elif len(sides) == 2:
            modules = [Router.for_query_document(query_modules=sides["query"], document_modules=sides["doc"])]
        else:
            modules = next(iter(sides.values()))
        library = SparseEncoder if splade else SentenceTransformer
        library(modules=modules, device="cpu", prompts=prompts).save(str(out))


def _tower_modules(plain: nn.Module, head: nn.Sequential | None, args: BiEncoderArgs, side: str, hf_dir: Path) -> list:
    """One tower's sentence-transformers modules, read from `plain` saved into `hf_dir`: the Transformer at `side`'s
    length, then our pooling, the folder's Dense layers and Normalize (SPLADE: the masked LM and SpladePooling)."""
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    plain.save_pretrained(str(hf_dir))
    args.tokenizer.save_pretrained(str(hf_dir))
    trust = {"trust_remote_code": args.trust_remote_code}
    length = args.query_length if side == "query" else args.doc_length
    if args.pooling == "splade":  # a SparseEncoder: the masked LM, then SpladePooling
        mlm = Transformer(
            str(hf_dir), max_seq_length=length, transformer_task="fill-mask", model_kwargs=trust, config_kwargs=trust
        )
        return [mlm, SpladePooling(args.splade_pooling or "max", args.splade_activation or "relu")]
    dense = [
        Dense(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            activation_function=type(activation)(),
            init_weight=linear.weight.detach().clone(),
            init_bias=None if linear.bias is None else linear.bias.detach().clone(),
        )
        for linear, activation in head or []
    ]
    encoder = Transformer(
        str(hf_dir), max_seq_length=length, model_kwargs=trust, config_kwargs=trust, processor_kwargs=trust
    )
    mode = ST_POOLING_NAMES.get(args.pooling, args.pooling)
    pooling = Pooling(plain.config.hidden_size, pooling_mode=mode, include_prompt=args.include_prompt)
    return [encoder, pooling, *dense, Normalize()]


ADAPTER = StateDictAdapter(writes={to: partial(write, to) for to in FORMATS})
