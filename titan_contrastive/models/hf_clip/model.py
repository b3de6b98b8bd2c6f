"""HFClip: a Hugging Face CLIP, MetaCLIP 2, SigLIP or SigLIP 2 model from a local folder, trained as an image-text
dual encoder with every step kind (GradCache, accumulation, global negatives) and either objective.

`[model] path` is a transformers folder (`CLIPModel.save_pretrained` / `MetaClip2Model` / `SiglipModel` /
`Siglip2Model`, with its tokenizer and `preprocessor_config.json`). transformers' own modules do the compute:
the model is split into two sides, `visual` (the vision transformer, then CLIP's `visual_projection`) and `text`
(the text transformer, then CLIP's `text_projection`; SigLIP's heads live inside its transformers),
so that each side is a tower `[model] freeze` can lock. Each side's pooled output is L2-normalized,
as `get_image_features` / `get_text_features` and the logits of the models' own forward are.

What the batches hold is what the folder's processor gives the model:
- images at the folder's `vision_config.image_size` (or `[data] image_size`: its position table resized,
  `resize_vision_positions`), resized with its `resample` filter, normalized with
  its `image_mean` and `image_std` (the `FOLDER_IMAGES` layout); evaluated as its processor frames them
  (CLIP: the central square; SigLIP: the whole image squashed), trained on our random-resized crops;
- SigLIP 2 (NaFlex) reads patches instead, as its processor makes them: each picture (its train crop)
  at its own aspect ratio in at most `max_num_patches` patches, zero-padded, with their
  `pixel_attention_mask` and `spatial_shapes` (`datasets.naflex`; `naflex.py` here). The folder's
  processor sets `max_num_patches`, or `[data] image_size = S` sets `(S / p)²` (the resolution, and
  the sequence length, are the run's choice);
- token ids at one length, padded on the tokenizer's `padding_side` with its pad token and no
  attention mask, as the processors give them: CLIP's text tower is causal and pools at the EOS, so
  the padding after it changes nothing; SigLIP (and SigLIP 2) pool at the last position and were
  trained on ids padded to `max_position_embeddings` (`padding="max_length"` in their documentation),
  so the length is that.

`logit_scale` (and SigLIP's `logit_bias`) start at the folder's values unless `[loss]` sets them; a
CLIP folder trained with the sigmoid loss gets a bias of its own (the loss's initial value).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titan_contrastive.components.freeze import locked_forward
from titan_contrastive.components.lora import LoraFields, add_lora
from titan_contrastive.config import ConfigError
from titan_contrastive.datasets.image_transforms import FILTERS
from titan_contrastive.datasets.tokenizer import CaptionTokenizer, PairTokenizer
from titan_contrastive.losses import temperature_from_config
from titan_contrastive.models.bi_encoder.folder import load_config, load_tokenizer, read_text_folder
from titan_contrastive.models.hf_clip.naflex import NaFlexEmbeddings, naflex_inputs
from titan_contrastive.models.hf_clip.teacher_inputs import TeacherInputs, run_decoder
from titan_contrastive.models.patch_dropout import drop_patches_after, kept_patches
from titan_contrastive.models.positions import resize_positions, stretch_positions, unstretchable

__all__ = [
    "KINDS",
    "HFClip",
    "HFClipArgs",
    "build_tokenizer",
    "hf_clip_blocks",
    "hf_clip_flavors",
    "load_hf_model",
]

logger = logging.getLogger("titan_contrastive")

KINDS = {
    "clip": ("visual_projection", "text_projection"),
    "metaclip_2": ("visual_projection", "text_projection"),
    "siglip": (None, None),
    "siglip2": (None, None),
}
"""The model types read, and each one's projections after the image and text transformers."""
CLIP_LIKE = ("clip", "metaclip_2")
"""CLIP's shape (MetaCLIP 2: CLIP trained on worldwide data, a multilingual tokenizer): a class token before the
patches, a causal text tower pooled at the first EOS, no logit bias."""
LAST_POSITION = ("siglip", "siglip2")
"""The types whose text tower pools the last position (their ids are padded to exactly their positions)."""
LORA_TARGETS = ("q_proj", "v_proj")
"""LoRA's default: the attention's query and value projections of both towers (peft names none for these types)."""


def folder_kind(path: str) -> tuple[str, str, Any]:
    """(model type, model directory, config) of the folder at `path`; one-line ConfigErrors for what it cannot
    train."""
    if not path:
        raise ConfigError(
            "model.path is empty: the hf_clip family trains a Hugging Face CLIP or SigLIP folder; fetch one (e.g. "
            "`hf download google/siglip-base-patch16-224 --local-dir DIR`) and set model.path=DIR"
        )
    model_dir = read_text_folder(path).model_dir
    config = load_config(model_dir)
    if config.model_type not in KINDS:
        raise ConfigError(
            f"model.path={path!r} holds a {config.model_type!r} model; hf_clip trains CLIP, MetaCLIP 2, SigLIP and "
            "SigLIP 2 folders (model_type clip, metaclip_2, siglip or siglip2); a text model trains with "
            "model.name=bi_encoder"
        )
    return config.model_type, model_dir, config


def _processor(model_dir: str) -> tuple[dict[str, Any], str]:
    """(settings, file) of the folder's image processor, where transformers reads them: the `image_processor` of
    `processor_config.json` where it has one, else `preprocessor_config.json`."""
    from titan_contrastive.models.weights import read_json

    root = Path(model_dir)
    combined = root / "processor_config.json"
    if combined.is_file() and isinstance(settings := read_json(combined).get("image_processor"), dict):
        return settings, f"{combined} (image_processor)"
    file = root / "preprocessor_config.json"
    if not file.is_file():
        raise ConfigError(
            f"{model_dir} has no preprocessor_config.json (the image mean and std the model was trained with); "
            "save the model's processor into the folder (processor.save_pretrained)"
        )
    return read_json(file), str(file)


def _statistics(processor: dict[str, Any], file: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(image_mean, image_std) of the folder's image processor."""
    mean, std = processor.get("image_mean"), processor.get("image_std")
    if not (isinstance(mean, list) and isinstance(std, list) and len(mean) == len(std) == 3):
        raise ConfigError(f"{file}: image_mean and image_std must be lists of 3 numbers, got {mean!r} and {std!r}")
    return tuple(map(float, mean)), tuple(map(float, std))


def _image_size(
    path: str, kind: str, config: Any, processor: dict[str, Any], file: str, asked: int
) -> tuple[int, int, int, int]:
    """(image size, patch size, max_num_patches, resample) the run reads: CLIP and SigLIP the folder's size or
    `[data] image_size` (a multiple of its patch: the position table is resized, `resize_vision_positions`;
    max_num_patches 0: whole images); SigLIP 2 (NaFlex) its processor's `max_num_patches`, or `([data]
    image_size / p)²` (a multiple of its patch), and the side of the largest square grid that holds (what
    square probe images are). `resample`: the processor's filter (its class default where unset: SigLIP 2's
    bilinear, CLIP's and SigLIP's bicubic)."""
    patch = int(config.vision_config.patch_size)
    resample = processor.get("resample", 2 if kind == "siglip2" else 3)
    if resample not in FILTERS:
        raise ConfigError(
            f"{file}: resample={resample!r}; the run resizes images bilinear (2) or bicubic (3); set one of them there"
        )
    if kind == "siglip2":
        most = processor.get("max_num_patches")
        if not isinstance(most, int) or most < 1:
            raise ConfigError(
                f"{file}: max_num_patches={most!r}; SigLIP 2's processor sets a positive "
                "number of patches per image (e.g. 256); save the model's processor into the folder"
            )
        own = math.isqrt(most) * patch
    else:
        own = int(config.vision_config.image_size)
    if asked % patch:
        raise ConfigError(
            f"data.image_size={asked}: {path} reads images in {patch} px patches; set a multiple of {patch} (e.g. "
            f"{own}, its own{f': max_num_patches={most}' if kind == 'siglip2' else ''}) or 0"
        )
    if kind != "siglip2":
        if asked not in (0, own):
            logger.info(
                f"data.image_size={asked}: {path}'s position table ({own // patch}x{own // patch} patches) is "
                f"resized to {asked // patch}x{asked // patch}"
            )
        return asked or own, patch, 0, resample
    if asked:
        return asked, patch, (asked // patch) ** 2, resample
    return own, patch, most, resample


def folder_scalar(model_dir: str, name: str) -> float | None:
    """The folder's `name` (`logit_scale`; `logit_bias`: SigLIP's), read from its safetensors without building the
    model; None without one."""
    from safetensors import safe_open

    from titan_contrastive.models.weights import read_json

    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    file = root / (read_json(index)["weight_map"].get(name, "") if index.is_file() else "model.safetensors")
    if not file.is_file():
        raise ConfigError(f"{model_dir}: no model.safetensors (a pytorch_model.bin is never unpickled here)")
    with safe_open(str(file), "pt") as f:
        return float(f.get_tensor(name).reshape(-1)[0]) if name in f.keys() else None  # noqa: SIM118


@dataclass(frozen=True)
class HFClipArgs(LoraFields):
    path: str = ""
    """`[model] path`: the CLIP or SigLIP folder."""
    context_length: int = 0
    """Tokens per caption: `[data] context_length`, else the folder's (CLIP: its positions; SigLIP: exactly them)."""
    image_size: int = 0
    """The folder's `vision_config.image_size`, or `[data] image_size` (a multiple of its patch); SigLIP 2: see
    `_image_size`."""
    patch_size: int = 0
    max_num_patches: int = 0
    """SigLIP 2 (NaFlex): the patches per image, padded; 0: the model reads whole images."""
    resample: int = 3
    """The processor's Pillow filter (2: bilinear, 3: bicubic)."""
    whole_image: bool = False
    """Evaluation resizes each whole image to the square (SigLIP's processor), not its central square (CLIP's)."""
    image_mean: tuple[float, ...] = ()
    image_std: tuple[float, ...] = ()
    init_logit_scale: float | None = None
    """None: the folder's `logit_scale`."""
    init_logit_bias: float | None = None
    """The sigmoid loss's starting bias (SigLIP: the folder's); None with an objective that has none."""
    learn_logit_scale: bool = True
    learn_logit_bias: bool = True
    patch_dropout: float = 0.0
    """`[model] patch_dropout` (not SigLIP 2's padded patches)."""
    retokenize_from: str = ""
    """A teacher of another tokenizer: the run's model folder, or the clip family's tokenizer (`byte`, `clip_bpe`),
    whose token ids it reads as text (`teacher_inputs`)."""
    pixels_from: tuple[tuple[float, ...], ...] = ()
    """A teacher of other image statistics: the run's (image_mean, image_std), its pixels normalized again."""

    @property
    def model_dir(self) -> str:
        return read_text_folder(self.path).model_dir

    def update_from_config(self, cfg: Any) -> HFClipArgs:
        """A copy with the folder read (`[model] path`) and checked against `[data] image_size` and
        `context_length`, the temperature and bias the run starts from, and `[lora]`."""
        path = cfg.model.path or self.path
        kind, model_dir, config = folder_kind(path)
        processor, file = _processor(model_dir)
        size, patch, patches, resample = _image_size(path, kind, config, processor, file, cfg.data.image_size)
        positions = int(config.text_config.max_position_embeddings)
        length = cfg.data.context_length or positions
        last = kind in LAST_POSITION
        if last and length != positions:
            raise ConfigError(
                f"data.context_length={cfg.data.context_length}: {path} reads exactly {positions} tokens (SigLIP "
                f"pools the last position of ids padded to it); set data.context_length={positions} or 0"
            )
        if length > positions and (why := unstretchable(positions)):
            raise ConfigError(
                f"data.context_length={cfg.data.context_length}: {path}'s {why}; set data.context_length={positions} "
                "or 0"
            )
        t = temperature_from_config(cfg, default_logit_scale=0.0)  # checks a bias against the objective
        bias = None
        if t.init_logit_bias is not None:  # an objective with a bias: the configured one, the folder's, its own
            bias = cfg.loss.init_logit_bias
            if bias is None:
                bias = folder_scalar(model_dir, "logit_bias")
            if bias is None:
                bias = t.init_logit_bias
        if last and bias is None:
            logger.warning(
                f"warning: model.path={path!r} is a SigLIP model and loss.name={cfg.loss.name or 'clip'!r} a softmax "
                "objective: its logit_bias is kept but not used; --loss.name=siglip trains the loss it was "
                "pretrained with"
            )
        if patches and cfg.model.patch_dropout:
            raise ConfigError(
                f"model.patch_dropout={cfg.model.patch_dropout}: {path} is SigLIP 2 (NaFlex), whose images are "
                "already at most max_num_patches patches (set data.image_size for fewer); set model.patch_dropout=0"
            )
        mean, std = _statistics(processor, file)
        return dataclasses.replace(
            self,
            path=path,
            context_length=length,
            image_size=size,
            patch_size=patch,
            max_num_patches=patches,
            resample=resample,
            whole_image=kind == "siglip",
            image_mean=mean,
            image_std=std,
            init_logit_scale=cfg.loss.init_logit_scale,
            init_logit_bias=bias,
            learn_logit_scale=t.learn_logit_scale,
            learn_logit_bias=t.learn_logit_bias,
            patch_dropout=cfg.model.patch_dropout,
            **LoraFields.from_config(cfg.lora, lambda: LORA_TARGETS),
        )

    def update_from_data(
        self, *, image_shape: Any = None, vocab_size: int = 0, context_length: int = 0, eos_id: int = 0
    ) -> HFClipArgs:
        """The sizes come from the folder; the data must serve them (the `FOLDER_IMAGES` layout resizes to it)."""
        if tuple(image_shape) != (3, self.image_size, self.image_size):
            raise ValueError(
                f"data images are {'x'.join(map(str, image_shape))}; the folder reads "
                f"3x{self.image_size}x{self.image_size}"
            )
        return self

    @functools.cached_property
    def _counts(self) -> tuple[str, int, int, int]:
        """(model type, all parameters, the vision layers', the text layers') of the folder's model with its
        adapters, on meta."""
        from transformers import AutoModel

        config = copy.deepcopy(load_config(self.model_dir))  # the cached one stays the folder's
        if not self.max_num_patches and self.image_size:  # the run's size (its position table)
            config.vision_config.image_size = self.image_size
        if self.context_length > config.text_config.max_position_embeddings:  # Long-CLIP's stretched table
            config.text_config.max_position_embeddings = self.context_length
        with torch.device("meta"):
            model = AutoModel.from_config(config)
            if self.lora_rank:
                add_lora(model, self)
        vision, text = (sum(p.numel() for p in tower.encoder.layers.parameters()) for tower in _towers(model))
        return config.model_type, sum(p.numel() for p in model.parameters()), vision, text

    def num_params(self) -> int:
        """Exact: the folder's model (its logit_scale, SigLIP's logit_bias) and a bias of ours for a CLIP
        folder under the sigmoid loss."""
        kind, total = self._counts[:2]
        return total + (self.init_logit_bias is not None and kind in CLIP_LIKE)

    def flops_per_sample(self) -> int:
        """6 x layer parameters x tokens of one image (its patches, SigLIP 2's padding, or those patch dropout
        keeps; CLIP's class token) and one caption (attention scores excluded)."""
        kind, _, vision, text = self._counts
        grid = kept_patches((self.image_size // self.patch_size) ** 2, self.patch_dropout)
        patches = self.max_num_patches or grid + (kind in CLIP_LIKE)
        return 6 * (vision * patches + text * self.context_length)


hf_clip_flavors = {"folder": HFClipArgs()}


def _towers(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The (vision, text) transformers of the folder's model."""
    return model.vision_model, model.text_model


def load_hf_model(model_dir: str) -> nn.Module:
    """The folder's transformers model (one of `KINDS`) in training mode, its load report kept out of
    the log."""
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModel.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{model_dir}: transformers cannot load its weights ({' '.join(str(e).split())[:200]})"
        ) from None
    return model.train()


class Side(nn.Module):
    """One tower: a transformers vision or text transformer, then the projection (CLIP's) if any."""

    def __init__(self, transformer: nn.Module, projection: nn.Module | None) -> None:
        super().__init__()
        self.transformer, self.projection = transformer, projection

    def forward(self, **inputs: Tensor) -> Tensor:
        pooled = self.transformer(**inputs).pooler_output
        return F.normalize(pooled if self.projection is None else self.projection(pooled), dim=-1)


class HFClip(nn.Module):
    """`visual` and `text` (`Side`s of the folder's model), `logit_scale` (and `logit_bias`); forward as clip's."""

    def __init__(self, args: HFClipArgs) -> None:
        super().__init__()
        self.args = args
        model = load_hf_model(args.model_dir)
        if args.lora_rank:  # before the split: peft sees the whole model's module names
            add_lora(model, args)
        image_proj, text_proj = KINDS[model.config.model_type]
        vision, text = _towers(model)
        if args.max_num_patches:  # SigLIP 2: its positions resized to each grid in their own dtype
            vision.embeddings = NaFlexEmbeddings(vision.embeddings)
        elif args.image_size:
            resize_vision_positions(vision, args.image_size)
        stretch_text_positions(text, args.context_length)
        if args.patch_dropout:  # after the positions are added; CLIP's class token kept
            drop_patches_after(vision.embeddings, args.patch_dropout, prefix=int(model.config.model_type in CLIP_LIKE))
        self.visual = Side(vision, getattr(model, image_proj) if image_proj else None)
        self.text = Side(text, getattr(model, text_proj) if text_proj else None)
        self._start = {"logit_scale": float(model.logit_scale.detach().reshape(-1)[0])}
        if hasattr(model, "logit_bias"):
            self._start["logit_bias"] = float(model.logit_bias.detach().reshape(-1)[0])
        if args.init_logit_scale is not None:
            self._start["logit_scale"] = args.init_logit_scale
        if args.init_logit_bias is not None:
            self._start["logit_bias"] = args.init_logit_bias
        self.logit_scale = nn.Parameter(torch.empty(1), requires_grad=args.learn_logit_scale)
        if "logit_bias" in self._start:  # SigLIP's own is kept (and exported) under an objective without a bias
            learn = args.learn_logit_bias and args.init_logit_bias is not None
            self.logit_bias = nn.Parameter(torch.empty(1), requires_grad=learn)
        self.reads = teacher_inputs(args)
        self.init_weights()

    def init_weights(self) -> None:
        """Pretrained: only the scale (and bias) have starting values of their own."""
        with torch.no_grad():
            for name, value in self._start.items():
                getattr(self, name).fill_(value)

    def image_inputs(self, images: Tensor | Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The vision transformer's keyword inputs: SigLIP 2's patches, mask and grids as served (a dict), or
        cut from square images [B, 3, S, S] (`naflex_inputs`); the images themselves for CLIP and SigLIP."""
        if isinstance(images, Mapping):
            return dict(images)
        if self.args.max_num_patches:
            return naflex_inputs(images, self.args.patch_size, self.args.max_num_patches)
        return {"pixel_values": images}

    def forward(
        self, images: Tensor | Mapping[str, Tensor], texts: Tensor, *, replay: Sequence[Tensor | None] | None = None
    ) -> tuple[Tensor, ...]:
        """(image embeddings, text embeddings, exp(logit_scale)[, logit_bias]); `replay`: in a cached-gradient
        re-forward, pass 1's outputs of these samples, which a locked tower returns instead of running."""
        if self.reads is not None:  # a teacher reading the run's batches as its own processor makes them
            images, texts = self.reads(images, texts)
        image = locked_forward(self.visual, 0, lambda: self.visual(**self.image_inputs(images)), replay)
        text = locked_forward(self.text, 1, lambda: self.text(input_ids=texts), replay)
        out = (image, text, self.logit_scale.exp())
        return (*out, self.logit_bias) if self.args.init_logit_bias is not None else out


def resize_vision_positions(vision: nn.Module, size: int) -> None:
    """A transformers CLIP or SigLIP vision transformer made to read `size` px images: its position table resized
    (`models.positions.resize_positions`, as its own `interpolate_pos_encoding`) and its sizes and config set; as it
    is at its own size."""
    embeddings = vision.embeddings
    grid = size // embeddings.patch_size
    if embeddings.num_patches == grid * grid:
        return
    prefix = embeddings.num_positions - embeddings.num_patches  # CLIP's class token
    table = resize_positions(embeddings.position_embedding.weight.detach(), grid, prefix)
    _replace_positions(embeddings, table)
    embeddings.image_size, embeddings.num_patches, embeddings.num_positions = size, grid * grid, len(table)
    vision.config.image_size = size


def stretch_text_positions(text: nn.Module, length: int) -> None:
    """A transformers CLIP text transformer made to read `length` tokens, more than its positions: its table
    stretched as Long-CLIP stretches it (`models.positions.stretch_positions`) and its config set; as it is at its
    own length or less (a shorter caption reads the table's first rows)."""
    embeddings = text.embeddings
    if length <= embeddings.position_embedding.num_embeddings:
        return
    _replace_positions(embeddings, stretch_positions(embeddings.position_embedding.weight.detach(), length))
    text.config.max_position_embeddings = length


def _replace_positions(embeddings: nn.Module, table: Tensor) -> None:
    """A transformers embeddings module's position table replaced by `table` (trainable) and its ids to match."""
    embeddings.position_embedding = nn.Embedding.from_pretrained(table, freeze=False)
    embeddings.register_buffer("position_ids", torch.arange(len(table)).expand((1, -1)), persistent=False)


def hf_clip_blocks(model: HFClip) -> list[nn.Module]:
    """Both towers' transformer layers: FSDP2, activation checkpointing and compile units."""
    return [*model.visual.transformer.encoder.layers, *model.text.transformer.encoder.layers]


def teacher_inputs(args: HFClipArgs) -> TeacherInputs | None:
    """What a teacher of another tokenizer or other image statistics reads the run's batches through; None for a
    model that reads them as they are."""
    if not (args.retokenize_from or args.pixels_from):
        return None
    decode, target = (
        (run_decoder(args.retokenize_from), build_tokenizer(args)) if args.retokenize_from else (None, None)
    )
    return TeacherInputs(decode, target, args.pixels_from, (args.image_mean, args.image_std))


def build_tokenizer(args: HFClipArgs) -> CaptionTokenizer:
    """`ModelSpec.build_tokenizer`: the folder's tokenizer at the args' length, padding with its pad token on its
    `padding_side`."""
    hf = load_tokenizer(args.model_dir)
    pair = PairTokenizer(
        hf, doc_length=args.context_length, pad_id=int(hf.pad_token_id), pad_left=hf.padding_side == "left"
    )
    return CaptionTokenizer(pair, args.context_length)
