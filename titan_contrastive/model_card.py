"""The model card (`README.md`) `export` leaves beside what it writes from one of our step folders, as
sentence-transformers' `save` and PEFT's `save_pretrained` leave theirs: the card the target library wrote (if any),
its metadata completed (`library_name`, `pipeline_tag`, `base_model` where the run's `model.path` names a Hugging Face
model, a `titan-contrastive` tag, the evaluation sets' scores as the Hub's `model-index`), and a section of the run:
the step exported, the batch, the evaluation recorded at that step, and every setting the run changed from the
defaults as command-line overrides, which rebuild its config (the data they name must be where they say). Read and
written through `huggingface_hub`'s `ModelCard` (a dependency of tokenizers), so the Hub reads what it reads of its
own cards."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import asdict
from pathlib import Path
from typing import Any

__all__ = ["CARD", "base_model", "eval_results", "overrides", "write_card"]

CARD = "README.md"
TAG = "titan-contrastive"

LIBRARIES = {
    "sentence-transformers": ("sentence-transformers", "sentence-similarity"),
    "hf": ("transformers", "feature-extraction"),
    "peft": ("peft", "feature-extraction"),
    "pylate": ("PyLate", "sentence-similarity"),
    "colpali": ("colpali", "visual-document-retrieval"),
    "model2vec": ("model2vec", "sentence-similarity"),
    "open_clip": ("open_clip", "zero-shot-image-classification"),
}
"""`--to` -> the card's `library_name` and `pipeline_tag` (where the library's own card sets none)."""

USAGE = {
    "sentence-transformers": "from sentence_transformers import SentenceTransformer\n\n"
    'model = SentenceTransformer("{dir}")',
    "hf": 'from transformers import AutoModel\n\nmodel = AutoModel.from_pretrained("{dir}")',
    "peft": 'from peft import PeftModel\n\nmodel = PeftModel.from_pretrained(base, "{dir}")  # base: model.path',
    "pylate": 'from pylate import models\n\nmodel = models.ColBERT("{dir}")',
    "colpali": "from colpali_engine.models import ColQwen2  # ColQwen2_5 for Qwen2.5-VL\n\n"
    'model = ColQwen2.from_pretrained("{dir}")',
    "model2vec": 'from model2vec import StaticModel\n\nmodel = StaticModel.from_pretrained("{dir}")',
    "open_clip": 'import open_clip\n\nmodel = open_clip.create_model("local-dir:{dir}")',
}

BUNDLED = "sentence-transformers/all-MiniLM-L6-v2"
"""What an empty `model.path` of a text family is (`bi_encoder.folder.bundled_minilm`)."""

_CACHED = re.compile(r"models--([\w.-]+)--([\w.-]+)")
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def base_model(path: str, family: str) -> str | None:
    """The Hugging Face id `model.path` names: a hub id, a folder of the Hugging Face cache (`models--org--name`),
    or, empty for a text family, the bundled MiniLM; None for a folder of one's own or a model built from scratch."""
    if not path:
        return BUNDLED if family in ("bi_encoder", "static") else None
    cached = next((m for part in Path(path).parts if (m := _CACHED.fullmatch(part))), None)
    if cached:
        return f"{cached[1]}/{cached[2]}"
    return path if _HUB_ID.fullmatch(path) and not Path(path).expanduser().exists() else None


def overrides(config: dict[str, dict[str, Any]]) -> list[str]:
    """The run's settings other than the defaults (the `[job]` section's aside), as `--section.key=value` arguments
    that `config.parse_args` reads back (a list as a TOML array); keys this version does not know are left out."""
    from titan_contrastive.config.job_config import JobConfig

    defaults = asdict(JobConfig())
    args = []
    for section, values in config.items():
        for key, value in values.items():
            known = defaults.get(section, {})
            if section == "job" or key not in known or value == known[key] or value is None:
                continue
            text = json.dumps(value) if isinstance(value, list | bool) else str(value)
            args.append(f"--{section}.{key}={text}")
    return args


def eval_results(scores: dict[str, float], config: dict[str, dict[str, Any]]) -> list[Any]:
    """The scores of the run's evaluation sets (`config.evaluation.EVAL_SETS`, keys `{set}/...`) as the Hub's
    `model-index` results (huggingface_hub's EvalResult), each set named by its file or folder (a folder's split
    given); the run's own split's and zero-shot keys, and those at a Matryoshka cut, stay in the card's table only."""
    from huggingface_hub import EvalResult

    from titan_contrastive.config.evaluation import EVAL_SETS

    evaluation, results = config.get("eval", {}), []
    for kind in EVAL_SETS:
        path = str(evaluation.get(f"{kind.name}_path") or "")
        if not path:
            continue
        dataset = "wordnet_beir" if path == "bundled" else Path(path.rstrip("/")).stem
        split = None if Path(path).suffix else evaluation.get(f"{kind.name}_split")  # a file has none
        for key, value in scores.items():
            if key.startswith(f"{kind.name}/"):
                results.append(
                    EvalResult(
                        task_type=kind.task,
                        dataset_type=dataset,
                        dataset_name=dataset,
                        dataset_split=split,
                        metric_type=key.split("/", 1)[1],
                        metric_value=value,
                        metric_name=key,
                    )
                )
    return results


def write_card(src: str | Path, out: Path, to: str, name: str) -> None:
    """Complete or write `out/README.md` for an export of `src` to be named `name` (see the module docstring);
    nothing for a source that is not one of our step folders (no manifest: a Hugging Face or open_clip checkpoint
    converted)."""
    from huggingface_hub import ModelCard

    try:
        manifest = json.loads((Path(src).expanduser() / "manifest.json").read_text())
        family, config = manifest["model"]["family"], manifest.get("config", {})
    except (OSError, ValueError, KeyError, TypeError):
        return
    file = out / CARD
    library, pipeline = LIBRARIES.get(to, (None, None))
    usage = USAGE.get(to, "").format(dir=name)
    card = ModelCard.load(file) if file.is_file() else ModelCard(f"---\n---\n\n# {name}\n\n```python\n{usage}\n```\n")
    data = card.data
    data.library_name = data.library_name or library
    data.pipeline_tag = data.pipeline_tag or pipeline
    data.tags = [*(data.tags or []), *([] if TAG in (data.tags or []) else [TAG])]
    base = base_model(config.get("model", {}).get("path", ""), family)
    local = isinstance(data.base_model, str) and Path(data.base_model).is_absolute()  # PEFT's: the folder loaded
    if base or local:  # a local folder is no Hub id: ours in its place, or none
        data.base_model = base
        kept = [t for t in data.tags if not (t.startswith("base_model:") and Path(t.rsplit(":", 1)[-1]).is_absolute())]
        kinds = [t.rsplit(":", 1)[0] for t in data.tags if t not in kept]
        data.tags = kept + ([f"{kind}:{base}" for kind in kinds] if base else [])
    results = eval_results(_scores(manifest), config)
    if results:
        data.model_name = data.model_name or name
        data.eval_results = [*(data.eval_results or []), *results]
    card.text = card.text.rstrip() + "\n\n" + _section(manifest, family, config, to) + "\n"
    card.save(file)


def _scores(manifest: dict[str, Any]) -> dict[str, float]:
    """The evaluation the manifest records at its step (its numbers but the sample count)."""
    return {k: v for k, v in manifest.get("eval", {}).items() if isinstance(v, int | float) and k != "num_samples"}


def _section(manifest: dict[str, Any], family: str, config: dict[str, Any], to: str) -> str:
    step, training = manifest.get("step"), config.get("training", {})
    local, dp = training.get("local_batch_size"), manifest.get("dp_degree", 1)
    total = training.get("global_batch_size") or -1
    accumulation = total // (local * dp) if local and total > 0 else 1
    lines = [
        "## Training with titan_contrastive",
        "",
        f"Trained with titan_contrastive (model family `{family}`) and exported with "
        f"`python -m titan_contrastive.export --to {to}` from checkpoint `step-{step}` of "
        + (f"a run of {training['epochs']} epoch(s)." if training.get("epochs") else f"{training.get('steps')} steps."),
    ]
    if local:
        lines.append(
            f"A step's batch: {local * accumulation * dp} ({local} a microbatch x {accumulation} accumulation steps x "
            f"{dp} data-parallel rank(s))."
        )
    scores = _scores(manifest)
    if scores:
        lines += ["", f"### Evaluation at step {step}", "", "| Metric | Value |", "|:--|--:|"]
        lines += [f"| {name} | {value:.4f} |" for name, value in scores.items()]
    args = overrides(config)
    if args:
        lines += [
            "",
            "### Settings",
            "",
            "What the run set other than titan_contrastive's defaults; with its data where these paths say, this "
            "trains it again:",
            "",
            "```bash",
            "python -m titan_contrastive.train \\",
            *[f"    {shlex.quote(a)} \\" for a in args[:-1]],
            f"    {shlex.quote(args[-1])}",
            "```",
        ]
    return "\n".join(lines)
