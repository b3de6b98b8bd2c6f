"""The qwen_vl family: a Qwen2-VL / Qwen2.5-VL / Qwen3-VL model from a local folder as an embedder
(VLM2Vec's and GME's recipe): one tower embeds queries and documents, each the normalized hidden
state of its last real token (or the mean over its tokens), a text, an image or both with its
side's template; or, with `[model] pooling = "colbert"` (ColPali's ColQwen), every token projected
to `colbert_dim` (a Linear with bias, ColPali's `custom_text_proj`, a ColQwen folder's own:
`colpali.py`) and normalized, scored by late interaction (`losses/late_interaction.py`): a side's
embedding is its tokens end to end at the most tokens its template can give
(`QwenVLArgs.side_tokens`), padding and the columns past a text's end the zero vector.

`[data] retrieval_mode` gives each side's kind (`datasets.retrieval.MODES`: t2i, i2t, i2i, t2t,
m2i, m2t, t2m, i2m, m2m; text, image, or multi = image + text). A batch (served through `QwenVLArgs.processor`:
image-text data in t2i / i2t, `vl_pairs` rows in every mode) holds `query` and `doc` token ids
[B, L] right-padded with -1, and per side the packed `{side}_pixel_values` with its
`{side}_image_grid_thw` (one image per sample; a side without images: 0 rows, grid [0, 3]). The
model builds what the transformers model needs beside the ids: the attention mask (ids != -1) and
`mm_token_type_ids` (1 at `<|image_pad|>`, for M-RoPE).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titan_contrastive.batching import NEGATIVES, interleave_images, right_trimmed
from titan_contrastive.components.lora import LoraFields, add_lora
from titan_contrastive.config import ConfigError
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.retrieval import MODES, SIDES, side_kinds
from titan_contrastive.datasets.source_modes import source_modes
from titan_contrastive.models.bi_encoder.colbert import refuse_for_colbert
from titan_contrastive.models.bi_encoder.folder import layer_blocks, load_config, read_text_folder
from titan_contrastive.models.bi_encoder.pooling import pooled
from titan_contrastive.models.bi_encoder.tower import load_text_tower
from titan_contrastive.models.pretrained_scale import PretrainedScale, scale_fields
from titan_contrastive.models.qwen_vl import colpali
from titan_contrastive.models.qwen_vl.chat_template import folder_templates
from titan_contrastive.models.qwen_vl.processor import PAD, VLProcessor
from titan_contrastive.models.qwen_vl.templates import TEMPLATES, check_template, side_template
from titan_contrastive.models.qwen_vl.visual_anchor import visual_anchor

__all__ = [
    "MODES",
    "TEMPLATES",
    "QwenVLArgs",
    "QwenVLEmbedder",
    "SideProcessor",
    "qwen_vl_blocks",
    "qwen_vl_flavors",
    "vl_embed",
]

LORA_TARGETS = ("q_proj", "v_proj")
"""LoRA's default: the language model's query and value projections (the vision blocks name theirs
`qkv`: they stay frozen unless `[lora] target_modules` names them)."""
JOIN_SLACK = 8
"""ColBERT's tokens per side beyond `VLProcessor.most_tokens`: a BPE tokenizer may split a text that was cut to
its first tokens into a few more once it is joined to the template."""
MOST_VISUAL_TOKENS = 4096
"""ColBERT pads every image to its most visual tokens: more than this is refused (set `[data] max_pixels`)."""
IMAGE_TEXT_MODES = ("t2i", "i2t")
"""The modes of image-text data (an image and a caption per row): the image is one side, the caption the other."""


@dataclass(frozen=True)
class QwenVLArgs(LoraFields):
    path: str = ""
    """The model folder (config, weights, tokenizer, preprocessor_config.json); `[model] path`."""
    mode: str = "t2i"
    """`[data] retrieval_mode`: t2i (captions query images), i2t, i2i, t2t, m2i (image + text queries, images),
    m2t (image + text queries, texts), t2m, i2m, m2m (image + text documents)."""
    modes: tuple[str, ...] = ()
    """Every mode the run trains and evaluates: its sources' (`[data] retrieval_modes`) and `mode`; () = `mode`."""
    mixed: bool = False
    """Rows of several modes share a batch (`[data] retrieval_modes` without `same_source_batches`): a forward without
    images runs the vision tower at zero weight (`visual_anchor`), so every rank runs the same blocks."""
    pooling: str = "last_token"
    query_template: str = TEMPLATES["text"]
    """The queries' template (`[model] query_prompt`; `auto`: `TEMPLATES` of the side's kind): `{text}`
    where the sample's text goes, `{image}` where its image goes (image and multi sides only)."""
    doc_template: str = TEMPLATES["image"]
    """The documents' (`[model] doc_prompt`), e.g. "{image} Summarize above image in one word:"."""
    min_pixels: int = 0
    """Images are resized to at least this many pixels (0: the folder's image processor's)."""
    max_pixels: int = 0
    """... and at most this many: the visual tokens per image (0: the folder's)."""
    text_length: int = 32
    """Caption tokens at most (`[data] context_length`; set before the data is laid out), before the template."""
    init_scale: float = 50.0
    """t at the start: VLM2Vec's temperature 0.02."""
    attn_implementation: str = ""
    """`[model] attn_implementation`: transformers' attention kernel ("" = its default)."""
    learn_logit_scale: bool = True
    init_logit_bias: float | None = None
    """b at the start, for an objective with a bias (the sigmoid loss); None: no bias."""
    learn_logit_bias: bool = True
    colbert_dim: int = 0
    """With pooling = "colbert": a token's width (a ColQwen folder's, else `[model] colbert_dim`, else ColPali's for
    the architecture, `colpali.CLASSES`); 0 otherwise."""

    def update_from_config(self, cfg: Any) -> QwenVLArgs:
        mode = cfg.data.retrieval_mode
        if mode not in MODES:
            raise ConfigError(f"data.retrieval_mode={mode!r}: the qwen_vl family trains {', '.join(MODES)}")
        sources = source_modes(cfg.data)
        every = tuple(dict.fromkeys([*sources, mode]))
        imaged = next((m for m in every if MODES[m][1] != "text"), "")
        if cfg.loss.mask_duplicates and imaged:
            raise ConfigError(
                f"loss.mask_duplicates=true with retrieval_mode={imaged}: duplicates are found by their token ids, "
                "and an image document's ids are its template and visual-token placeholders (two different "
                "images of one size look alike); use loss.mask_margin or mask_relative, or set it false"
            )
        given = cfg.model.path or self.path
        if not given:
            raise ConfigError("model.path is empty: the qwen_vl family needs a local Qwen-VL folder")
        folder = read_text_folder(given)
        if folder.dense:
            raise ConfigError(
                f"model.path={given!r}: a sentence-transformers folder with Dense modules after its pooling, which the "
                "qwen_vl family does not have; give the transformer's folder and set model.pooling"
            )
        path = folder.model_dir
        ours = {side: getattr(cfg.model, f"{side}_prompt") for side in SIDES}
        derived = folder_templates(folder, MODES[mode]) if "auto" in ours.values() else {}
        templates = {}
        for side, kind in side_kinds(mode).items():
            templates[side] = derived.get(side, TEMPLATES[kind]) if ours[side] == "auto" else ours[side]
            check_template(side, kind, templates[side], mode)
        pooling = (folder.pooling or "last_token") if cfg.model.pooling == "auto" else cfg.model.pooling
        if pooling not in ("last_token", "mean", "colbert"):
            told = "" if cfg.model.pooling != "auto" else f" (model.path's, {given!r})"
            raise ConfigError(
                f"model.pooling={pooling!r}{told}: the qwen_vl family pools last_token, mean or colbert; set one"
            )
        start = 1.0 if pooling == "colbert" else self.init_scale  # MaxSim: t = 1, as PyLate
        if cfg.model.colbert_dim and pooling != "colbert":
            raise ConfigError(
                f"model.colbert_dim={cfg.model.colbert_dim}: it applies to model.pooling='colbert' only, so set that "
                "or remove it"
            )
        late = pooling == "colbert"
        if late:
            refuse_for_colbert(cfg)
            if any(MODES[m] != ("text", "text") for m in every):
                most = VLProcessor(path, cfg.data.min_pixels, cfg.data.max_pixels, 0).most_visual_tokens
                if most > MOST_VISUAL_TOKENS:
                    raise ConfigError(
                        f"data.max_pixels={cfg.data.max_pixels}: model.pooling='colbert' pads every image to its most "
                        f"visual tokens, {most} at this size; set data.max_pixels to what the images need (ColQwen2: "
                        "802816, 1,024 tokens of 28 px)"
                    )
        return dataclasses.replace(
            self,
            path=path,
            mode=mode,
            modes=every,
            mixed=len(set(sources)) > 1 and not cfg.data.same_source_batches,
            pooling=pooling,
            query_template=templates["query"],
            doc_template=templates["doc"],
            min_pixels=cfg.data.min_pixels,
            text_length=cfg.data.context_length or self.text_length,
            max_pixels=cfg.data.max_pixels,
            **scale_fields(cfg, start),
            attn_implementation=cfg.model.attn_implementation,
            colbert_dim=colpali.colbert_dim(path, load_config(path).model_type, cfg.model.colbert_dim) if late else 0,
            **LoraFields.from_config(cfg.lora, lambda: LORA_TARGETS),
        )

    def update_from_data(
        self, *, image_shape: Any = None, vocab_size: int = 0, context_length: int = 32, eos_id: int = 0
    ) -> QwenVLArgs:
        return dataclasses.replace(self, text_length=context_length)

    @property
    def model_dir(self) -> str:
        return self.path

    @property
    def token_dim(self) -> int:
        """The width of a token in ColBERT's token sets (scored by late interaction); 0 for one vector per text."""
        return self.colbert_dim

    @functools.cached_property
    def side_tokens(self) -> dict[str, int]:
        """ColBERT's tokens per side ("query", "doc"; hard negatives are documents): the most its templates give (of
        each mode's kind, `side_template`; `VLProcessor.most_tokens`) and `JOIN_SLACK`; every item of the side is laid
        out at this length."""
        proc = VLProcessor(self.path, self.min_pixels, self.max_pixels, self.text_length)
        most = {
            side: max(proc.most_tokens(side_template(self, side, m)) for m in self.modes or (self.mode,))
            for side in SIDES
        }
        return {side: most[side] + JOIN_SLACK for side in SIDES}

    @functools.cached_property
    def _counts(self) -> tuple[int, int]:
        """(parameters, parameters in the language model's layers and ColBERT's projection), on the meta device."""
        from transformers import AutoModel

        with torch.device("meta"):
            tower = AutoModel.from_config(load_config(self.path))
            if self.lora_rank:
                add_lora(tower, self)
        decoder = sum(p.numel() for b in layer_blocks(tower.language_model) for p in b.parameters())
        head = self.colbert_dim * (tower.config.get_text_config().hidden_size + 1)
        return sum(p.numel() for p in tower.parameters()) + head + 1 + (
            self.init_logit_bias is not None
        ), decoder + head

    def num_params(self) -> int:
        return self._counts[0]

    def flops_per_sample(self) -> int:
        """6 x decoder-layer (and projection) parameters x the caption's tokens (visual tokens vary with the images:
        not counted)."""
        return 6 * self._counts[1] * self.text_length

    def processor(self) -> SideProcessor:
        """The batches' maker (`SideProcessor`): image-text data calls it, `vl_pairs` its `sides`."""
        return SideProcessor(self)


class SideProcessor:
    """Samples -> the batch entries query, doc, `{side}_pixel_values`, `{side}_image_grid_thw` (see
    the module docstring), each side filled by its template from its kind's fields.

    - `sides(query_images, query_texts, doc_images, doc_texts)`: rows with a query and a document
      (`datasets.vl_pairs`); a side reads what its kind needs (None for what it does not);
    - `self(images, captions[, negative captions, k per sample])`: image-text data, t2i (captions
      query images) and i2t only; negative captions are hard negatives of text documents, served as
      `neg` [B, k, L] ids, so they take i2t (`negatives`, what `serve_processed` checks);
    - `refusal`: why image-text data cannot train this mode ("" when it can), raised by the layout at start.
    """

    def __init__(self, args: QwenVLArgs) -> None:
        self.args, self.mode = args, args.mode
        self.proc = VLProcessor(args.path, args.min_pixels, args.max_pixels, args.text_length)
        self.tokenizer = self.proc.tokenizer
        self.kinds = side_kinds(args.mode)
        self.templates = {"query": args.query_template, "doc": args.doc_template}
        self.negatives = args.mode == "i2t"
        self.lengths = args.side_tokens if args.token_dim else {}
        image = self.proc.images
        self.patch_width = 3 * int(image.temporal_patch_size) * int(image.patch_size) ** 2
        self.refusal = (
            ""
            if args.mode in IMAGE_TEXT_MODES
            else f"data.retrieval_mode={args.mode} needs rows with a query and a document: data.dataset='vl_pairs'"
        )

    def template(self, side: str, mode: str) -> str:
        """`side`'s template for rows of `mode` (a source's, `[data] retrieval_modes`): `side_template`."""
        return side_template(self.args, side, mode)

    def check_template(self, side: str, template: str, key: str, mode: str = "") -> None:
        """A template for `side` in `mode` (default: the model's; `data.query_prompts` / `doc_prompts` of vl_pairs
        data, a source's own), or one ConfigError naming `key`; under ColBERT pooling, one that fits the side's length
        (`side_tokens`)."""
        mode = mode or self.mode
        check_template(side, side_kinds(mode)[side], template, mode, key)
        if self.lengths and self.proc.most_tokens(template) + JOIN_SLACK > self.lengths[side]:
            raise ConfigError(
                f"{key}={template!r}: it gives up to {self.proc.most_tokens(template)} tokens, and model.pooling="
                f"'colbert' lays every {side} out at the model's template's {self.lengths[side] - JOIN_SLACK} (+"
                f"{JOIN_SLACK}); set model.{side}_prompt to the longest of the templates"
            )

    def _fits(self, side: str, ids: Tensor) -> None:
        """Under ColBERT pooling, ids no longer than the side's length (an image past its most visual tokens, by an
        extreme aspect ratio): else one DataError."""
        if self.lengths and ids.shape[1] > self.lengths[side]:
            raise DataError(
                f"a {side} of {ids.shape[1]} tokens: model.pooling='colbert' lays every {side} out at "
                f"{self.lengths[side]} (its template, data.context_length and the most visual tokens of "
                "data.max_pixels); crop images of extreme aspect ratio"
            )

    def sides(
        self,
        query_images: Sequence[np.ndarray | None] | None,
        query_texts: Sequence[str] | None,
        doc_images: Sequence[np.ndarray | None] | None,
        doc_texts: Sequence[str] | None,
        negatives: Sequence[Any] = (),
        templates: dict[str, Sequence[str]] | None = None,
        mode: str | Sequence[str] = "",
    ) -> dict[str, Tensor]:
        """The batch of these samples: uint8 HWC images and texts per side; `negatives`: k hard negatives per sample,
        row after row, documents of the row's documents' kind (texts, images, or (image, text) pairs): `neg` [B, k, L]
        ids, and for images `neg_pixel_values` + `neg_image_grid_thw` (empty where none has one).
        `templates`: a side's template per sample in place of its own ("": its own; a source's template,
        `datasets.vl_pairs`); the negatives take their row's document template. `mode`: the samples' (a source's,
        `[data] retrieval_modes`; default the model's), or one per sample (rows of several modes in one batch), each
        side of its kind and by default its `template`. Each side (and the negatives) carries `{side}_image_counts`
        [B], each sample's images (`batching.take_vlm_chunks`: some rows may have none)."""
        given = {"query": (query_images, query_texts), "doc": (doc_images, doc_texts)}
        own = (templates or {}).get
        batch: dict[str, Tensor] = {}
        modes, chosen = {}, {}
        for side in SIDES:  # a side's samples: its texts', else its images' (a side may be given alone)
            images, texts = given[side]
            count = len(texts) if texts is not None else len(images) if images is not None else 0
            modes[side] = [mode or self.mode] * count if isinstance(mode, str) else list(mode)
            kinds = [side_kinds(m)[side] for m in modes[side]]
            chosen[side] = [(own(side) or [""] * count)[r] or self.template(side, modes[side][r]) for r in range(count)]
            images = [None if k == "text" else images[r] for r, k in enumerate(kinds)] if images else None
            texts = ["" if k == "image" or texts is None else texts[r] for r, k in enumerate(kinds)]
            self._side(batch, side, self.proc.encode(chosen[side], texts, images), images)
        rows = len(batch["doc"])
        batch[f"{NEGATIVES}_pixel_values"] = torch.zeros(0, self.patch_width)
        batch[f"{NEGATIVES}_image_grid_thw"] = torch.zeros(0, 3, dtype=torch.long)
        batch[f"{NEGATIVES}_image_counts"] = torch.zeros(rows, dtype=torch.long)
        if len(negatives):
            per_row = len(negatives) // rows
            images, texts = [], []
            for n, value in enumerate(negatives):
                kind = side_kinds(modes["doc"][n // per_row])["doc"]
                image, text = value if kind == "multi" else (value, "") if kind == "image" else (None, value)
                images.append(image)
                texts.append(text)
            template = [t for t in chosen["doc"] for _ in range(per_row)]
            imaged = images if any(image is not None for image in images) else None
            out = self.proc.encode(template, texts, imaged)
            self._side(batch, NEGATIVES, out, imaged, per_row)
            batch[NEGATIVES] = batch[NEGATIVES].reshape(rows, per_row, -1)
        return batch

    def _side(self, batch: dict[str, Tensor], side: str, out: dict[str, Tensor], images: Any, per_row: int = 1) -> None:
        """One side's encoding `out` (of `images`, None for a sample without, or None for none) into `batch`: its ids,
        its images (empty where none has one) and each row's count of them (`per_row` samples of `out` a row: the hard
        negatives)."""
        self._fits("doc" if side == NEGATIVES else side, out["ids"])
        batch[side] = out["ids"]
        if "image_grid_thw" in out:
            self.proc.check(out["ids"], out["image_grid_thw"])  # the tokenizer kept every <|image_pad|>
            batch[f"{side}_pixel_values"] = out["pixel_values"]
            batch[f"{side}_image_grid_thw"] = out["image_grid_thw"]
        else:
            batch[f"{side}_pixel_values"] = torch.zeros(0, self.patch_width)
            batch[f"{side}_image_grid_thw"] = torch.zeros(0, 3, dtype=torch.long)
        imaged = [image is not None for image in images] if images is not None else [False] * len(out["ids"])
        batch[f"{side}_image_counts"] = torch.tensor(imaged, dtype=torch.long).view(-1, per_row).sum(1)

    def items(
        self, templates: Sequence[str], texts: Sequence[str], images: Sequence[np.ndarray | None] | None
    ) -> dict[str, Tensor]:
        """Items of one side on their own, each with its template and its text and its image (None: it has none;
        `images` None: no item has one):
        `ids`, and with images `pixel_values` and `image_grid_thw`, what `QwenVLEmbedder.embed` reads (a frozen
        model's embeddings written ahead, `datasets.vl_items`)."""
        out = self.proc.encode(list(templates), texts, images)
        if images is not None:
            self.proc.check(out["ids"], out["image_grid_thw"])
        return out

    def __call__(
        self, images: Sequence[np.ndarray], texts: Sequence[str], negatives: Sequence[str] = ()
    ) -> dict[str, Tensor]:
        """Image-text rows: the images on the mode's image side, the captions on the other."""
        if self.refusal:
            raise DataError(self.refusal)
        if self.mode == "t2i":
            return self.sides(None, texts, images, None, negatives)
        return self.sides(images, None, None, texts, negatives)


qwen_vl_flavors = {"default": QwenVLArgs()}


def vl_embed(
    tower: nn.Module,
    ids: Tensor,
    pooling: str,
    pixel_values: Tensor | None = None,
    image_grid_thw: Tensor | None = None,
    late: tuple[nn.Module, int] | None = None,
    anchored: bool = False,
) -> Tensor:
    """The normalized embedding of each row of `ids` (-1 padded), with its image's patches when it has
    one; the columns that are padding in every row are cut first (as GradCache cuts a chunk: the same
    shapes, so the same dropout draws, in both). `late`: (projection, tokens) of ColBERT pooling: each
    token projected and normalized, padding zero, laid out at `tokens` [B, tokens * dim]. `anchored`: rows
    without images still run the vision tower, at zero weight (`visual_anchor`)."""
    anchor = visual_anchor(tower, ids) if anchored and pixel_values is None else None
    ids = right_trimmed(ids, PAD)
    mask = ids != PAD
    images = {} if pixel_values is None else {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw}
    hidden = tower(
        input_ids=ids.masked_fill(~mask, 0),
        attention_mask=mask.long(),
        mm_token_type_ids=(ids == tower.config.image_token_id).long(),
        **images,
    ).last_hidden_state
    hidden = hidden if anchor is None else hidden + anchor.to(hidden.dtype)
    if late is None:
        return F.normalize(pooled(hidden, mask, pooling), dim=-1)
    head, tokens = late
    if ids.shape[1] > tokens:
        raise DataError(f"ids of {ids.shape[1]} tokens, more than the side's {tokens} (`SideProcessor` checks it)")
    vectors = F.normalize(head(hidden), dim=-1) * mask[..., None]
    return F.pad(vectors, (0, 0, 0, tokens - ids.shape[1])).flatten(1)


class QwenVLEmbedder(PretrainedScale, nn.Module):
    """One Qwen-VL tower for queries and documents, learnable `logit_scale`."""

    def __init__(self, args: QwenVLArgs) -> None:
        super().__init__()
        self.args = args
        self.tower = load_text_tower(args.path, attention=args.attn_implementation)
        if args.lora_rank:
            add_lora(self.tower, args)
        if all(MODES[m] == ("text", "text") for m in args.modes or (args.mode,)):  # no image: frozen (DDP: every grad)
            for p in getattr(self.tower, "visual", nn.Module()).parameters():
                p.requires_grad_(False)
        width = self.tower.config.get_text_config().hidden_size
        # ColPali's projection, trained under LoRA too (colpali-engine adapts it with the language model)
        self.head = colpali.projection(width, args.colbert_dim, args.path) if args.token_dim else None
        self.lengths = args.side_tokens if args.token_dim else {}
        self.add_logit_scale()

    @property
    def padded_inputs(self) -> dict[str, int]:
        """Right-padded token ids (batch key: pad id), for GradCache's trimming and token budgets."""
        return {"query": PAD, "doc": PAD, NEGATIVES: PAD}

    @property
    def token_dim(self) -> int:
        """The width of a token in ColBERT's token sets; 0 for one vector per text."""
        return self.args.token_dim

    @property
    def unit_embeddings(self) -> bool:
        """Whether the embeddings are unit vectors (the global-negatives step checks it once): not ColBERT's."""
        return not self.args.token_dim

    def embed(
        self,
        ids: Tensor,
        pixel_values: Tensor | None = None,
        image_grid_thw: Tensor | None = None,
        side: str = "doc",
    ) -> Tensor:
        """The embeddings of one side's ("query" or "doc") `ids`, with their images where given."""
        late = (self.head, self.lengths[side]) if self.head is not None else None
        return vl_embed(self.tower, ids, self.args.pooling, pixel_values, image_grid_thw, late, self.args.mixed)

    def forward(
        self,
        query: Tensor,
        doc: Tensor,
        query_pixel_values: Tensor,
        query_image_grid_thw: Tensor,
        doc_pixel_values: Tensor,
        doc_image_grid_thw: Tensor,
        neg_pixel_values: Tensor | None = None,
        neg_image_grid_thw: Tensor | None = None,
        query_image_counts: Tensor | None = None,
        doc_image_counts: Tensor | None = None,
        neg_image_counts: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(query embeddings, document embeddings, exp(logit_scale)); each side with its own images
        when its grid has rows. Hard negative images (`neg_*`, k per sample) join the documents' when
        `doc` holds them too (`batching.with_negatives`: B (1 + k) rows, each sample's positive first).
        `*_image_counts`: each sample's images (rows of several modes: some have none), which chunk the batch
        (`batching.take_vlm_chunks`); here the images stand in their rows' order already."""
        if neg_image_grid_thw is not None and len(neg_image_grid_thw) and len(doc) > len(query):
            doc_pixel_values, doc_image_grid_thw = interleave_images(
                doc_pixel_values, doc_image_grid_thw, neg_pixel_values, neg_image_grid_thw
            )
        query_images = (query_pixel_values, query_image_grid_thw) if len(query_image_grid_thw) else (None, None)
        doc_images = (doc_pixel_values, doc_image_grid_thw) if len(doc_image_grid_thw) else (None, None)
        return self.embed(query, *query_images, "query"), self.embed(doc, *doc_images, "doc"), *self.temperature()


def qwen_vl_blocks(model: QwenVLEmbedder) -> list[nn.Module]:
    """The vision blocks and the decoder layers (`_no_split_modules`): FSDP2, AC and compile units."""
    return layer_blocks(model.tower)
