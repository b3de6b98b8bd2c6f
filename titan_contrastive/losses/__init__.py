"""The objectives, each one object in its own module, named here.

| `[loss] name` | objective | module |
| --- | --- | --- |
| `clip` | InfoNCE, symmetric or one-way (+ joint directions), hard negatives as extra columns | `infonce.py` |
| `siglip` | SigLIP's sigmoid loss, hard negatives as extra columns | `sigmoid.py` |
| `pairwise` | softplus of the hardest in-batch negative minus the positive (and each hard negative) | `pairwise.py` |

InfoNCE also takes joint directions (`directions.py`) and hardness weighting (`hardness.py`).
Every objective takes the false-negative mask (`masking.py`), may add a term on the data's scores
(`distill.py`: a teacher's, or CoSENT's ranking), a teacher's embeddings (`embedding_distill.py`), a spread-out
regularizer (`spread.py`) and SPLADE's sparsity term (`flops.py`), and be
wrapped in Matryoshka prefixes (`matryoshka.py`); `base.py` says what an objective is. A ColBERT model's run takes each
objective's twin over MaxSim (`maxsim.py`): `late_interaction.py` (InfoNCE, the pairwise loss), `late_sigmoid.py`.
A new objective is a module with such an object and one `register_objective` call (the pixel loss is the vae family's
own step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from titan_contrastive.config import ConfigError
from titan_contrastive.losses.base import (
    MicrobatchLoss,
    Objective,
    Ranks,
    RescaleAccumulatedLoss,
    StreamResult,
    split_documents,
    split_ids,
)
from titan_contrastive.losses.distill import Distillation, Distilled
from titan_contrastive.losses.embedding_distill import EmbeddingDistilled
from titan_contrastive.losses.flops import Flops
from titan_contrastive.losses.hardness import Hardness
from titan_contrastive.losses.infonce import InfoNCE
from titan_contrastive.losses.masking import FalseNegatives
from titan_contrastive.losses.matryoshka import Matryoshka
from titan_contrastive.losses.pairwise import Pairwise
from titan_contrastive.losses.sigmoid import Sigmoid
from titan_contrastive.losses.spread import Spread

__all__ = [
    "OBJECTIVES",
    "Distillation",
    "Distilled",
    "EmbeddingDistilled",
    "FalseNegatives",
    "Flops",
    "Hardness",
    "InfoNCE",
    "Matryoshka",
    "MicrobatchLoss",
    "Objective",
    "Pairwise",
    "Ranks",
    "RescaleAccumulatedLoss",
    "Sigmoid",
    "Spread",
    "StreamResult",
    "Temperature",
    "build_objective",
    "register_objective",
    "split_documents",
    "split_ids",
    "temperature_from_config",
]

# `[loss] name` -> (the [loss] section, its false-negative mask) -> the objective
ObjectiveBuilder = Callable[[Any, FalseNegatives], Objective]


def _pairwise(loss: Any, masking: FalseNegatives) -> Pairwise:
    """The pairwise loss of `[loss]`, its false-negative mask removing candidates from its terms."""
    return Pairwise(loss.pairwise_in_batch_weight, loss.pairwise_in_batch, masking)


OBJECTIVES: dict[str, ObjectiveBuilder] = {
    "clip": lambda loss, masking: InfoNCE(
        loss.symmetric, masking, tuple(loss.joint_directions), Hardness(loss.hardness_mode, loss.hardness_strength)
    ),
    "siglip": lambda loss, masking: Sigmoid(false_negatives=masking),
    "pairwise": _pairwise,
}
DEFAULT = "clip"


def register_objective(name: str, build: ObjectiveBuilder) -> None:
    """Make `[loss] name = NAME` build an objective (see `OBJECTIVES`)."""
    OBJECTIVES[name] = build


def build_objective(loss: Any, name: str | None = None) -> Objective:
    """The objective `[loss]` (a config.job_config.Loss) describes, named `name` (default
    `loss.name`, or clip when empty); ConfigError for an unknown name or bad Matryoshka settings."""
    name = name or loss.name or DEFAULT
    if name not in OBJECTIVES:
        raise ConfigError(f"loss.name={name!r} is not an objective; valid: {', '.join(sorted(OBJECTIVES))}")
    masking = FalseNegatives(loss.mask_duplicates, loss.mask_margin, loss.mask_relative)
    guide_key, guide = _frozen(loss, "guide")
    teacher_key, teacher = _frozen(loss, "teacher")
    if guide and loss.mask_margin is None and loss.mask_relative is None:
        raise ConfigError(
            f"{guide_key}={guide!r} decides the margin and relative masks, and neither is set: set "
            "loss.mask_margin (GISTEmbed's margin m is mask_margin = -m) or loss.mask_relative"
        )
    try:
        objective = OBJECTIVES[name](loss, masking)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if loss.joint_directions and tuple(getattr(objective, "directions", ())) != tuple(loss.joint_directions):
        raise ConfigError(
            f"loss.joint_directions={loss.joint_directions}: loss.name={name!r} does not take them; "
            "they are InfoNCE's (loss.name=clip with loss.symmetric=false)"
        )
    if loss.hardness_strength and getattr(objective, "hardness", None) != Hardness(
        loss.hardness_mode, loss.hardness_strength
    ):
        raise ConfigError(
            f"loss.hardness_strength={loss.hardness_strength}: loss.name={name!r} does not take it; "
            "it is InfoNCE's (loss.name=clip with loss.symmetric=false)"
        )
    if loss.pairwise_in_batch_weight != 0.5 and name != "pairwise":
        raise ConfigError(
            f"loss.pairwise_in_batch_weight={loss.pairwise_in_batch_weight} weighs the pairwise loss's terms, and "
            f"loss.name={name!r}: set loss.name=pairwise or leave the weight at 0.5"
        )
    if loss.pairwise_in_batch != "hardest" and name != "pairwise":
        raise ConfigError(
            f"loss.pairwise_in_batch={loss.pairwise_in_batch} picks the pairwise loss's in-batch term, and "
            f"loss.name={name!r}: set loss.name=pairwise or leave it at hardest"
        )
    if loss.distill:
        try:
            distillation = Distillation(
                loss.distill,
                loss.distill_weight,
                loss.distill_temperature,
                teacher_key if teacher else "",
                loss.cosent_similarity,
                loss.distill_minmax,
                loss.distill_symmetric,
            )
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if distillation.kind == "mse" and loss.matryoshka_dims:
            raise ConfigError(
                f"loss.distill=mse compares the model's whole embeddings with the teacher's, and "
                f"loss.matryoshka_dims={loss.matryoshka_dims} trains prefixes of them: leave one of them out"
            )
        wrap = EmbeddingDistilled if distillation.kind == "mse" else Distilled
        objective = wrap(objective, distillation, loss.contrastive_weight)
    elif loss.cosent_similarity != "cosine":
        raise ConfigError(
            f"loss.cosent_similarity={loss.cosent_similarity} scores CoSENT's pairs, and loss.distill is empty: set "
            "loss.distill=cosent (AnglE) or leave it at cosine"
        )
    elif loss.distill_minmax:
        raise ConfigError(
            "loss.distill_minmax=true scales the student's logits for a distillation term, and loss.distill is "
            "empty: set loss.distill=kl or leave it false"
        )
    elif loss.distill_symmetric:
        raise ConfigError(
            "loss.distill_symmetric=true distills the columns' direction too, and loss.distill is empty: set "
            "loss.distill=kl with loss.teacher_model, or leave it false"
        )
    elif teacher:
        raise ConfigError(
            f"{teacher_key}={teacher!r} scores the problem for a distillation term, and loss.distill "
            f"is empty: set loss.distill=kl (or mse) or leave {teacher_key} empty"
        )
    elif loss.contrastive_weight != 1.0:
        raise ConfigError(
            f"loss.contrastive_weight={loss.contrastive_weight} weighs the objective against a distillation term, and "
            "loss.distill is empty: set loss.distill (kl, margin_mse or cosent) or leave the weight at 1"
        )
    for side in ("query", "doc"):
        threshold, weight = getattr(loss, f"flops_{side}_threshold"), getattr(loss, f"flops_{side}_weight")
        if threshold and not weight:
            raise ConfigError(
                f"loss.flops_{side}_threshold={threshold} picks the rows of a FLOPS term, and loss.flops_{side}_weight "
                f"is 0: set the weight, or leave the threshold at 0"
            )
    if loss.flops_query_weight or loss.flops_doc_weight:
        objective = Flops(
            objective, loss.flops_query_weight, loss.flops_doc_weight, loss.flops_warmup_steps,
            query_threshold=loss.flops_query_threshold, doc_threshold=loss.flops_doc_threshold,
        )  # fmt: skip
    elif loss.flops_warmup_steps:
        raise ConfigError(
            f"loss.flops_warmup_steps={loss.flops_warmup_steps} schedules the FLOPS weights, and "
            "loss.flops_query_weight and flops_doc_weight are 0: set them, or leave the warmup at 0"
        )
    if loss.gor_weight or loss.gor_mean_weight:
        objective = Spread(objective, loss.gor_mean_weight, loss.gor_weight, loss.gor_aggregation)
    elif loss.gor_aggregation != "sum":
        raise ConfigError(
            f"loss.gor_aggregation={loss.gor_aggregation!r} combines GOR's columns, and loss.gor_weight and "
            "loss.gor_mean_weight are 0: set one of them, or leave the aggregation at sum"
        )
    if not loss.matryoshka_dims:
        if loss.matryoshka_weights:
            raise ConfigError(
                f"loss.matryoshka_weights={loss.matryoshka_weights} without loss.matryoshka_dims: give the dims too"
            )
        return objective
    weights = loss.matryoshka_weights or [1.0] * len(loss.matryoshka_dims)
    if len(weights) != len(loss.matryoshka_dims):
        raise ConfigError(
            f"loss.matryoshka_weights={loss.matryoshka_weights}: one weight per loss.matryoshka_dims entry "
            f"({len(loss.matryoshka_dims)}), or leave it empty for all 1"
        )
    return Matryoshka(objective, tuple(loss.matryoshka_dims), tuple(float(w) for w in weights))


def _frozen(loss: Any, role: str) -> tuple[str, str]:
    """(the config key, its value) naming the run's frozen `role` ("guide" or "teacher"): a model folder
    (`loss.<role>_model`) or a file of its embeddings (`loss.<role>_embeddings`); ("", "") when neither is set."""
    for key in (f"{role}_model", f"{role}_embeddings"):
        if value := getattr(loss, key):
            return f"loss.{key}", value
    return "", ""


class Temperature(NamedTuple):
    """The temperature (and bias) a contrastive model starts from, and which of them train."""

    init_logit_scale: float
    init_logit_bias: float | None
    learn_logit_scale: bool
    learn_logit_bias: bool


def temperature_from_config(cfg: Any, default_logit_scale: float | None = None) -> Temperature:
    """`[loss] init_logit_scale / init_logit_bias / learn_*` for a model's args; unset values come
    from the objective, or `default_logit_scale` (a pretrained family's own). A bias for an
    objective without one is a one-line error (it would be silently unused)."""
    loss = cfg.loss
    objective = build_objective(loss)
    if not objective.has_bias and loss.init_logit_bias is not None:
        raise ConfigError(
            f"loss.init_logit_bias={loss.init_logit_bias}: loss.name={objective.name!r} has no bias; "
            "use --loss.name=siglip or leave loss.init_logit_bias empty"
        )
    scale = (
        loss.init_logit_scale
        if loss.init_logit_scale is not None
        else (objective.init_logit_scale if default_logit_scale is None else default_logit_scale)
    )
    bias = objective.init_logit_bias if loss.init_logit_bias is None else loss.init_logit_bias
    return Temperature(scale, bias, loss.learn_logit_scale, loss.learn_logit_bias)
