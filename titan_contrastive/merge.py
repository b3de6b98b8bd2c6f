"""`python -m titan_contrastive.merge STEP STEP... --out DIR`: one model from several checkpoints of one architecture.

`--method mean` (the default) is a weighted average of their weights, a model soup (Wortsman et al. 2022), as
EmbeddingGemma and Gemini Embedding merge runs trained on different mixtures or seeds; `--method slerp` is the
spherical interpolation of two, as Qwen3-Embedding merges its checkpoints (mergekit's `slerp`). Each tensor, in
float64, with weights w_i (`--weights`, default equal) or the fraction t toward the second (`--t`, default 0.5):

    mean:   theta = sum_i w_i theta_i / sum_i w_i
    slerp:  theta = sin((1 - t) W) / sin W  a  +  sin(t W) / sin W  b,    W = arccos(<a, b> / (|a| |b|))
            of the tensors a, b flattened; (1 - t) a + t b where sin W < 1e-6 (parallel, or a zero tensor)

written back in the sources' dtype. Tensors that are not floating point (position ids and the like) must be equal
in every source and are kept.

STEP: our step folders (`.../checkpoint/step-N`) of any family, each verified against its manifest and read as
`export` reads them (`models.weights.read_ours`). Their manifests must name the same family and their weights the
same names and shapes; the runs may differ in everything else (data, objective, learning rate, seed). LoRA runs of
one model folder merge by mean, exactly: the average of the models W0 + s_i B_i A_i is one adapter of their summed
rank (`lora_merged`); their slerp is no adapter, and DoRA's magnitudes make no adapter of the average either, so
both are refused (export each run with its adapter merged, `--to hf`, and merge those folders with mergekit).

`--with-start` adds the run's start as the first source: the model its config built before the first step (the
folder at `model.path`, or `model.init_from`'s weights), so that `--weights 1,3` or slerp at `--t 0.75` is WiSE-FT
(Wortsman et al. 2022, robust fine-tuning: the fine-tune interpolated with the model it started from, weight 3/4
on the fine-tune). The start is built twice, under two seeds: a tensor that differs between the builds (a new head,
a model trained from scratch) is drawn at random, so the run's start is not known and the merge is refused naming
it; a LoRA run's fresh adapters (B = 0, A drawn) add nothing to it and are left out. Every STEP must name the same
start in its config.

DIR becomes a step folder holding the model alone (no optimizer or data state: it starts no resume), with a
manifest whose model and config are the first source's (a LoRA merge's with the merged rank and alpha) and whose
`merged` entry names the sources, the method and the weights; `export`, `evaluate`, `mine` and `embed` read it as a
run's, and clip's `[model] init_from` starts from it. It is written into a temporary folder beside DIR and renamed
when complete, never over an existing path.
Bad arguments are one `error: ...` line and exit code 2, before any weights are read.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

METHODS = ("mean", "slerp")
LORA_A = ("lora_A.default.weight", "lora_embedding_A.default")
LORA_B = ("lora_B.default.weight", "lora_embedding_B.default")
"""peft's names of a LoRA adapter's two factors (`components/lora.py`): B A is the update of the adapted weight."""
PARALLEL = 1e-6
"""sin W below which slerp interpolates linearly (mergekit's fallback for nearly parallel tensors)."""


class MergeError(ValueError):
    """A merge that cannot work, in one line."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m titan_contrastive.merge", description=__doc__.split("\n\n")[0])
    p.add_argument("sources", nargs="+", metavar="STEP", help="our step folders (.../checkpoint/step-N)")
    p.add_argument("--out", type=Path, required=True, help="the step folder to write (must not exist)")
    p.add_argument("--method", choices=METHODS, default="mean", help="mean: a weighted average; slerp: two sources")
    p.add_argument("--weights", default="", help="mean: one weight per STEP, comma-separated (default: equal)")
    p.add_argument("--t", type=float, default=0.5, help="slerp: the fraction of the way to the second STEP")
    p.add_argument(
        "--with-start", action="store_true", help="WiSE-FT: the runs' start (their model.path or init_from) first"
    )
    return p


def check(opts: argparse.Namespace) -> tuple[list[Path], list[float], Path]:
    """(the sources, their weights, the output folder), or a MergeError naming the argument (manifests only)."""
    sources = [Path(s).expanduser() for s in opts.sources]
    for src in sources:
        if not (src / "manifest.json").is_file():
            raise MergeError(f"STEP={src}: not one of our step folders (no manifest.json); give .../checkpoint/step-N")
    if len(set(s.resolve() for s in sources)) < len(sources):
        raise MergeError(f"STEP: {' '.join(map(str, sources))} names a folder twice; give each checkpoint once")
    count = len(sources) + opts.with_start  # the start is the first source
    if count < 2:
        raise MergeError(f"STEP={sources[0]}: one checkpoint; give two or more to merge, or add --with-start")
    weights = [1.0] * count
    if opts.method == "slerp":
        if count != 2:
            raise MergeError(f"--method slerp interpolates two checkpoints, and {count} are given; use mean")
        if opts.weights:
            raise MergeError(f"--weights={opts.weights}: slerp takes --t, the fraction toward the second; drop it")
        if not 0.0 <= opts.t <= 1.0:
            raise MergeError(f"--t={opts.t}: the fraction toward the second checkpoint, from 0 to 1")
    else:
        if opts.t != 0.5:
            raise MergeError(f"--t={opts.t} is slerp's; --method mean takes --weights")
        if opts.weights:
            try:
                weights = [float(w) for w in opts.weights.split(",")]
            except ValueError:
                raise MergeError(f"--weights={opts.weights}: numbers, comma-separated") from None
            if len(weights) != count or min(weights) < 0 or not math.isfinite(sum(weights)) or sum(weights) <= 0:
                each = "the start's first, then one per STEP" if opts.with_start else "one per STEP"
                raise MergeError(f"--weights={opts.weights}: {count} weights >= 0 ({each}), not all 0")
    out = Path(opts.out).expanduser()
    if out.exists() or out.is_symlink():
        raise MergeError(f"--out={out} exists; choose a new folder")
    if any(out.resolve().is_relative_to(s.resolve()) for s in sources):
        raise MergeError(f"--out={out} is inside a checkpoint it reads; choose a folder outside them")
    manifests = [json.loads((s / "manifest.json").read_text()) for s in sources]
    for src, manifest in zip(sources, manifests):
        model = manifest.get("model") or {}
        if model.get("family") != (manifests[0].get("model") or {}).get("family") or not model:
            raise MergeError(
                f"STEP={src}: a {model.get('family', 'unnamed')} model, and {sources[0]} holds a "
                f"{(manifests[0].get('model') or {}).get('family', 'unnamed')} one; merge checkpoints of one family"
            )
        if is_lora(manifest) != is_lora(manifests[0]):
            raise MergeError(
                f"STEP={src}: {'a LoRA run' if is_lora(manifest) else 'a full fine-tune'}, and {sources[0]} is "
                f"{'a LoRA run' if is_lora(manifests[0]) else 'a full fine-tune'}; merge runs of one kind (export "
                "the LoRA run with --to hf and merge the folders with mergekit)"
            )
        if is_lora(manifest) and opts.method == "slerp":
            raise MergeError(
                f"STEP={src}: a LoRA run, and the slerp of two models is no adapter; use --method mean, or export "
                "both with --to hf and slerp those folders with mergekit"
            )
        if is_lora(manifest) and model.get("args", {}).get("lora_dora"):
            raise MergeError(
                f"STEP={src}: DoRA adapters (lora.use_dora), whose magnitudes make the models' average no adapter; "
                "export each run with --to hf and merge those folders with mergekit"
            )
        if opts.with_start and start_of(manifest) != start_of(manifests[0]):
            raise MergeError(
                f"--with-start: STEP={src} started from {start_of(manifest) or 'random weights'!r} and {sources[0]} "
                f"from {start_of(manifests[0]) or 'random weights'!r}; merge runs of one start with it"
            )
    return sources, weights, out


def is_lora(manifest: dict[str, Any]) -> bool:
    """Whether a step folder's run trained LoRA adapters (its checkpoint holds what trained)."""
    return bool(manifest.get("config", {}).get("lora", {}).get("enable"))


def start_of(manifest: dict[str, Any]) -> str:
    """What a run's weights started from, as its config names it: `model.init_from`, else `model.path` ('': none)."""
    model = manifest.get("config", {}).get("model", {})
    return model.get("init_from") or model.get("path") or ""


def read_start(src: Path, manifest: dict[str, Any], args: Any) -> Any:
    """The model the run at `src` started from: built from its args as training built it (the folder at
    `model.path`), `model.init_from`'s weights loaded; a MergeError where a tensor differs between two builds
    under other seeds (drawn at random, so not the run's start), a LoRA adapter's A factors aside. The first build
    is kept as each tensor's digest only, so one model is held at a time."""
    import hashlib

    import torch

    from titan_contrastive.models.registry import get_model_spec, resolve_model_args
    from titan_contrastive.models.weights import load_state

    spec = get_model_spec(manifest["model"]["family"])
    init_from = manifest.get("config", {}).get("model", {}).get("init_from") or ""
    init = resolve_model_args(manifest["model"]["family"], "", init_from)[1] if init_from else None

    def build(seed: int) -> tuple[Any, dict[str, bytes]]:
        torch.manual_seed(seed)
        model = spec.build_model(args)
        if init is not None:
            fit = spec.state_dict_adapter.fit
            load_state(model, fit(init, args) if fit else init, f"model.init_from={init_from}")
        digests = {
            name: hashlib.blake2b(x.detach().reshape(-1).contiguous().view(torch.uint8).numpy()).digest()
            for name, x in model.state_dict().items()
            if x.is_floating_point() and not name.endswith(LORA_A)
        }
        return model, digests

    first = build(0)[1]
    model, second = build(1)
    drawn = [name for name, digest in first.items() if digest != second[name]]
    if drawn:
        raise MergeError(
            f"--with-start: {', '.join(drawn[:3])}{f' and {len(drawn) - 3} more' if len(drawn) > 3 else ''} of "
            f"{src}'s model start at random (not from {start_of(manifest) or 'a model.path or init_from'}), so the "
            "run's start is not known; merge step folders without --with-start"
        )
    return model


def merged(states: Sequence[dict[str, Any]], weights: Sequence[float], method: str, t: float) -> dict[str, Any]:
    """The merged state of `states` (same names and shapes), by `method` (see the module docstring)."""
    import torch

    out = {}
    for name, first in states[0].items():
        tensors = [state[name] for state in states]
        if not first.is_floating_point():
            if any(not torch.equal(x, first) for x in tensors[1:]):
                raise MergeError(f"{name}: a {first.dtype} tensor that differs between the checkpoints; they hold one")
            out[name] = first.clone()
            continue
        wide = [x.detach().to(torch.float64) for x in tensors]
        if method == "slerp":
            value = slerp(wide[0], wide[1], t)
        else:
            value = sum(w * x for w, x in zip(weights, wide)) / sum(weights)
        out[name] = value.to(first.dtype)
    return out


def slerp(a: Any, b: Any, t: float) -> Any:
    """The spherical interpolation of two tensors, flattened (the module docstring's formula)."""
    import torch

    norms = a.norm() * b.norm()
    cos = torch.clamp((a.flatten() @ b.flatten()) / norms, -1.0, 1.0) if norms > 0 else torch.ones((), dtype=a.dtype)
    angle = torch.arccos(cos)
    if torch.sin(angle) < PARALLEL:
        return (1 - t) * a + t * b
    return (torch.sin((1 - t) * angle) * a + torch.sin(t * angle) * b) / torch.sin(angle)


def read_models(sources: Sequence[Path]) -> list[tuple[Any, Any]]:
    """Each source's (model args, model), read as `export` reads them; a MergeError where their weights' names or
    shapes differ (a LoRA run's adapters may differ in rank)."""
    from titan_contrastive.models.weights import read_ours

    read, first = [], {}
    for src in sources:
        _, args, model = read_ours(src)
        state = model.state_dict()
        if read:
            shape = [k for k in first if not _adapter(k) and first[k].shape != state[k].shape]
            odd = sorted(set(first) ^ set(state)) or shape
            if odd:
                raise MergeError(
                    f"STEP={src}: its weights differ from {sources[0]}'s in {', '.join(odd[:3])}; merge "
                    "checkpoints of one architecture"
                )
        else:
            first = state
        read.append((args, model))
    return read


def _adapter(name: str) -> bool:
    """Whether the tensor `name` is a LoRA adapter's factor, whose rank may differ between runs."""
    return name.endswith(LORA_A + LORA_B)


def lora_merged(models: Sequence[tuple[Any, Any]], weights: Sequence[float]) -> tuple[dict[str, Any], int]:
    """(the trained tensors of one LoRA model that is the weighted average of the models, its rank R = sum_i r_i).

    Model i is W0 + s_i B_i A_i on each adapted weight (s_i = alpha_i / r_i, or alpha_i / sqrt(r_i) with rsLoRA), so
    the average W0 + sum_i (w_i / W) s_i B_i A_i is itself one adapter at scaling 1 (alpha = R): A' the A_i stacked,
    B' the B_i side by side, each times w_i s_i / W. An adapter whose B_i are all zero (a run's start) adds nothing
    and is left out of them, its weight still counted in W. Every other trained tensor (`modules_to_save`, the logit
    scale) is the weighted mean; the frozen base must be the same in every source."""
    import torch

    from titan_contrastive.checkpoint.stateful import without_frozen

    total = sum(weights)
    states = [model.state_dict() for _, model in models]
    trained = [without_frozen(model, state) for (_, model), state in zip(models, states)]
    if odd := sorted(set().union(*trained) - set(trained[0]).intersection(*trained[1:])):
        raise MergeError(
            f"{odd[0]}: trained in some runs and frozen in others; merge LoRA runs of the same lora.target_modules "
            "and lora.modules_to_save"
        )
    for name in sorted(set(states[0]) - set(trained[0])):
        if any(not torch.equal(state[name], states[0][name]) for state in states[1:]):
            raise MergeError(f"{name}: the runs' frozen base weights differ; merge LoRA runs of one model folder")
    live = [i for i, t in enumerate(trained) if any(x.any() for n, x in t.items() if n.endswith(LORA_B))]
    live = live or list(range(len(models)))
    out = {}
    for name, first in trained[0].items():
        tensors = [t[name].detach().to(torch.float64) for t in trained]
        if name.endswith(LORA_A):
            value = torch.cat([tensors[i] for i in live], 0)
        elif name.endswith(LORA_B):
            factors = [w * args.lora_alpha / _root(args) / total for w, (args, _) in zip(weights, models)]
            value = torch.cat([factors[i] * tensors[i] for i in live], 1)
        else:
            value = sum(w * x for w, x in zip(weights, tensors)) / total
        out[name] = value.to(first.dtype)
    return out, sum(models[i][0].lora_rank for i in live)


def _root(args: Any) -> float:
    """The divisor of a LoRA run's scaling: its rank, or its square root with rsLoRA."""
    return math.sqrt(args.lora_rank) if args.lora_rslora else float(args.lora_rank)


def write(out: Path, state: dict[str, Any], manifest: dict[str, Any], record: dict[str, Any]) -> None:
    """`state` as the model of a step folder at `out`, with the first source's model and config in its manifest
    and `record` as its `merged` entry; through a temporary folder beside it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from titan_contrastive.checkpoint.writer import install, out_of_space, write_manifest

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.merging-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        dcp.save({"model": state}, checkpoint_id=str(tmp), no_dist=True)
        entry = {"step": 0, "dp_degree": 1, "world_size": 1, "merged": record}
        write_manifest(tmp, entry | {key: manifest[key] for key in ("model", "config") if key in manifest})
        install(tmp, out)
    except CheckpointException as e:  # DCP's (a BaseException): named in one line, the partial folder removed
        full = out_of_space(e, out.parent)
        raise MergeError(f"--out={out}: {'no space left on device' if full else 'writing failed'} ({e})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(opts: argparse.Namespace) -> Path:
    sources, weights, out = check(opts)
    manifest = json.loads((sources[0] / "manifest.json").read_text())
    models = read_models(sources)
    if opts.with_start:
        models.insert(0, (models[0][0], read_start(sources[0], manifest, models[0][0])))
    if is_lora(manifest):
        state, rank = lora_merged(models, weights)
        manifest["model"]["args"] |= {"lora_rank": rank, "lora_alpha": float(rank), "lora_rslora": False}
        manifest["config"]["lora"] |= {"rank": rank, "alpha": float(rank), "use_rslora": False}
    else:
        state = merged([model.state_dict() for _, model in models], weights, opts.method, opts.t)
    how = {"t": opts.t} if opts.method == "slerp" else {"weights": weights}
    if opts.with_start:  # the first of the weights, the slerp's t = 0 end; an empty model.path: the folder it means
        how["start"] = start_of(manifest) or str(getattr(models[0][0], "model_dir", ""))
    write(out, state, manifest, {"method": opts.method, "sources": [str(s.resolve()) for s in sources], **how})
    return out


def main(argv: list[str] | None = None) -> int:
    opts = parser().parse_args(argv)
    try:
        out = run(opts)
    except (OSError, ValueError) as e:  # MergeError, WeightsError, a manifest that is not JSON
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    start = f" and {'their' if len(opts.sources) > 1 else 'its'} start" if opts.with_start else ""
    print(f"wrote {out}: {opts.method} of {len(opts.sources)} checkpoint{'s' * (len(opts.sources) > 1)}{start}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
