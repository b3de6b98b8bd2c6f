"""FLOPs per step kind, counted (`torch.utils.flop_counter.FlopCounterMode`), not timed.

`python -m benchmarks.step_flops [--flavor vit_b32] [--batch 16] [--chunk 4] [--out DIR]`: one
training step of the clip family, through the trainer's own step, per kind: plain (the whole batch
forward and backward), GradCache (chunks of `--chunk`), global negatives (two microbatches, their
re-forward in chunks of `--chunk`), and the forward alone. Every matmul, convolution and attention
of the step is counted, the loss's included. The claim checked: GradCache and global negatives cost
at most 4/3 of plain plus 8·N²·d for the loss (N the global batch, d the embedding width): their
extra work is one no-graph forward of the encoders and the loss's recompute. FLOP counts do not
depend on the machine, so the same accounting is a test (`tests/test_step_flops.py`, debug flavor).

`--kept-chunk`: instead, GradCache with a token budget (`--chunk-tokens`) on the bundled MiniLM
bi_encoder and WordNet pairs (`--batch` of them): the step's FLOPs with the chunks as the engine
orders them (the first packed, longest sequences, last: its graph is kept instead of re-run) and
with the order of `batching.token_chunks` (the remainder last, kept), the saving as a fraction of
the step. Writes `step_flops_kept_chunk.{json,csv}`.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import harness

KINDS = {
    "plain": [],
    "gradcache": ["--gradcache.enabled=true"],
    "global": ["--loss.negatives=global"],
}


def count(kind: str, flavor: str, batch: int, chunk: int, image_size: int) -> dict[str, Any]:
    """{"flops": the step's, "forward": one forward of the batch, "d": the embedding width}."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from titan_contrastive.config import parse_args
    from titan_contrastive.train import Trainer

    ga = 2 if kind == "global" else 1
    with tempfile.TemporaryDirectory() as dump:
        trainer = Trainer(
            parse_args(
                [
                    "--model.name=clip",
                    f"--model.flavor={flavor}",
                    "--data.dataset=emoji",
                    *([f"--data.image_size={image_size}"] if image_size else []),
                    "--eval.enable=false",
                    "--metrics.enable_tensorboard=false",
                    "--training.steps=2",
                    "--lr_scheduler.warmup_steps=0",
                    f"--training.local_batch_size={batch // ga}",
                    f"--training.global_batch_size={batch}",
                    f"--gradcache.chunk_sizes={chunk}",
                    f"--job.dump_folder={dump}",
                    *KINDS[kind],
                ]
            )
        )
        data = trainer.train_set
        microbatches = [data.__getitems__(list(range(j * batch // ga, (j + 1) * batch // ga))) for j in range(ga)]
        trainer.train_step(microbatches)  # first-step work (optimizer state) out of the count
        with FlopCounterMode(display=False) as step:
            trainer.train_step(microbatches)
        whole = data.__getitems__(list(range(batch)))
        with torch.no_grad(), FlopCounterMode(display=False) as forward:
            trainer.step_context.encode(whole)
        trainer.metrics.close()
        return {
            "flops": step.get_total_flops(),
            "forward": forward.get_total_flops(),
            "d": trainer.model_args.embed_dim,
        }


def account(flavor: str, batch: int, chunk: int, image_size: int = 0) -> list[dict[str, Any]]:
    """One row per kind: its FLOPs, against plain, and the bound 4/3 plain + 8 N² d."""
    counts = {kind: count(kind, flavor, batch, chunk, image_size) for kind in KINDS}
    plain, forward, d = counts["plain"]["flops"], counts["plain"]["forward"], counts["plain"]["d"]
    bound = 4 / 3 * plain + 8 * batch * batch * d
    return [
        {
            "kind": kind,
            "flops": c["flops"],
            "x_plain": c["flops"] / plain,
            "x_forward": c["flops"] / forward,
            "bound": bound,
            "within": c["flops"] <= bound,
            "flavor": flavor,
            "batch": batch,
            "chunk": chunk,
        }
        for kind, c in counts.items()
    ]


def kept_chunk(batch: int, chunk_tokens: int) -> list[dict[str, Any]]:
    """The GradCache step's FLOPs with the costliest chunk kept (the engine's order) and with the remainder kept."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from titan_contrastive.config import parse_args
    from titan_contrastive.grad_cache.grad_cache import GradCache
    from titan_contrastive.train import Trainer

    engine_order = GradCache.chunk

    def remainder_kept(self: GradCache, model_input: Any, index: int) -> Any:
        chunks, order = engine_order(self, model_input, index)
        if order is None:
            return chunks, order
        sizes = [
            len(c["input_ids"] if isinstance(c, dict) and "input_ids" in c else next(iter(c.values()))) for c in chunks
        ]
        return chunks[::-1], torch.cat(torch.split(order, sizes)[::-1])

    rows = []
    for name, chunk in (("costliest kept", engine_order), ("remainder kept", remainder_kept)):
        GradCache.chunk = chunk
        try:
            with tempfile.TemporaryDirectory() as dump:
                trainer = Trainer(
                    parse_args(
                        [
                            "--model.name=bi_encoder",
                            "--model.flavor=shared",
                            "--lr_scheduler.warmup_steps=0",
                            "--data.dataset=wordnet",
                            "--eval.enable=false",
                            "--metrics.enable_tensorboard=false",
                            "--training.steps=2",
                            f"--training.local_batch_size={batch}",
                            "--gradcache.enabled=true",
                            f"--gradcache.chunk_tokens={chunk_tokens}",
                            f"--job.dump_folder={dump}",
                        ]
                    )
                )
                microbatch = trainer.train_set.__getitems__(list(range(batch)))
                trainer.train_step([microbatch])
                with FlopCounterMode(display=False) as step:
                    trainer.train_step([microbatch])
                trainer.metrics.close()
        finally:
            GradCache.chunk = engine_order
        rows.append({"order": name, "flops": step.get_total_flops(), "batch": batch, "chunk_tokens": chunk_tokens})
    rows[0]["saving"] = 1 - rows[0]["flops"] / rows[1]["flops"]
    return rows


def _figure(rows: list[dict[str, Any]], meta: dict[str, Any]) -> Any:
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar([r["kind"] for r in rows], [r["x_plain"] for r in rows], color="tab:blue")
    ax.axhline(rows[0]["bound"] / rows[0]["flops"], color="tab:red", linestyle="--", label="4/3 plain + 8N²d")
    ax.set_ylabel("FLOPs / plain step")
    ax.set_title(f"clip/{meta['flavor']}, N = {meta['batch']}, chunks of {meta['chunk']}: FLOPs per step")
    ax.legend()
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_flops", description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="vit_b32")
    parser.add_argument("--batch", type=int, default=16, help="global batch N")
    parser.add_argument("--chunk", type=int, default=4, help="GradCache / re-forward chunk")
    parser.add_argument("--image-size", type=int, default=224, help="0: the dataset's own (emoji: 32 px)")
    parser.add_argument("--kept-chunk", action="store_true", help="the token-budget comparison (see above)")
    parser.add_argument("--chunk-tokens", type=int, default=600, help="with --kept-chunk")
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    if args.kept_chunk:
        rows = kept_chunk(args.batch, args.chunk_tokens)
        for row in rows:
            print(f"{row['order']:15s} {row['flops'] / 1e9:8.2f} GFLOP")
        print(f"saving: {rows[0]['saving']:.1%} of the step")
        meta = harness.metadata(device="cpu", batch=args.batch, chunk_tokens=args.chunk_tokens)
        harness.write_results(args.out, "step_flops_kept_chunk", meta, rows=rows)
        return
    rows = account(args.flavor, args.batch, args.chunk, args.image_size)
    for row in rows:
        print(
            f"{row['kind']:10s} {row['flops'] / 1e9:9.1f} GFLOP  {row['x_plain']:.3f}x plain  "
            f"{row['x_forward']:.2f}x a forward  within 4/3 plain + 8N²d: {row['within']}"
        )
    meta = harness.metadata(device="cpu", flavor=args.flavor, batch=args.batch, chunk=args.chunk)
    harness.write_results(args.out, "step_flops", meta, rows=rows, figure=lambda: _figure(rows, meta))


if __name__ == "__main__":
    main()
