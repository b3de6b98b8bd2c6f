"""The model a run trains: its objective (`resolve_objective`), and the family's args sized by the data and
the config, built on the device, started from `[model] init_from`'s weights when given, with its
locked towers frozen (`build_run_model`), and the frozen guide of its masks or teacher (`build_guide`); all
before any parallel wrapping (sharding, DDP) and before the optimizer sees a parameter; and the
clamp of a learned logit scale after each step."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from titan_contrastive.components.freeze import apply_freeze
from titan_contrastive.config import ConfigError, JobConfig
from titan_contrastive.config.job_config import MAX_LOGIT_SCALE
from titan_contrastive.losses import Objective, build_objective
from titan_contrastive.losses.late_interaction import late_interaction
from titan_contrastive.losses.layers import AdaptiveLayers
from titan_contrastive.models.registry import ModelSpec, family_of, get_model_spec, list_models
from titan_contrastive.models.weights import load_state

ADAPTIVE_DEFAULTS = {
    "adaptive_layer_weights": [],
    "adaptive_layers_per_step": 0,
    "adaptive_final_norm": False,
    "adaptive_kl_weight": 1.0,
    "adaptive_kl_temperature": 0.3,
}
"""`[loss]`'s settings of adaptive layers, as they are without the layers."""


def resolve_objective(spec: ModelSpec, cfg: JobConfig, args: Any = None) -> Objective | None:
    """The objective `[loss]` describes (`losses.build_objective`), or None for a family whose own
    step computes its own loss (`spec.own_loss`); scored by late interaction where the model's `args` embed a
    text as tokens (`token_dim`, `losses/late_interaction.py`). ConfigError for an unknown objective, another
    loss for such a family, an objective that reads a bias the family's model does not learn, or one that
    reads a single vector per text where the model gives tokens."""
    if cfg.loss.maxsim_normalize and not getattr(args, "token_dim", 0):
        raise ConfigError(
            "loss.maxsim_normalize=true: it normalizes late interaction's scores, and this model gives one vector per "
            "text; set model.pooling=colbert or remove it"
        )
    if spec.own_loss:
        if cfg.loss.name not in ("", spec.own_loss):
            raise ConfigError(
                f"loss.name={cfg.loss.name!r}: the {spec.name} family trains with {spec.own_loss!r} (its own step); "
                f"set loss.name={spec.own_loss} or leave it empty"
            )
        return None
    objective = build_objective(cfg.loss)
    if objective.has_bias and not spec.learns_bias:
        raise ConfigError(
            f"loss.name={cfg.loss.name!r}: {objective.describe()} reads a learned logit bias, which the {spec.name} "
            "family's model does not have; use an objective without a bias (e.g. leave loss.name empty)"
        )
    token_dim = getattr(args, "token_dim", 0)
    if token_dim:
        try:
            return late_interaction(objective, token_dim, cfg.loss.maxsim_normalize)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    return _adaptive(objective, cfg, spec, args)


def _adaptive(objective: Objective, cfg: JobConfig, spec: ModelSpec, args: Any) -> Objective:
    """`objective` at the model's earlier exits too (`[loss] adaptive_layers`, `losses/layers.py`), else itself;
    ConfigError for the settings without the layers, or the layers on a model without exits."""
    loss = cfg.loss
    layers = loss.adaptive_layers
    if not layers:
        for key, default in ADAPTIVE_DEFAULTS.items():
            if getattr(loss, key) != default:
                raise ConfigError(
                    f"loss.{key}={getattr(loss, key)} applies to the earlier layers' terms, and loss.adaptive_layers "
                    "is empty: give the layers, or leave it out"
                )
        return objective
    if not getattr(args, "exits", ()):
        raise ConfigError(
            f"loss.adaptive_layers={layers}: it trains the earlier layers of a bi_encoder's towers, and the "
            f"{spec.name} family's model embeds with its last alone; use model.name=bi_encoder or leave it empty"
        )
    weights = loss.adaptive_layer_weights or [1 / len(layers)] * len(layers)
    if len(weights) != len(layers):
        raise ConfigError(
            f"loss.adaptive_layer_weights={loss.adaptive_layer_weights}: one weight per loss.adaptive_layers entry "
            f"({len(layers)}), or leave it empty for 1 / {len(layers)} each"
        )
    try:
        return AdaptiveLayers(
            objective, args.width, tuple(float(w) for w in weights), loss.adaptive_kl_weight,
            loss.adaptive_kl_temperature, loss.adaptive_layers_per_step, cfg.training.seed,
        )  # fmt: skip
    except ValueError as err:
        raise ConfigError(str(err)) from None


def eval_objective(spec: ModelSpec, cfg: JobConfig, args: Any = None) -> Objective | None:
    """The objective of the evaluation loss: the run's, without the duplicate mask (evaluation
    embeds documents without their token ids; a held-out set seldom repeats a document) and without
    a distillation term (held-out pairs carry no teacher scores): the contrastive objective, unweighted."""
    if not cfg.loss.mask_duplicates and not cfg.loss.distill and not cfg.loss.adaptive_layers:
        return resolve_objective(spec, cfg, args)
    loss = dataclasses.replace(
        cfg.loss,
        adaptive_layers=[],  # evaluation's loss is the last layer's
        **ADAPTIVE_DEFAULTS,
        mask_duplicates=False,
        distill="",
        distill_minmax=False,
        distill_symmetric=False,
        cosent_similarity="cosine",
        contrastive_weight=1.0,
        teacher_model="",
        teacher_embeddings="",
    )
    return resolve_objective(spec, dataclasses.replace(cfg, loss=loss), args)


def run_objectives(
    spec: ModelSpec, cfg: JobConfig, args: Any, guide: nn.Module | None = None, frozen: Any = None
) -> tuple[Objective | None, Objective | None]:
    """(the training objective, the evaluation loss's) of a run whose model has `args`; once its teacher is built
    (`guide`) or read (`frozen`), with `[loss] distill_temperature = 0` set to the teacher's own (`own_temperature`)."""
    if guide is not None or frozen is not None:
        cfg = own_temperature(spec, cfg, guide, frozen)
    return resolve_objective(spec, cfg, args), eval_objective(spec, cfg, args)


def build_run_model(
    spec: ModelSpec,
    cfg: JobConfig,
    flavor_args: Any,
    data: Any,
    init_state: dict[str, torch.Tensor] | None,
    param_dtype: torch.dtype,
    device: torch.device,
) -> tuple[Any, nn.Module, nn.Module | None]:
    """(args, model, guide): `flavor_args` (already through its `update_from_config`) sized by the run's
    data (a datasets.build.DataBundle: the training set's image shape, vocabulary and EOS, the context
    length), the model built in `param_dtype` on `device`, `init_state` loaded, `model.freeze` applied;
    the frozen guide or teacher model (`build_guide`; None without), built first."""
    train_set, context_length = data.train_set, data.context_length
    try:
        sized = flavor_args.update_from_data(
            image_shape=train_set.image_shape,
            vocab_size=train_set.tokenizer.vocab_size,
            context_length=context_length,
            eos_id=getattr(train_set.tokenizer, "EOS", 0),
        )
    except ValueError as e:  # the flavor does not fit this dataset
        raise ConfigError(f"model.flavor={cfg.model.flavor!r} with data.dataset={cfg.data.dataset!r}: {e}") from None
    if getattr(sized, "include_prompt", True) is False and getattr(train_set, "own_prompts", 0):
        raise ConfigError(
            f"data.path={cfg.data.path}: {train_set.own_prompts} rows give their query a prompt of their own (a "
            "`prompt` column), and the model pools without its prompt (include_prompt false), which is counted from "
            "one prompt per side; drop the column (set model.query_prompt) or set model.include_prompt=true"
        )
    guide = build_guide(spec, cfg, sized, param_dtype, device)
    with device:
        model = spec.build_model(sized).to(param_dtype)
    if init_state is not None:  # the checkpoint's weights, fitted to the run's sizes, before any sharding
        fit = spec.state_dict_adapter.fit
        load_state(model, fit(init_state, sized) if fit else init_state, f"model.init_from={cfg.model.init_from}")
    apply_freeze(model, cfg.model.freeze, cfg.model.unlocked_layers, spec.towers)
    return sized, model, guide


def build_guide(
    spec: ModelSpec, cfg: JobConfig, args: Any, param_dtype: torch.dtype, device: torch.device
) -> nn.Module | None:
    """The run's frozen model: `[loss] guide_model`, whose cosines decide the false-negative masks
    (GISTEmbed, `losses/guide.py`), and/or `[loss] teacher_model`, whose cosines are a distillation's
    targets (`losses/distill.py`; one model when both name the same folder), in `param_dtype` on `device`, in eval
    mode; None when neither is set. Read by the family (`spec.read_guide`: the args of a model that reads the run's
    inputs, and the weights to load after the build where the build does not read its folder)."""
    loss = cfg.loss
    if loss.guide_model and loss.teacher_model and loss.guide_model != loss.teacher_model:
        raise ConfigError(
            f"loss.teacher_model={loss.teacher_model!r} and loss.guide_model={loss.guide_model!r}: a run holds one "
            "frozen model; give both the same folder, or leave one empty"
        )
    key = "loss.guide_model" if loss.guide_model else "loss.teacher_model"
    path = loss.guide_model or loss.teacher_model
    if not path:
        return None
    if spec.read_guide is None:
        takers = ", ".join(name for name in list_models() if get_model_spec(name).read_guide is not None)
        raise ConfigError(
            f"{key}={path!r}: the {spec.name} family takes no frozen guide or teacher model ({takers} do); leave it "
            "empty"
        )
    try:
        guide_args, state = spec.read_guide(args, path)
    except ConfigError as e:  # the folder's own message, about the guide's setting
        message = str(e).replace("model.path", key)
        raise ConfigError(message if message.startswith(key) else f"{key}={path!r}: {message}") from None
    except ValueError as e:  # a checkpoint the family cannot read, or one that cannot read the run's inputs
        raise ConfigError(f"{key}={path!r}: {e}") from None
    with device:
        guide = family_of(guide_args).build_model(guide_args).to(param_dtype)
    if state is not None:
        load_state(guide, state, f"{key}={path}")
    return guide.requires_grad_(False).eval()


def own_temperature(spec: ModelSpec, cfg: JobConfig, guide: nn.Module | None, frozen: Any) -> JobConfig:
    """`cfg` with `[loss] distill_temperature = 0` set to the teacher's own temperature, 1 / exp(logit_scale): the
    teacher model's where the family's guides keep theirs (`spec.guide_temperature`), else the one its file of
    embeddings keeps (`frozen`: a `datasets.frozen.EmbeddingTable`; `embed_images`' .parquet); a ConfigError for a
    teacher without one. `cfg` itself for any other temperature."""
    loss = cfg.loss
    if loss.distill_temperature != 0:
        return cfg
    if guide is not None and spec.guide_temperature:
        scale = float(guide.logit_scale.detach().float().reshape(-1)[0])
    elif guide is None and frozen is not None and frozen.logit_scale is not None:
        scale = frozen.logit_scale
    else:
        source = f"loss.teacher_model={loss.teacher_model!r}" if guide is not None else frozen.source
        raise ConfigError(
            f"loss.distill_temperature=0 takes the teacher's own temperature, and {source} "
            "keeps none (a CLIP or SigLIP teacher of the clip or hf_clip family does, and a .parquet file embed_images "
            "wrote with one): set a number > 0"
        )
    return dataclasses.replace(cfg, loss=dataclasses.replace(loss, distill_temperature=math.exp(-scale)))


def clamp_logit_scale(model: nn.Module) -> None:
    """A learned `logit_scale` is kept in [0, log 100] after each optimizer step, as CLIP does; a fixed one stays."""
    if (scale := getattr(model, "logit_scale", None)) is not None and scale.requires_grad:
        with torch.no_grad():
            scale.clamp_(0, MAX_LOGIT_SCALE)
