"""A static embedding model's training step: the static family's trainer step against sentence-transformers'
own (a StaticEmbedding under MatryoshkaLoss(MultipleNegativesRankingLoss)), at equal batch, on CPU.

    python -m benchmarks.static_bench                                 # batches 1,024, 4,096, 8,192 (~5 min, 2 cores)
    python -m benchmarks.static_bench --batches 512 --repeats 2 --out /tmp/bench      # quick

The recipe is sentence-transformers' static-retrieval-mrl-en-v1: a table over a tokenizer's vocabulary (here the
bundled MiniLM's, 30,522 rows, `--dim` wide, drawn N(0, 1) with seed 0 by sentence-transformers and saved as its
folder, which both sides load), InfoNCE one way at a fixed scale of 20 inside Matryoshka (`--dims`), AdamW (lr 0.2,
weight decay 0.01, fused on both sides: each trainer's default). The batch is WordNet definition -> lemma pairs (no
hard negatives), tokenized once by our PairTokenizer (no special tokens, queries cut at 32 tokens, lemmas at 16)
and handed to sentence-transformers as its StaticEmbedding's features (the flat ids and offsets its own
tokenization gives for these texts): the tokenization, which sentence-transformers' trainer runs in its collator
and ours at load, is in neither timing.

Variants, each a whole optimizer step: `ours/plain` (`Trainer.train_step`, one microbatch), `ours/global` (global
negatives: the streamed objective, chunks of `--stream-chunk`; one process, so the same problem), `st/mnrl` (the
module's forward, the loss, backward, a fused `torch.optim.AdamW` step). Interleaved (`harness.round_robin`), one
untimed round, medians of `--repeats`; peak RSS per timed call. Before timing, the first batch's loss and table
gradient of `ours/plain` and `st/mnrl` are compared (float32). Writes static_bench.{json,csv,png}.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import harness

NAME = "static_bench"
VARIANTS = ("ours/plain", "ours/global", "st/mnrl")
FIELDS = ["variant", "batch", "median_s", "samples_per_s", "ratio_to_st", "peak_rss_mib", "rss_growth_mib"]
LR, DECAY, SCALE = 0.2, 0.01, 20.0


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--dims", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024])
    p.add_argument("--stream-chunk", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(harness.RESULTS))
    return p.parse_args(argv)


def write_folder(folder: Path, dim: int) -> None:
    """A StaticEmbedding over the bundled MiniLM's tokenizer, `dim` wide, drawn by sentence-transformers (seed 0)."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    from transformers import AutoTokenizer

    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    torch.manual_seed(0)
    module = StaticEmbedding(AutoTokenizer.from_pretrained(str(bundled_minilm())), embedding_dim=dim)
    SentenceTransformer(modules=[module], device="cpu").save(str(folder))


def trainer_args(kind: str, folder: Path, batch: int, args: argparse.Namespace, dump: Path) -> list[str]:
    return [
        "--model.name=static", f"--model.path={folder}", "--data.dataset=wordnet", "--data.hard_negatives=false",
        "--data.context_length=32", "--data.doc_context_length=16", f"--training.local_batch_size={batch}",
        "--training.max_norm=0", "--lr_scheduler.warmup_steps=0", f"--optimizer.lr={LR}",
        f"--optimizer.weight_decay={DECAY}", "--loss.symmetric=false", "--loss.learn_logit_scale=false",
        f"--loss.matryoshka_dims={','.join(map(str, args.dims))}", "--eval.enable=false",
        "--metrics.enable_tensorboard=false", f"--job.dump_folder={dump}",
        *(["--loss.negatives=global", f"--loss.stream_chunk_size={args.stream_chunk}"] if kind == "global" else []),
    ]  # fmt: skip


def st_features(ids: Any) -> dict[str, Any]:
    """A StaticEmbedding's features of right-padded ids (padding -1): the flat ids and each text's offset."""
    import torch

    real = ids != -1
    lengths = real.sum(1)
    return {"input_ids": ids[real], "offsets": torch.cumsum(lengths, 0) - lengths}


class SentenceTransformersStep:
    """sentence-transformers' step on the folder: MatryoshkaLoss(MultipleNegativesRankingLoss(scale 20)), AdamW."""

    def __init__(self, folder: Path, dims: list[int]) -> None:
        import torch
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss, MultipleNegativesRankingLoss

        self.model = SentenceTransformer(str(folder), device="cpu").train()
        self.loss = MatryoshkaLoss(self.model, MultipleNegativesRankingLoss(self.model, scale=SCALE), dims)
        # fused: its trainer's default (transformers' adamw_torch_fused), as ours is (optimizer.implementation)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=DECAY, fused=True)

    def backward(self, features: list[dict[str, Any]]) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss([dict(f) for f in features], None)
        loss.backward()
        return loss.item()

    def __call__(self, features: list[dict[str, Any]]) -> float:
        loss = self.backward(features)
        self.optimizer.step()
        return loss


def measure(batch: int, folder: Path, args: argparse.Namespace, tmp: Path) -> tuple[dict[str, Any], list[dict]]:
    """(the first step's agreement, the timed rows) at `batch` pairs."""
    from titan_contrastive.config import parse_args
    from titan_contrastive.train import Trainer

    trainers = {
        kind: Trainer(parse_args(trainer_args(kind, folder, batch, args, tmp / f"{kind}-{batch}")))
        for kind in ("plain", "global")
    }
    data = trainers["plain"].train_set.__getitems__(list(range(batch)))
    mine = {k: data[k] for k in ("query", "doc")}
    theirs = SentenceTransformersStep(folder, args.dims)
    features = [st_features(mine["query"]), st_features(mine["doc"])]
    ours = trainers["plain"]
    ours.optimizer.zero_grad(set_to_none=True)
    our_loss = ours.gradient_step([mine])
    st_loss = theirs.backward(features)
    g_ours, g_st = ours.model.query_embedding.weight.grad, theirs.model[0].embedding.weight.grad
    agreement = {
        "batch": batch,
        "loss_ours": our_loss,
        "loss_st": st_loss,
        "loss_rel_diff": abs(our_loss - st_loss) / abs(st_loss),
        "grad_rel_diff": ((g_ours - g_st).norm() / g_st.norm()).item(),
    }
    print(agreement, flush=True)
    variants = {
        "ours/plain": lambda: trainers["plain"].train_step([mine]),
        "ours/global": lambda: trainers["global"].train_step([mine]),
        "st/mnrl": lambda: theirs(features),
    }
    measured = harness.round_robin(variants, args.repeats, log=print)
    for trainer in trainers.values():
        trainer.metrics.close()
    rows = [
        {
            "variant": name,
            "batch": batch,
            "median_s": m.median_s,
            "samples_per_s": batch / m.median_s,
            "ratio_to_st": m.median_s / measured["st/mnrl"].median_s,
            "peak_rss_mib": m.peak_rss_mib,
            "rss_growth_mib": m.rss_growth_mib,
            "times_s": m.times_s,
        }
        for name, m in measured.items()
    ]
    return agreement, rows


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
    meta = harness.metadata("cpu", dim=args.dim, dims=args.dims, lr=LR, weight_decay=DECAY, scale=SCALE)
    rows, agreement = [], []
    with tempfile.TemporaryDirectory(prefix="static_bench_") as tmp:
        folder = Path(tmp) / "static"
        write_folder(folder, args.dim)
        for batch in args.batches:
            first, timed = measure(batch, folder, args, Path(tmp))
            agreement.append(first)
            rows += timed

    def figure() -> Any:
        plt = harness.pyplot()
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name in VARIANTS:
            points = [(r["batch"], r["samples_per_s"]) for r in rows if r["variant"] == name]
            ax.plot(*zip(*points, strict=True), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (pairs)")
        ax.set_ylabel("pairs / s (whole optimizer step)")
        ax.set_title(f"static embedding, d {args.dim}, Matryoshka {len(args.dims)} dims")
        ax.legend()
        return fig

    for path in harness.write_results(
        args.out, NAME, meta, {"agreement": agreement}, rows=rows, fields=FIELDS, figure=figure
    ):
        print(path)


if __name__ == "__main__":
    main()
