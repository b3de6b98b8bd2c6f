"""`python -m titan_contrastive.evaluate MODEL [--beir DIR] [--sts FILE] [--out FILE]`: a text model's metrics.

MODEL is one of our bi_encoder step folders (`.../checkpoint/step-N`, LoRA runs included) or a
model folder the bi_encoder family loads (`[model] path`: a transformers or sentence-transformers
folder, or a hub id already in the local cache). DIR is a local BEIR folder (`corpus.jsonl`,
`queries.jsonl`, `qrels/{split}.tsv`), by default the bundled WordNet set. Prints nDCG@10,
MRR@10, MAP@100 and Recall@1/10/100 as JSON (`components/beir_eval.py`: the figures
sentence-transformers' InformationRetrievalEvaluator gives); with `--sts FILE` (scored sentence pairs, `[eval]
sts_path`'s format) also `sts/pearson_cosine` and `sts/spearman_cosine`, as its EmbeddingSimilarityEvaluator
gives them (`components/sts_eval.py`); `--out` writes them to a file too.

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


def load_text_model(src: str, query_length: int, doc_length: int, trust: bool = False) -> tuple[Any, Any]:
    """(args, model in eval mode): a step folder's bi_encoder, or a fresh one on a model folder (`trust`: its
    own code may run, `[model] trust_remote_code`)."""
    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs
    from titan_contrastive.models.bi_encoder.colbert import colbert_sides
    from titan_contrastive.models.bi_encoder.folder import read_text_folder

    if (Path(src).expanduser() / "manifest.json").is_file():
        import dataclasses

        from titan_contrastive.models.weights import WeightsError, read_ours

        family, args, model = read_ours(Path(src))
        if family != "bi_encoder":
            raise WeightsError(f"{src}: a {family} checkpoint; retrieval evaluation reads bi_encoder ones")
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
    parser.add_argument("--beir", default="bundled", help="a BEIR folder (default: the bundled WordNet set)")
    parser.add_argument("--split", default="test", help="the qrels split: qrels/{split}.tsv (default: test)")
    parser.add_argument("--batch-size", type=int, default=256, help="texts per forward (default: 256)")
    parser.add_argument("--query-length", type=int, default=0, help="query tokens (default: the run's, else 64)")
    parser.add_argument("--doc-length", type=int, default=0, help="document tokens (default: the run's / folder's)")
    parser.add_argument("--sts", default="", help="also semantic similarity on this file of scored sentence pairs")
    parser.add_argument("--sts-split", default="test", help="the split of a saved dataset --sts reads (default: test)")
    parser.add_argument(
        "--dims", type=int, nargs="+", default=[], help="also at the embeddings' first m dims (Matryoshka), per m"
    )
    parser.add_argument("--out", type=Path, help="also write the metrics (JSON) to this file")
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="run the code a model folder ships (config.json auto_map)"
    )
    opts = parser.parse_args(argv)
    import torch
    import torch.distributed as dist

    from titan_contrastive import exit_codes, failures
    from titan_contrastive.components.beir_eval import evaluate_beir, load_beir, pair_embedders
    from titan_contrastive.components.sts_eval import evaluate_sts, load_sts
    from titan_contrastive.models.bi_encoder import build_tokenizer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu")
    try:
        if opts.batch_size < 1:
            raise ValueError(f"--batch-size {opts.batch_size}: use an integer >= 1")
        beir = load_beir(opts.beir, opts.split)
        sts = load_sts(opts.sts, opts.sts_split) if opts.sts else None
        args, model = load_text_model(opts.model, opts.query_length, opts.doc_length, opts.trust_remote_code)
        model.to(device)
        token_dim = getattr(model, "token_dim", 0)
        if token_dim and opts.sts:
            raise ValueError(
                f"--sts: {opts.model} embeds a text as its tokens (ColBERT), scored by late interaction, and --sts "
                "reads one vector per text; leave it out"
            )
        if token_dim and opts.dims and max(opts.dims) > token_dim:
            raise ValueError(
                f"--dims {opts.dims}: {opts.model}'s tokens have {token_dim} dimensions; use dims <= {token_dim}"
            )

        def forward(batch: dict[str, torch.Tensor]) -> Any:
            return model(batch["query"].to(device), batch["doc"].to(device))

        embedders = pair_embedders(forward, build_tokenizer(args), args.query_length)
        sizes = {"batch_size": opts.batch_size, "rank": rank, "world_size": world, "dims": opts.dims}
        kinds = {"sparse": getattr(model, "sparse_embeddings", False), "token_dim": getattr(model, "token_dim", 0)}
        results = evaluate_beir(beir, *embedders, **sizes, prefix="", **kinds)
        if sts is not None:
            results |= evaluate_sts(sts, embedders[0], **sizes)
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
        text = json.dumps({"model": opts.model, "beir": opts.beir, "split": opts.split, **results}, indent=1)
        print(text)
        if opts.out is not None:
            write_text_atomically(opts.out, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
