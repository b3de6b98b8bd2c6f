"""`python -m titan_contrastive.evaluate MODEL [--beir DIR] [--sts FILE] [--out FILE]`: a retrieval model's metrics.

MODEL is one of our bi_encoder or qwen_vl step folders (`.../checkpoint/step-N`, LoRA runs included), a
model folder the bi_encoder family loads (`[model] path`: a transformers or sentence-transformers
folder, or a hub id already in the local cache), or a Qwen-VL folder (a ColQwen one too: its projection makes it
late interaction; `--query-prompt`, `--doc-prompt`, `--max-pixels` as `[model]` / `[data]` set them in a run).
DIR is a local BEIR folder (`corpus.jsonl`, `queries.jsonl`, `qrels/{split}.tsv`; a corpus of page images; ViDoRe's
sets saved to disk: `datasets/beir_folder.py`), by default the bundled WordNet set. Prints nDCG@5/10,
MRR@10, MAP@100 and Recall@1/5/10/100 as JSON (`components/beir_eval.py`: the figures
sentence-transformers' InformationRetrievalEvaluator gives; `--graded`: nDCG as pytrec_eval, MTEB and ViDoRe
give it; `--pool-factor`: a late-interaction model's documents token-pooled, `components/token_pooling.py`;
`--precision int8 ubinary`: also with the corpus quantized, `components/quantized_search.py`);
with `--sts FILE` (scored sentence pairs, `[eval] sts_path`'s format) also `sts/pearson_cosine` and
`sts/spearman_cosine`, as its EmbeddingSimilarityEvaluator gives them (`components/sts_eval.py`); with `--reranking
FILE` (rows of a query, its positives and negatives) `reranking/map`, `mrr@10` and `ndcg@10`, as its
RerankingEvaluator gives them (`components/reranking_eval.py`); with `--clustering FILE` (rows of sentences and
labels) `clustering/v_measure`, as MTEB's ClusteringEvaluator gives it (`components/clustering_eval.py`); with
`--pair-classification FILE` (sentence pairs labelled 0 or 1) `pair_classification/cosine_ap`, `..._accuracy`,
`..._f1`, ..., as its BinaryClassificationEvaluator gives them (`components/pair_classification_eval.py`); with
`--triplets FILE` (rows of an anchor, a positive and a negative) `triplet/cosine_accuracy`, as its TripletEvaluator
gives it (`components/triplet_eval.py`); with `--classification DIR` (a folder of train and test rows of a text and
its label) `classification/accuracy`, `f1`, ..., as MTEB's logistic-regression classification gives them
(`components/classification_eval.py`); with `--mmeb DIR`
(a Qwen-VL model: VLM2Vec's MMEB-eval sets, `[eval] mmeb_path`'s) each set's `mmeb/.../hit@1`
(`components/mmeb_eval.py`), BEIR then only where `--beir` is given; `--out` writes them to a file too.

Under torchrun (`torchrun --nproc_per_node=N -m titan_contrastive.evaluate ...`) every process
holds the model and embeds its shard of the queries and the corpus; the results are the same as
on one process. Bad input is one `error: ...` line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from titan_contrastive.atomic_write import write_text_atomically

DTYPES = ("float32", "bfloat16", "float16", "float64")
VL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
"""The model types of Qwen-VL folders, read by the qwen_vl family."""
VL_OPTIONS = ("query_prompt", "doc_prompt", "max_pixels", "min_pixels", "retrieval_mode")
"""The command's options that describe how a Qwen-VL folder embeds (a step folder's run says it)."""


def is_vl_folder(src: str) -> bool:
    """Whether `src` is a Qwen-VL model folder (its config.json's model type, or that of the model a retrieval wrapper
    holds: transformers' ColQwen2, `bi_encoder.folder.WRAPPERS`)."""
    from titan_contrastive.models.bi_encoder.folder import WRAPPERS

    config = Path(src).expanduser() / "config.json"
    try:
        given = json.loads(config.read_text())
        inner = given.get(WRAPPERS[given.get("model_type")][0], {}) if given.get("model_type") in WRAPPERS else given
        return inner.get("model_type") in VL_TYPES
    except (OSError, ValueError, AttributeError):
        return False


def load_vl_model(src: str, **options: Any) -> tuple[Any, Any]:
    """(args, model in eval mode) of a Qwen-VL folder, set up as a qwen_vl run with these options would set it up
    (`QwenVLArgs.update_from_config`: the same checks, the same one-line errors); late interaction where the folder
    has ColPali's projection. `options`: any of `VL_OPTIONS` and `query_length` (unset or empty: the defaults)."""
    from titan_contrastive.config import parse_args
    from titan_contrastive.models.qwen_vl.colpali import read_projection
    from titan_contrastive.models.qwen_vl.model import QwenVLArgs, QwenVLEmbedder

    pooling = "colbert" if read_projection(src) else "last_token"
    keys = {
        "query_prompt": "model.query_prompt",
        "doc_prompt": "model.doc_prompt",
        "query_length": "data.context_length",
    }
    cli = [f"--{keys.get(name, f'data.{name}')}={value}" for name, value in options.items() if value]
    cfg = parse_args(["--model.name=qwen_vl", f"--model.path={src}", f"--model.pooling={pooling}", *cli])
    args = QwenVLArgs().update_from_config(cfg)
    return args, QwenVLEmbedder(args).eval()


def load_text_model(src: str, query_length: int, doc_length: int, trust: bool = False) -> tuple[Any, Any]:
    """(args, model in eval mode): a step folder's bi_encoder (or qwen_vl), or a fresh one on a model folder (`trust`:
    its own code may run, `[model] trust_remote_code`)."""
    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs
    from titan_contrastive.models.bi_encoder.colbert import colbert_sides
    from titan_contrastive.models.bi_encoder.folder import read_text_folder

    if (Path(src).expanduser() / "manifest.json").is_file():
        import dataclasses

        from titan_contrastive.models.weights import WeightsError, read_ours

        family, args, model = read_ours(Path(src))
        if family == "qwen_vl":
            return args, model.eval()
        if family != "bi_encoder":
            raise WeightsError(f"{src}: a {family} checkpoint; retrieval evaluation reads bi_encoder and qwen_vl ones")
        args = dataclasses.replace(args, query_length=query_length or args.query_length)
        if doc_length:
            args = dataclasses.replace(args, doc_length=doc_length)
        if model.colbert_sides:  # ColBERT's documents come out at the new length
            model.colbert_sides = colbert_sides(args, read_text_folder(args.path))
        return args, model.eval()
    late = read_text_folder(src).colbert  # a PyLate folder's query length, else 64
    query_length = query_length or (late.query_length if late else 64)
    args = BiEncoderArgs(path=src, query_length=query_length, trust_remote_code=trust).resolve(doc_length=doc_length)
    return args, BiEncoder(args).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_contrastive.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a bi_encoder step folder, or a transformers / sentence-transformers folder")
    parser.add_argument("--beir", help="a BEIR folder (default: the bundled WordNet set, unless --mmeb alone)")
    parser.add_argument(
        "--split", default="test", help="the qrels split (qrels/{split}.tsv); several: a,b or * (default: test)"
    )
    parser.add_argument("--batch-size", type=int, default=256, help="texts per forward (default: 256)")
    parser.add_argument("--query-length", type=int, default=0, help="query tokens (default: the run's, else 64)")
    parser.add_argument("--doc-length", type=int, default=0, help="document tokens (default: the run's / folder's)")
    parser.add_argument("--sts", default="", help="also semantic similarity on this file of scored sentence pairs")
    parser.add_argument("--sts-split", default="test", help="the split of a saved dataset --sts reads (default: test)")
    parser.add_argument("--reranking", default="", help="also reranking: rows of a query, positives and negatives")
    parser.add_argument("--clustering", default="", help="also clustering (MTEB's): rows of sentences and labels")
    parser.add_argument("--pair-classification", default="", help="also pair classification: pairs labelled 0/1")
    parser.add_argument("--triplets", default="", help="also triplet accuracy: rows of anchor, positive, negative")
    parser.add_argument(
        "--classification", default="", help="also classification (MTEB's): a folder of train and test text/label rows"
    )
    parser.add_argument(
        "--classification-per-label", type=int, default=8, help="train rows per label a fit takes (default: 8)"
    )
    parser.add_argument(
        "--dims", type=int, nargs="+", default=[], help="also at the embeddings' first m dims (Matryoshka), per m"
    )
    parser.add_argument("--out", type=Path, help="also write the metrics (JSON) to this file")
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="run the code a model folder ships (config.json auto_map)"
    )
    parser.add_argument("--graded", action="store_true", help="nDCG with the qrels' grades as gains (pytrec_eval's)")
    parser.add_argument(
        "--pool-factor", type=float, default=1.0, help="late interaction: pool each document's tokens to ~1/F of them"
    )
    parser.add_argument("--pool-protected", type=int, default=1, help="leading tokens kept out of it (default: 1)")
    parser.add_argument(
        "--precision",
        nargs="+",
        default=[],
        choices=("int8", "ubinary"),
        help="also with the corpus quantized to each (sentence-transformers' quantization; needs usearch)",
    )
    parser.add_argument(
        "--dtype", default="float32", choices=DTYPES, help="the model's weights and inputs (default: float32)"
    )
    qwen = parser.add_argument_group("a Qwen-VL folder (a step folder's run sets these)")
    qwen.add_argument("--query-prompt", default="", help="the queries' template ([model] query_prompt)")
    qwen.add_argument(
        "--doc-prompt", default="", help="the documents' template, {image} for a page ([model] doc_prompt)"
    )
    qwen.add_argument("--max-pixels", type=int, default=0, help="[data] max_pixels (default: the folder's)")
    qwen.add_argument("--min-pixels", type=int, default=0, help="[data] min_pixels (default: the folder's)")
    qwen.add_argument("--retrieval-mode", default="", help="t2i (default: pages) or t2t ([data] retrieval_mode)")
    qwen.add_argument("--mmeb", default="", help="MMEB-eval sets: a file or a folder of them ([eval] mmeb_path)")
    qwen.add_argument("--mmeb-image-root", default="", help="the folder their image paths are relative to")
    opts = parser.parse_args(argv)
    import torch
    import torch.distributed as dist

    from titan_contrastive import exit_codes, failures
    from titan_contrastive.components.beir_eval import (
        device_forward,
        evaluate_sets,
        load_beir,
        pair_embedders,
        side_embedders,
    )
    from titan_contrastive.components.classification_eval import evaluate_classification, load_classification
    from titan_contrastive.components.clustering_eval import evaluate_clustering, load_clustering
    from titan_contrastive.components.mmeb_eval import evaluate_mmeb, mode_embedders
    from titan_contrastive.components.pair_classification_eval import (
        evaluate_pair_classification,
        load_pair_classification,
    )
    from titan_contrastive.components.reranking_eval import evaluate_reranking
    from titan_contrastive.components.sts_eval import evaluate_sts, load_sts
    from titan_contrastive.components.triplet_eval import evaluate_triplets, load_triplets
    from titan_contrastive.config.evaluation import EVAL_SETS
    from titan_contrastive.datasets.mmeb_sets import read_mmeb
    from titan_contrastive.datasets.reranking_sets import read_reranking
    from titan_contrastive.models.bi_encoder import build_tokenizer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu")
    try:
        if opts.batch_size < 1 or opts.classification_per_label < 1:
            raise ValueError(
                f"--batch-size {opts.batch_size} --classification-per-label {opts.classification_per_label}: use "
                "integers >= 1"
            )
        if not 1 <= opts.pool_factor < float("inf") or opts.pool_protected < 0:
            raise ValueError(
                f"--pool-factor {opts.pool_factor} --pool-protected {opts.pool_protected}: use a factor >= 1 "
                "(1 = no pooling) and an integer >= 0"
            )
        beir = opts.beir if opts.beir is not None else "" if opts.mmeb else "bundled"
        sets = load_beir(beir, opts.split) if beir else {}
        mmeb = read_mmeb(opts.mmeb, opts.mmeb_image_root, ("--mmeb", "--mmeb-image-root")) if opts.mmeb else {}
        sts = load_sts(opts.sts, opts.sts_split) if opts.sts else None
        reranking = read_reranking(opts.reranking, key="--reranking") if opts.reranking else None
        clustering = load_clustering(opts.clustering, key="--clustering") if opts.clustering else None
        pairs = opts.pair_classification
        pairs = load_pair_classification(pairs, key="--pair-classification") if pairs else None
        triplets = load_triplets(opts.triplets, key="--triplets") if opts.triplets else None
        classes = opts.classification
        classes = load_classification(classes, key="--classification") if classes else None
        vl = is_vl_folder(opts.model)
        set_vl = [f"--{o.replace('_', '-')}" for o in (*VL_OPTIONS, "mmeb") if getattr(opts, o)]
        if set_vl and not vl:
            raise ValueError(f"{' '.join(set_vl)}: for a Qwen-VL model folder; {opts.model} is not one, leave it out")
        if vl and opts.doc_length:
            raise ValueError(f"--doc-length: {opts.model} is a Qwen-VL folder, its template sets it; leave it out")
        if vl:
            args, model = load_vl_model(
                opts.model, query_length=opts.query_length, **{o: getattr(opts, o) for o in VL_OPTIONS}
            )
        else:
            args, model = load_text_model(opts.model, opts.query_length, opts.doc_length, opts.trust_remote_code)
        dtype = getattr(torch, opts.dtype)
        model.to(device, dtype)
        token_dim = getattr(model, "token_dim", 0)
        given = [s for s in EVAL_SETS if getattr(opts, s.flag[2:].replace("-", "_"), None)]
        one_vector = [s.flag for s in given if s.one_vector]
        if token_dim and one_vector:
            raise ValueError(
                f"{' '.join(one_vector)}: {opts.model} embeds a text as its tokens (ColBERT), scored by late "
                "interaction, and these compare one vector per text; leave them out"
            )
        if opts.pool_factor != 1 and not token_dim:
            raise ValueError(
                f"--pool-factor {opts.pool_factor}: pools a late-interaction model's document tokens, and "
                f"{opts.model} embeds a text as one vector; leave it out"
            )
        if opts.precision and (token_dim or getattr(model, "sparse_embeddings", False)):
            raise ValueError(
                f"--precision {' '.join(opts.precision)}: quantized search is for one dense vector per text, and "
                f"{opts.model} embeds a text as {'its tokens' if token_dim else 'a sparse vector'}; leave it out"
            )
        if token_dim and opts.dims and max(opts.dims) > token_dim:
            raise ValueError(
                f"--dims {opts.dims}: {opts.model}'s tokens have {token_dim} dimensions; use dims <= {token_dim}"
            )

        forward = device_forward(model, device, dtype)
        process = args.processor() if hasattr(args, "processor") else None  # qwen_vl's fills both sides
        pages = process is not None and process.kinds["doc"] == "image"
        text_documents = [s.flag for s in given if s.text_documents]
        if pages and text_documents:
            raise ValueError(
                f"{' '.join(text_documents)}: its documents are texts, and {opts.model} embeds page images as its "
                "documents; leave it out"
            )
        sizes = {"batch_size": opts.batch_size, "rank": rank, "world_size": world}
        results: dict[str, float] = {}
        if mmeb:  # each set in its own mode
            results = evaluate_mmeb(mmeb, lambda mode: mode_embedders(forward, process, mode), **sizes, dims=opts.dims)
        if sets or any(s is not None for s in (sts, reranking, clustering, pairs, triplets, classes)):
            if process is not None:
                embedders = side_embedders(forward, process)
            else:
                embedders = pair_embedders(forward, build_tokenizer(args), args.query_length)
            kinds = {"sparse": getattr(model, "sparse_embeddings", False), "token_dim": token_dim}
            scoring = {"graded": opts.graded, "pool_factor": opts.pool_factor, "pool_protected": opts.pool_protected}
            scoring["precisions"] = opts.precision
            if sets:
                results |= evaluate_sets(
                    sets, *embedders, **sizes, dims=opts.dims, prefix="", **kinds, **scoring, pages=pages
                )
            if sts is not None:
                results |= evaluate_sts(sts, embedders[0], **sizes, dims=opts.dims)
            if reranking is not None:
                results |= evaluate_reranking(reranking, *embedders, **sizes, dims=opts.dims)
            if clustering is not None:
                results |= evaluate_clustering(clustering, embedders[0], **sizes, dims=opts.dims)
            if pairs is not None:
                results |= evaluate_pair_classification(pairs, embedders[0], **sizes, dims=opts.dims)
            if triplets is not None:
                results |= evaluate_triplets(triplets, *embedders, **sizes, dims=opts.dims)
            if classes is not None:
                per_label = opts.classification_per_label
                results |= evaluate_classification(classes, embedders[0], **sizes, dims=opts.dims, per_label=per_label)
    except (ValueError, OSError) as e:
        code = failures.report(e)
        if code is None:
            print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
            code = exit_codes.BAD_INPUT
        return code
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        given = {"beir": beir, "split": opts.split} if beir else {}
        text = json.dumps({"model": opts.model, **given, **({"mmeb": opts.mmeb} if mmeb else {}), **results}, indent=1)
        print(text)
        if opts.out is not None:
            write_text_atomically(opts.out, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
