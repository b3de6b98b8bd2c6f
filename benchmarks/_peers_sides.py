"""The sides benchmarks/peers_cpu.py compares, and its rows: how each side is built (our trainers and
open_clip's twin of our CLIP, the three losses, our bi_encoder and sentence-transformers' MiniLM with
its cached loss) and the timing, rows and result file every comparison shares. peers_cpu.py runs the
comparisons and is the command (`python -m benchmarks.peers_cpu`); its docstring says what is
compared and how. Imports of the peers (open_clip, sentence-transformers, transformers) are lazy:
this module imports in the repo's venv too.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from titan_contrastive.config import JobConfig, parse_args
from titan_contrastive.losses import InfoNCE, Sigmoid
from titan_contrastive.models.clip.args import clip_flavors
from titan_contrastive.models.clip.openclip import open_clip_config, to_open_clip_state_dict
from titan_contrastive.steps.global_negatives import StreamingClipStep
from titan_contrastive.train import Trainer

REPO = harness.REPO
FIELDS = [
    "comparison",
    "case",
    "impl",
    "role",
    "status",
    "median_s",
    "min_s",
    "max_s",
    "samples_per_s",
    "ratio_ours_over_peer",
    "peer",
    "max_rel_diff",
    "peak_rss_mib",
    "reference",
    "load1",
    "measured",
    "reason",
    "note",
]
Row = dict[str, Any]

# ------------------------------------------------------------------ shared: timing, rows, output


def timed(fns: dict[str, Callable[[], Any]], args: argparse.Namespace) -> dict[str, harness.Measurement]:
    """--warmup untimed rounds, then --reps rounds of A, B, ... interleaved (harness.round_robin). A side
    that raises is a skipped result with its reason; the others still run."""
    return harness.round_robin(fns, args.reps, warmup=args.warmup, tolerate=True)


reason = harness.reason


def max_rel_diff(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], joint: bool = False) -> float:
    """max|a - b| / max|b| per pair of tensors, the worst pair; `joint`: over all pairs together."""
    err = [(g.double() - w.double()).abs().max().item() for g, w in zip(got, want)]
    scale = [w.double().abs().max().item() for w in want]
    return max(err) / max(max(scale), 1e-30) if joint else max(e / max(s, 1e-30) for e, s in zip(err, scale))


def case_rows(
    comparison: str,
    case: str,
    roles: dict[str, str],
    runs: dict[str, harness.Measurement],
    skipped: dict[str, str],
    *,
    peer: str | dict[str, str],
    samples: int | None = None,
    diffs: dict[str, float] | None = None,
    reference: str = "",
    notes: dict[str, str] | None = None,
) -> list[Row]:
    """One row per implementation; `roles`: impl -> ours / peer / reference; ours rows get ours / peer
    (`peer`: the peer every ours row is set against, or one per ours impl)."""
    rows = []
    for impl, role in roles.items():
        against = peer if isinstance(peer, str) else peer.get(impl, "")
        row: Row = {
            "comparison": comparison,
            "case": case,
            "impl": impl,
            "role": role,
            "reference": reference,
            "note": (notes or {}).get(impl, ""),
        }
        m = runs.get(impl)
        if m is not None and m.ok:
            stats = harness.summary(m.times_s)
            row.update(
                status="ok",
                median_s=stats["median"],
                min_s=stats["min"],
                max_s=stats["max"],
                times_s=m.times_s,
                max_rel_diff=(diffs or {}).get(impl),
                peak_rss_mib=m.peak_rss_mib,
                rss_growth_mib=m.rss_growth_mib,
            )
            if samples:
                row["samples_per_s"] = samples / stats["median"]
            if role == "ours" and against in runs and runs[against].ok:
                row["ratio_ours_over_peer"] = stats["median"] / runs[against].median_s
                row["peer"] = against
        else:
            why = m.reason if m is not None and m.reason else skipped.get(impl, "not run")
            row.update(status="skipped", reason=why)
        rows.append(row)
    return rows


class Results:
    """Rows so far, rewritten to json + csv after every case (a crash keeps what was measured).

    `keep`: the rows of an earlier peers_cpu.json under `out` stay, each with the date it was
    measured, until this run measures their (comparison, case) again (a run of some comparisons
    updates those rows of the table, not the whole table)."""

    def __init__(self, out: Path, meta: dict[str, Any], keep: bool = False) -> None:
        self.out, self.meta, self.rows = out, meta, []
        earlier = out / "peers_cpu.json"
        if keep and earlier.is_file():
            old = json.loads(earlier.read_text())
            self.rows = [{**r, "measured": r.get("measured") or old["meta"]["date"]} for r in old["rows"]]

    def add(self, rows: list[Row]) -> None:
        for row in rows:  # the machine's 1-minute load average when measured: how shared it was
            row["load1"], row["measured"] = os.getloadavg()[0], self.meta["date"]
        cases = {(r["comparison"], r["case"]) for r in rows}
        self.rows = [r for r in self.rows if (r["comparison"], r["case"]) not in cases] + rows
        for row in rows:
            shown = (
                f"{row['median_s']:8.3f} s"
                + (f"  {row['samples_per_s']:8.0f} samples/s" if row.get("samples_per_s") else "")
                + (f"  ours/peer {row['ratio_ours_over_peer']:.2f}x" if row.get("ratio_ours_over_peer") else "")
                + (f"  max_rel_diff {row['max_rel_diff']:.1e}" if row.get("max_rel_diff") is not None else "")
                if row["status"] == "ok"
                else f"skipped: {row['reason']}"
            )
            print(f"  {row['comparison']:<10} {row['case']:<24} {row['impl']:<22} {shown}", flush=True)
        harness.write_results(self.out, "peers_cpu", self.meta, rows=self.rows, fields=FIELDS)


def device_meta(args: argparse.Namespace) -> dict[str, Any]:
    versions = {}
    for package in ("open_clip", "sentence_transformers", "transformers", "torchvision"):
        try:
            versions[package] = __import__(package).__version__
        except Exception as e:  # noqa: BLE001
            versions[package] = f"unavailable ({type(e).__name__})"
    return harness.metadata(
        "cpu",
        versions=versions,
        venv=sys.prefix,
        note="runs in the peer venv (benchmarks/peers_venv.sh): torch 2.14.1, not the repo's 2.13",
        quick=args.quick,
        reps=args.reps,
        warmup=args.warmup,
    )


# ------------------------------------------------------------------ 1. our clip trainer and open_clip's twin

W128 = dict(
    embed_dim=128, vision_width=128, vision_layers=4, vision_heads=4, text_width=128, text_layers=4, text_heads=4
)


def our_clip_trainer(local: int, k: int, extra: list[str], dump: str) -> Trainer:
    clip_flavors["w128"] = dataclasses.replace(clip_flavors["debug"], **W128)
    return Trainer(
        parse_args(
            [
                "--model.flavor=w128",
                "--data.dataset=fashion_mnist",
                "--data.context_length=40",
                "--data.num_workers=0",
                "--training.device=cpu",
                f"--training.local_batch_size={local}",
                f"--training.global_batch_size={local * k}",
                "--training.max_norm=1.0",
                "--optimizer.lr=5e-4",
                "--optimizer.weight_decay=0.1",
                "--optimizer.beta1=0.9",
                "--optimizer.beta2=0.98",
                "--optimizer.eps=1e-6",
                "--lr_scheduler.warmup_steps=0",
                "--lr_scheduler.decay_type=none",
                "--eval.enable=false",
                "--metrics.enable_tensorboard=false",
                "--checkpoint.enable=false",
                f"--job.dump_folder={dump}",
                *extra,
            ]
        )
    )


def open_clip_twin(trainer: Trainer) -> torch.nn.Module:
    """open_clip's CLIP of our architecture, with our initial weights."""
    import open_clip

    args = trainer.model_args
    cfg = open_clip_config(args)["model_cfg"]
    # pool where ours pools (open_clip's default: argmax id)
    cfg["text_cfg"].update(pool_type="eos", eos_id=args.eos_id)
    model = open_clip.CLIP(**cfg, output_dict=True)
    # open_clip's ViT hard-codes 3 input channels: a 1-channel patch conv reads the same images with
    # ours' parameter count
    model.visual.conv1 = torch.nn.Conv2d(
        args.in_channels, args.vision_width, args.patch_size, args.patch_size, bias=False
    )
    model.load_state_dict(to_open_clip_state_dict(trainer.model.state_dict()))
    return model


# ------------------------------------------------------------------ 2. the losses: ours, dense, open_clip's

CLIP_SCALE, SIGLIP_SCALE, SIGLIP_BIAS = 1 / 0.07, 10.0, -10.0


def ours_loss(kind: str, zx: torch.Tensor, zy: torch.Tensor) -> torch.Tensor:
    """The one call site of our streaming loss (titan_contrastive.losses): StreamingClipStep's
    loss path, one process, PyTorch kernel, the trainer's default block size, fixed temperature
    (and bias). Accumulates dL/dzx, dL/dzy into .grad; returns the loss."""
    step = StreamingClipStep(
        stream_chunk_size=JobConfig().loss.stream_chunk_size,
        kernel="pytorch",
        objective=InfoNCE() if kind == "clip" else Sigmoid(),
        fixed_scale=CLIP_SCALE if kind == "clip" else SIGLIP_SCALE,
        fixed_bias=SIGLIP_BIAS if kind == "siglip" else None,
    )
    return step(lambda _: (zx * 1, zy * 1), [None])


def dense_loss(kind: str, zx: torch.Tensor, zy: torch.Tensor) -> torch.Tensor:
    loss = (
        InfoNCE().dense(zx, zy, torch.tensor(CLIP_SCALE))
        if kind == "clip"
        else Sigmoid().dense(zx, zy, torch.tensor(SIGLIP_SCALE), torch.tensor(SIGLIP_BIAS))
    )
    loss.backward()
    return loss.detach()


def open_clip_loss(kind: str, zx: torch.Tensor, zy: torch.Tensor) -> torch.Tensor:
    from open_clip.loss import ClipLoss, SigLipLoss  # SigLipLoss is not exported at the top level

    loss = (
        ClipLoss()(zx, zy, torch.tensor(CLIP_SCALE))
        if kind == "clip"
        else SigLipLoss()(zx, zy, torch.tensor(SIGLIP_SCALE), torch.tensor(SIGLIP_BIAS))
    )
    loss.backward()
    return loss.detach()


# ------------------------------------------------------------------ 3. MiniLM: our bi_encoder, sentence-transformers

CHUNK = 32


def wordnet_subset(folder: str, count: int) -> str:
    """`count` random pairs of the bundled WordNet training split (+ its test split) in `folder`, as
    `data.path`: each trainer then tokenizes these instead of all 115,659 pairs."""
    from titan_contrastive.datasets.wordnet import BUNDLE_DIR, load_pairs

    queries, docs = load_pairs(BUNDLE_DIR, "train")
    pick = torch.randperm(len(queries), generator=torch.Generator().manual_seed(0))[:count].tolist()
    (Path(folder) / "pairs_train.tsv.gz").write_bytes(
        gzip.compress("".join(f"{queries[i]}\t{docs[i]}\n" for i in pick).encode())
    )
    shutil.copy(BUNDLE_DIR / "pairs_test.tsv.gz", folder)
    return folder


def our_bi_encoder(n: int, flags: list[str], data: str, dump: str) -> Trainer:
    trainer = Trainer(
        parse_args(
            [
                "--job.config_file",
                str(REPO / "train_configs/wordnet_minilm.toml"),
                f"--data.path={data}",
                f"--training.local_batch_size={n}",
                "--training.device=cpu",
                "--loss.learn_logit_scale=false",
                "--eval.enable=false",
                "--metrics.enable_tensorboard=false",
                "--checkpoint.enable=false",
                f"--job.dump_folder={dump}",
                *flags,
            ]
        )
    )
    trainer.model.eval()  # dropout off: every side computes the same gradient
    return trainer


def encoder_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameter gradients of the (first) Hugging Face encoder inside `model`, by its own names."""
    from transformers import PreTrainedModel

    encoder = next(m for m in model.modules() if isinstance(m, PreTrainedModel))
    return {name: p.grad for name, p in encoder.named_parameters() if p.grad is not None}


def sentence_transformers_side(
    pad_id: int, scale: float, tokens: int
) -> tuple[torch.nn.Module, dict[str, torch.nn.Module]]:
    """MiniLM as a SentenceTransformer and its CachedMultipleNegativesRankingLoss: `sentence_transformers`
    in mini-batches of CHUNK sequences, `sentence_transformers_tokens` packed to `tokens` real tokens."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss  # >= 6

    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    model = SentenceTransformer(str(bundled_minilm()), device="cpu", local_files_only=True).eval()
    losses = {
        name: CachedMultipleNegativesRankingLoss(
            model,
            scale=scale,
            mini_batch_size=CHUNK,
            mini_batch_num_tokens=budget,
            directions=("query_to_doc", "doc_to_query"),
            partition_mode="per_direction",
        )
        for name, budget in (("sentence_transformers", None), ("sentence_transformers_tokens", tokens))
    }
    return model, losses
