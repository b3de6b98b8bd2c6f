"""PyLate <-> titan_contrastive for ColBERT: PyLate's own folders read here, our `--to pylate` exports read by PyLate,
the same token embeddings and the same Contrastive and Distillation losses.

    bash benchmarks/pylate_venv.sh                                   # once: /tmp/pylate_venv
    .venv/bin/python -m benchmarks.pylate_interop [--pylate-python /tmp/pylate_venv/bin/python]

PyLate 1.6 pins sentence-transformers 5.3 and transformers <= 5.3 (the repo runs 6.x and 5.2x), so PyLate runs in its
own venv, called as a subprocess (`benchmarks/_pylate_side.py`); files carry the folders, texts and embeddings
between the two. Nothing downloads at run time: the base is the bundled all-MiniLM-L6-v2's transformer. Nothing is
timed: the harness gives the metadata.

What it checks (CPU, float32, eval):
a) PyLate -> ours: `pylate.models.ColBERT` on MiniLM (a new 32-wide Dense, the [Q] / [D] tokens added, query length
   16, document length 24) saved by PyLate, read by our bi_encoder; each text's token embeddings, PyLate's `encode`
   (queries with their [MASK] expansion, documents without the skiplist and padding) against ours without the zero
   tokens; max |difference|.
b) PyLate's `losses.Contrastive` on (query, positive, negative) triples against our objective on our embeddings of
   the same texts (one-way InfoNCE over MaxSim, t = 1).
c) ours -> PyLate: a one-step run of ours on the folder of (a), exported with `--to pylate`, read by PyLate; the
   token embeddings of (a) again against the run's.
d) PyLate's `losses.Distillation` (its default min-max scaling of the scores, and without it) on queries with four
   documents each and a teacher's scores of them, against ours (`loss.distill = "kl"`, `distill_minmax` on and off,
   `contrastive_weight = 0`, t = 1) on our embeddings of the same texts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from benchmarks import harness

NAME = "pylate_interop"
TEXTS = [
    "a small domesticated feline, kept as a pet.",
    "What is the capital of France?",
    "Two dogs, playing in the snow at night! " * 6,
    "ice",
]
DISTILL = {  # each query's four documents and a cross-encoder's scores of them, roughly
    "queries": ["a small domesticated feline", "frozen water", "the season after summer"],
    "documents": [
        ["cat", "a kitten asleep on the sofa", "dog", "lion"],
        ["ice", "snow on the mountain", "steam", "a glass of water"],
        ["autumn, the fall.", "leaves turning red in October", "winter", "spring"],
    ],
    "scores": [[9.5, 6.0, 1.5, 3.0], [8.0, 5.5, 2.0, 4.5], [9.0, 7.0, 3.5, 1.0]],
}
TRIPLES = [
    ("a small domesticated feline", "cat", "dog"),
    ("frozen water", "ice", "steam"),
    ("the season after summer", "autumn, the fall.", "winter"),
    ("a person who flies an aircraft", "pilot", "sailor"),
]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pylate-python", default="/tmp/pylate_venv/bin/python")
    p.add_argument("--out", default=str(harness.RESULTS))
    return p.parse_args(argv)


def _pylate(python: str, *args: str) -> None:
    subprocess.run([python, "-m", "benchmarks._pylate_side", *args], check=True, capture_output=True, text=True)


def _ours(folder: Path, query_length: int):
    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs, build_tokenizer

    args = BiEncoderArgs(path=str(folder), query_length=query_length).resolve()
    return args, BiEncoder(args).eval(), build_tokenizer(args)


def _embeddings(model, tokenizer, args) -> dict:
    import torch

    with torch.no_grad():
        return {
            "query": model.embed_side("query", tokenizer.encode_queries(TEXTS, args.query_length)),
            "doc": model.embed_side("doc", tokenizer.encode_docs(TEXTS)),
        }


def _difference(theirs_file: Path, ours: dict, dim: int) -> dict[str, float]:
    """Per side, the largest |difference| between PyLate's token rows and ours without the zero tokens."""
    from safetensors.torch import load_file

    theirs, out = load_file(str(theirs_file)), {}
    for side, rows in ours.items():
        worst = 0.0
        for i, row in enumerate(rows):
            tokens = row.view(-1, dim)
            kept = tokens[(tokens != 0).any(1)]
            other = theirs[f"{side}{i}"]
            if kept.shape != other.shape:
                return {side: float("inf"), f"{side}_shapes": f"{tuple(kept.shape)} vs {tuple(other.shape)}"}
            worst = max(worst, (kept - other).abs().max().item())
        out[side] = worst
    return out


def main(argv: list[str] | None = None) -> None:
    opts = parse(argv)
    import torch

    from titan_contrastive.export import main as export_main
    from titan_contrastive.losses.late_interaction import LateInteraction
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    torch.manual_seed(0)
    meta = harness.metadata(torch.device("cpu"))
    work = Path(tempfile.mkdtemp(prefix="pylate_interop_"))
    try:
        base = work / "minilm"
        base.mkdir()
        minilm = bundled_minilm()
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt"):
            shutil.copy(minilm / name, base / name)
        theirs = work / "pylate"
        _pylate(opts.pylate_python, "new", str(base), str(theirs), "32", "16", "24")
        (work / "texts.json").write_text(json.dumps(TEXTS))
        _pylate(opts.pylate_python, "encode", str(theirs), str(work / "texts.json"), str(work / "a.safetensors"))
        args, model, tokenizer = _ours(theirs, 16)
        result: dict = {
            "a_pylate_to_ours": _difference(work / "a.safetensors", _embeddings(model, tokenizer, args), 32)
        }

        (work / "triples.json").write_text(json.dumps(TRIPLES))
        _pylate(opts.pylate_python, "loss", str(theirs), str(work / "triples.json"), str(work / "loss.json"))
        queries, positives, negatives = (list(side) for side in zip(*TRIPLES))
        with torch.no_grad():
            q = model.embed_side("query", tokenizer.encode_queries(queries, args.query_length))
            docs = torch.cat(
                [model.embed_side("doc", tokenizer.encode_docs(texts)) for texts in (positives, negatives)]
            )
            ours = LateInteraction(32).dense(q, docs, torch.tensor(1.0)).item()
        pylate_loss = json.loads((work / "loss.json").read_text())["loss"]
        result["b_contrastive_loss"] = {"pylate": pylate_loss, "ours": ours, "difference": abs(pylate_loss - ours)}

        result["d_distillation_loss"] = _distillation(opts.pylate_python, work, theirs, model, tokenizer, args)

        step = _one_step(work, theirs)
        exported = work / "exported"
        assert export_main([str(step), "--to", "pylate", "--out", str(exported)]) == 0
        _pylate(opts.pylate_python, "encode", str(exported), str(work / "texts.json"), str(work / "c.safetensors"))
        from titan_contrastive.models.weights import read_ours

        _, run_args, run_model = read_ours(step)
        run_model.eval()
        result["c_ours_to_pylate"] = _difference(
            work / "c.safetensors", _embeddings(run_model, _ours(exported, 16)[2], run_args), 32
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2))
    harness.write_results(opts.out, NAME, meta, {"config": vars(opts), "result": result})


def _distillation(python: str, work: Path, folder: Path, model, tokenizer, args) -> dict:
    """PyLate's Distillation loss on `DISTILL` (min-max scaled and not) against ours on our embeddings."""
    import torch

    from titan_contrastive.losses import Distillation, Distilled, InfoNCE
    from titan_contrastive.losses.late_interaction import late_interaction

    (work / "distill.json").write_text(json.dumps(DISTILL))
    _pylate(python, "distill", str(folder), str(work / "distill.json"), str(work / "distill_loss.json"))
    theirs = json.loads((work / "distill_loss.json").read_text())
    docs = DISTILL["documents"]
    with torch.no_grad():
        q = model.embed_side("query", tokenizer.encode_queries(DISTILL["queries"], args.query_length))
        rows = [model.embed_side("doc", tokenizer.encode_docs(texts)) for texts in docs]
        cols = torch.cat([torch.stack([r[0] for r in rows]), torch.cat([r[1:] for r in rows])])
        out = {}
        for minmax in (True, False):
            distilled = Distilled(InfoNCE(False), Distillation("kl", minmax=minmax), contrastive_weight=0.0)
            objective = late_interaction(distilled, 32).with_teacher(torch.tensor(DISTILL["scores"]))
            ours = objective.dense(q, cols, torch.tensor(1.0)).item()
            pylate = theirs[str(minmax)]
            out["minmax" if minmax else "raw"] = {"pylate": pylate, "ours": ours, "difference": abs(pylate - ours)}
    return out


def _one_step(work: Path, folder: Path) -> Path:
    """One optimizer step of ours on `folder` with a checkpoint; the step folder."""
    from titan_contrastive.config import parse_args
    from titan_contrastive.train import Trainer

    pairs = work / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"query": q, "positive": p, "negative": n}) + "\n" for q, p, n in TRIPLES))
    trainer = Trainer(
        parse_args(
            [
                "--model.name=bi_encoder",
                f"--model.path={folder}",
                "--data.dataset=pairs",
                f"--data.path={pairs}",
                "--training.local_batch_size=4",
                "--training.steps=1",
                "--optimizer.lr=1e-3",
                "--eval.enable=false",
                "--checkpoint.enable=true",
                "--metrics.enable_tensorboard=false",
                f"--job.dump_folder={work / 'run'}",
            ]
        )
    )
    trainer.train()
    trainer.metrics.close()
    return work / "run" / "checkpoint" / "step-1"


if __name__ == "__main__":
    main()
