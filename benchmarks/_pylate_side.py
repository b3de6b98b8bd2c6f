"""PyLate's side of `benchmarks/pylate_interop.py`, run by the PyLate venv's Python (`benchmarks/pylate_venv.sh`):
it imports only torch, safetensors and PyLate, never titan_contrastive, and exchanges files with the other side.

    python -m benchmarks._pylate_side new BASE OUT DIM QUERY_LENGTH DOC_LENGTH   # ColBERT on BASE, saved to OUT
    python -m benchmarks._pylate_side encode FOLDER TEXTS.json OUT.safetensors    # each side's token embeddings
    python -m benchmarks._pylate_side loss FOLDER TRIPLES.json OUT.json          # Contrastive on (q, pos, neg)
    python -m benchmarks._pylate_side distill FOLDER PROBLEM.json OUT.json       # Distillation, min-max or not
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> None:
    import torch
    from pylate import losses, models
    from safetensors.torch import save_file

    torch.manual_seed(0)
    command, folder = argv[0], argv[1]
    if command == "new":
        dim, query_length, doc_length = (int(v) for v in argv[3:6])
        model = models.ColBERT(
            model_name_or_path=folder,
            embedding_size=dim,
            query_length=query_length,
            document_length=doc_length,
            device="cpu",
        )
        model.save(argv[2])
        return
    model = models.ColBERT(model_name_or_path=folder, device="cpu").eval()
    if command == "encode":
        texts = json.loads(open(argv[2]).read())
        out = {}
        for side, is_query in (("query", True), ("doc", False)):
            with torch.no_grad():
                rows = model.encode(texts, is_query=is_query, convert_to_tensor=False, convert_to_numpy=False)
            for i, row in enumerate(rows):
                out[f"{side}{i}"] = torch.as_tensor(row).float().contiguous()
        save_file(out, argv[3])
        return
    if command == "loss":
        queries, positives, negatives = zip(*json.loads(open(argv[2]).read()))
        features = [
            model.tokenize(list(queries), is_query=True),
            model.tokenize(list(positives), is_query=False, pad=True),
            model.tokenize(list(negatives), is_query=False, pad=True),
        ]
        with torch.no_grad():
            loss = losses.Contrastive(model=model)(features)
        open(argv[3], "w").write(json.dumps({"loss": float(loss)}))
        return
    if command == "distill":
        problem = json.loads(open(argv[2]).read())
        features = [
            model.tokenize(problem["queries"], is_query=True),
            model.tokenize([d for docs in problem["documents"] for d in docs], is_query=False, pad=True),
        ]
        labels = torch.tensor(problem["scores"])
        out = {}
        for normalize in (True, False):
            with torch.no_grad():
                out[str(normalize)] = float(
                    losses.Distillation(model=model, normalize_scores=normalize)(features, labels)
                )
        open(argv[3], "w").write(json.dumps(out))
        return
    raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
