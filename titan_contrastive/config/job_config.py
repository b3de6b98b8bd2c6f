"""The configuration tree: one dataclass per TOML section, every field documented.

The docstring under each field is what `--help` prints (tyro reads it). Range constraints live next to the
field (`metadata={"check": (predicate, "what is valid")}`): `manager.py` names key, value and fix in one line.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

# A learned logit scale t' is clamped to [0, MAX_LOGIT_SCALE] after every step (CLIP's temperature
# cap, t = exp(t') <= 100); a fixed one is kept as given, within +-MAX_FIXED_LOGIT_SCALE (t between
# 1e-4 and 1e4: beyond, the logits overflow float16, or no longer tell pairs apart).
MAX_LOGIT_SCALE = math.log(100.0)
MAX_FIXED_LOGIT_SCALE = math.log(1e4)


def _opt(default: Any, check: Callable[[Any], bool] | None = None, expect: str = "") -> Any:
    """A field with an optional range check; `expect` says what is valid, for error messages."""
    metadata = {"check": (check, expect)} if check is not None else {}
    if isinstance(default, list):  # mutable: each config gets its own copy
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _positive(default: int) -> Any:
    return _opt(default, lambda v: v >= 1, "an integer >= 1")


def _non_negative(default: float) -> Any:
    return _opt(default, lambda v: v >= 0, "a number >= 0")


@dataclass
class Job:
    config_file: str = ""
    """TOML file to load before applying command-line overrides (CLI > TOML > defaults)."""
    dump_folder: str = "./outputs"
    """Folder for logs, `metrics.jsonl` and TensorBoard events (`{dump_folder}/tb`); one run at a
    time: a run holds `.titan_contrastive.lock` in it, and a second run on it stops at start."""
    description: str = ""
    """Free text describing the run; logged at start."""
    custom_import: str = ""
    """Python module imported before the model is looked up, so a user package can call
    `titan_contrastive.models.register_model(...)` for its own model family."""


@dataclass
class Model:
    name: str = "clip"
    """Registered model family: `clip`, `bi_encoder` (a Hugging Face text model from `path`, needs `.[hf]`),
    `lit` (a ViT against the pretrained MiniLM text tower, `.[hf]`), `qwen_vl` (a Qwen2-VL / Qwen2.5-VL /
    Qwen3-VL embedder from `path`, `.[hf]`), `vlm` (a small packed-patch model for CPU tests), `vae` (pixel
    loss), or your own."""
    flavor: str = "debug"
    """Size preset of the family: clip `debug` (CPU) / `vit_b32` / `vit_b16` / `vit_l14`; bi_encoder `shared` /
    `dual` (one tower or two); lit `minilm_debug`; qwen_vl `default`; vlm `debug`; vae `debug` / `sd`."""
    init_from: str = ""
    """Start from a checkpoint's weights (clip): a Hugging Face CLIP folder (config.json +
    model.safetensors) or a step-N folder of one of our runs; its architecture replaces the
    flavor's. The data must match it (data.image_size, data.tokenizer = clip_bpe for CLIP's
    vocabulary, data.context_length). Empty = random init."""
    path: str = ""
    """bi_encoder, qwen_vl: a local transformers or sentence-transformers folder (BERT, XLM-R, ModernBERT, a Qwen3 or
    Llama-style decoder), or a hub id already in the local cache; never downloaded. Empty = the bundled
    all-MiniLM-L6-v2."""
    pooling: Literal["auto", "cls", "mean", "last_token"] = "auto"
    """bi_encoder: `auto` = the sentence-transformers folder's pooling, else mean (encoders) / last_token (decoders)."""
    query_prompt: str = "auto"
    """bi_encoder: text prepended to every query (E5 "query: ", an instruction); `auto` = the folder's query prompt.
    qwen_vl: the query's template, `{text}` for the caption, `{image}` for the image."""
    doc_prompt: str = "auto"
    """bi_encoder: text prepended to every document; `auto` = the folder's `document` / `passage` prompt.
    qwen_vl: the document's template (t2i: e.g. "{image} Summarize above image in one word:")."""
    freeze: list[str] = _opt([], None)
    """Locked towers / partial tuning: tower names (clip `image`, `text`; bi_encoder `query`, `doc`)
    or fnmatch patterns over parameter names. Frozen parameters get no gradients and no optimizer
    state; a wholly frozen tower runs without a graph (LiT: `["text"]` or `["image"]`)."""
    unlocked_layers: int = _opt(0, lambda v: v >= 0, "an integer >= 0")
    """Of each tower named in `freeze`, the last N residual blocks (and the norm and projection
    after them) stay trainable (open_clip's --lock-image-unlocked-groups)."""


@dataclass
class Lora:
    """LoRA adapters (peft) on the bi_encoder's Hugging Face towers: only the adapters (and the logit
    scale) train; checkpoints hold only them, the frozen base comes from `[model] path` again."""

    enable: bool = False
    rank: int = _positive(8)
    """r: the adapters' inner dimension. A resumed run must keep it (the saved adapters' shapes)."""
    alpha: float = _opt(16.0, lambda v: v > 0, "a number > 0")
    """The adapters' output is scaled by alpha / rank."""
    dropout: float = _opt(0.05, lambda v: 0 <= v < 1, "a number in [0, 1)")
    """Dropout on the adapters' input (replayed exactly in a GradCache re-forward)."""
    target_modules: list[str] = _opt([], None)
    """Names (or name suffixes) of the linear layers to adapt; empty = peft's default for the
    architecture (BERT: query, value; Qwen and Llama: q_proj, v_proj)."""
    modules_to_save: list[str] = _opt([], None)
    """Modules trained in full beside the adapters (peft's `modules_to_save`: names or name suffixes
    of modules that do not nest), e.g. ['word_embeddings'] (BERT) or ['embed_tokens'] (Qwen,
    Llama); empty = the whole base stays frozen."""


@dataclass
class Training:
    local_batch_size: int = _positive(128)
    """Samples per process per forward/backward (one microbatch)."""
    global_batch_size: int = _opt(-1, lambda v: v == -1 or v >= 1, "-1 (= local batch x DP degree) or an integer >= 1")
    """Samples per optimizer step over all processes. Gradient accumulation steps =
    global_batch_size // (local_batch_size * dp_degree); -1 means one microbatch per step."""
    steps: int = _positive(200)
    """Number of optimizer steps."""
    max_norm: float = _non_negative(1.0)
    """Clip the total gradient norm to this after the last microbatch; 0 disables clipping."""
    seed: int = _opt(0, lambda v: v >= 0, "an integer >= 0")
    """Seed for parameter init, data order and per-sample randomness."""
    deterministic: bool = False
    """Use deterministic algorithms (`torch.use_deterministic_algorithms`); slower on GPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: `auto` picks CUDA when available, else CPU (gloo backend)."""
    dtype: Literal["float32", "float64"] = "float32"
    """Master parameter dtype. float64 exists for exactness checks against dense references."""
    mixed_precision_param: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype: float32 = no mixed precision. FSDP2 casts parameters with its MixedPrecisionPolicy; DDP and a
    single device use autocast (parallelism.fsdp_one_device: FSDP2 there too). float16 adds a gradient scaler."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the gradient reduction across data-parallel ranks."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A non-finite loss or gradient norm: `stop` the run naming the step and values, or `skip`
    the optimizer step and count it (metric `skipped_steps`). Never silent."""
    max_consecutive_skips: int = _positive(10)
    """With on_nonfinite=skip: past this many skipped steps in a row the run stops as `stop` does
    (exit code 3): a run that only skips is stuck."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = _opt(1, lambda v: v == -1 or v >= 1, "-1 (fill the rest) or an integer >= 1")
    """Replicas (DDP when alone, the outer dimension of HSDP); -1 fills what the shard degree leaves."""
    data_parallel_shard_degree: int = _opt(-1, lambda v: v == -1 or v >= 1, "-1 (fill the rest) or an integer >= 1")
    """FSDP2 shard group size (FSDP alone, the inner dimension of HSDP); -1 fills the rest; x replicate = WORLD_SIZE."""
    defer_grad_sync: bool = False
    """FSDP2 with gradient accumulation: reduce-scatter only after the last microbatch (k-fold less traffic,
    but full gradients on every rank between microbatches). Off: every microbatch, keeping FSDP's memory
    saving, why accumulation is usually on. DDP always defers (no_sync): its gradients are full anyway."""
    fsdp_one_device: bool = False
    """On one device (WORLD_SIZE=1), FSDP2 over it for its mixed precision (bf16 parameter copies, every
    activation bf16) in place of autocast (LayerNorm and the residual stream in float32); docs/performance.md."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """Per block: `full` recomputes the block in backward; `selective` keeps matmul and attention outputs."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each block (after activation checkpointing, before FSDP, as torchtitan)."""
    backend: str = "inductor"
    """torch.compile backend (`inductor`; `aot_eager` compiles fast, useful on CPU and in tests)."""


@dataclass
class Optimizer:
    name: Literal["AdamW"] = "AdamW"
    """Optimizer class."""
    lr: float = _opt(1e-3, lambda v: v > 0, "a number > 0")
    """Peak learning rate (reached at the end of warmup)."""
    beta1: float = _opt(0.9, lambda v: 0 <= v < 1, "a number in [0, 1)")
    """AdamW beta1."""
    beta2: float = _opt(0.98, lambda v: 0 <= v < 1, "a number in [0, 1)")
    """AdamW beta2 (0.98 as in CLIP)."""
    eps: float = _opt(1e-6, lambda v: v > 0, "a number > 0")
    """AdamW epsilon."""
    weight_decay: float = _non_negative(0.1)
    """Decoupled weight decay on matrices; biases, norms, embeddings and logit_scale get none."""
    implementation: Literal["fused", "foreach"] = "fused"
    """`fused`: one kernel updates every parameter (torch's fused AdamW, on CUDA and CPU); `foreach`: a few
    batched kernels per step. The update is the same up to rounding."""


@dataclass
class LRScheduler:
    warmup_steps: int = _opt(20, lambda v: v >= 0, "an integer >= 0")
    """Linear warmup from lr/(warmup_steps+1) to lr over this many steps (at or beyond training.steps: a warning)."""
    decay_type: Literal["cosine", "linear", "none"] = "cosine"
    """Decay after warmup, down to lr * min_lr_factor at the last step."""
    min_lr_factor: float = _opt(0.0, lambda v: 0 <= v <= 1, "a number in [0, 1]")
    """Final learning rate as a fraction of the peak."""


@dataclass
class Loss:
    name: str = ""
    """Training objective (`titan_contrastive.losses`); empty = the family's own. `clip`: InfoNCE with a learned
    logit scale, symmetric unless `symmetric = false` (clip, bi_encoder, vlm). `siglip`: SigLIP's sigmoid loss
    (clip family; adds a `logit_bias`). `pixel`: the masked reconstruction loss of [pixel_loss] (vae). Objectives
    registered with `losses.register_objective` (e.g. from `job.custom_import`) are named the same way."""
    symmetric: bool = True
    """clip: add the document -> query direction over the positives (CLIP's loss); false: queries
    -> documents only (sentence-transformers' MultipleNegativesRankingLoss)."""
    joint_directions: list[str] = _opt([], None)
    """clip, one-way: more candidates in each query's one softmax (sentence-transformers' joint directions):
    query_to_query, doc_to_query, doc_to_doc; GTE: all three, Qwen3-Embedding: the first and last."""
    hardness_strength: float = _non_negative(0.0)
    """clip, one-way: + strength x cos(q, d) (no gradient) on hardness_mode's negatives (LLaVE); 0 = off."""
    hardness_mode: Literal["in_batch_negatives", "hard_negatives", "all_negatives"] = "in_batch_negatives"
    """Which negatives hardness_strength weighs: other queries' documents, own hard negatives, or both."""
    mask_duplicates: bool = False
    """Mask columns that are the same document as a query's positive out of its negatives: the same
    token ids (a text family's documents), e.g. a positive repeated in the batch or mined as a negative."""
    mask_margin: float | None = None
    """Mask columns with cos(q, d) > cos(q, positive) + mask_margin out of q's negatives (e.g. 0.1)."""
    mask_relative: float | None = _opt(None, lambda v: v is None or 0 < v <= 1, "a number in (0, 1], or empty")
    """Mask columns with cos(q, d) > mask_relative x cos(q, positive) (NV-Retriever; e.g. 0.95)."""
    guide_model: str = ""
    """A frozen model folder whose cosines the margin and relative masks compare (GISTEmbed's guide; bi_encoder)."""
    distill: Literal["", "kl", "margin_mse"] = ""
    """Add distillation from the data's teacher scores (pairs' label/score column, 1 + k per row): kl, margin_mse."""
    distill_weight: float = _non_negative(1.0)
    """The distillation term's weight (loss = contrastive_weight x objective + distill_weight x term)."""
    contrastive_weight: float = _non_negative(1.0)
    """The contrastive objective's weight beside loss.distill; 0 = distillation alone."""
    distill_temperature: float = _opt(1.0, lambda v: v > 0, "a number > 0")
    """distill=kl: the teacher's temperature tau, its targets being softmax(scores / tau)."""
    teacher_model: str = ""
    """distill=kl: a frozen model folder whose cosines over every column are the teacher's scores (bi_encoder)."""
    matryoshka_dims: list[int] = _opt([], lambda v: all(x >= 1 for x in v), "integers >= 1")
    """Train the loss on each of these leading-dimension prefixes, renormalized (e.g. [384, 256, 128, 64])."""
    matryoshka_weights: list[float] = _opt([], lambda v: all(x > 0 for x in v), "numbers > 0")
    """One weight per matryoshka_dims entry; empty = all 1."""
    negatives: Literal["microbatch", "global"] = "microbatch"
    """Which samples form one contrastive problem. `microbatch`: the current microbatches of all DP
    ranks; `global`: the whole global batch, exactly, at O(N d) memory (the streamed step)."""
    stream_chunk_size: int = _positive(1024)
    """negatives=global, PyTorch path: logit rows per block; extra memory ~ 2 x stream_chunk_size x N floats."""
    kernel: Literal["auto", "pytorch", "triton", "triton_exact"] = "auto"
    """negatives=global: `pytorch` streamed blocks (the reference); `triton` fused kernels (TF32 dots for
    float32), `triton_exact` IEEE dots; `auto`: on CUDA the fused kernels after a self-check, else pytorch."""
    init_logit_scale: float | None = None
    """t' at the start, t = exp(t'); empty = the loss's own: log(1/0.07) clip, log(10) siglip, log(20)
    bi_encoder. A learned t' is clamped to [0, log 100] after every step, so it must start there; a
    fixed one (learn_logit_scale = false) is never clamped, any value in [-log 1e4, log 1e4]."""
    init_logit_bias: float | None = None
    """siglip: the bias b at the start; empty = -10 (SigLIP's init)."""
    learn_logit_scale: bool = True
    """Train t' (true) or keep it fixed at its initial value (false)."""
    learn_logit_bias: bool = True
    """siglip: train b (true) or keep it fixed at its initial value (false)."""


@dataclass
class PixelLoss:
    """The vae family's masked pixel loss (seed 003); see components/pixel_loss.py."""

    mode: Literal["v0", "chunked", "per_chunk_backward"] = "per_chunk_backward"
    """`v0` decodes the batch at once; `chunked` decodes in chunks but keeps every chunk's graph
    until backward; `per_chunk_backward` backpropagates each chunk at once (peak activations of
    one chunk). All three give the same loss and gradients. Env PIXEL_LOSS_USE_V0=1 forces v0."""
    loss_type: Literal["l2", "mse", "l1"] = "l2"
    """Per-pixel difference in [0, 1] space: squared (l2, mse) or absolute (l1)."""
    chunk_size: int = _positive(2)
    """Images per decode when `adaptive` is false."""
    adaptive: bool = True
    """Pick the chunk size from the resolution: >= 1 MP -> 1, >= 0.25 MP -> 2, else 4."""
    empty_cache_every: int = _opt(0, lambda v: v >= 0, "an integer >= 0 (0 = never)")
    """CUDA only: torch.cuda.empty_cache() every this many chunks (seed 003 used 2)."""


@dataclass
class GradCacheConfig:
    enabled: bool = False
    """Forward each microbatch in chunks (GradCache): the contrastive problem stays the
    microbatch of all DP ranks (negatives=microbatch) or the global batch (negatives=global),
    while activation memory is that of one chunk. Costs one extra forward per sample."""
    chunk_sizes: list[int] = _opt(
        [32],
        lambda v: 1 <= len(v) <= 2 and all(x >= 1 for x in v),
        "one or two integers >= 1 (one chunk size, or image and text tower)",
    )
    """Samples per forward chunk: one value, or one per tower (image, text). The clip family runs
    both towers in one forward, so its two values must be equal."""
    chunk_tokens: int = _opt(0, lambda v: v >= 0, "0 (off) or an integer >= 1")
    """Tokens per forward chunk instead of `chunk_sizes` samples, for text families (bi_encoder); 0 = off.
    Samples sorted by length fill each chunk (samples x its longest query + longest document <= chunk_tokens;
    at least one): sentence-transformers' mini_batch_num_tokens, exact at any chunking. E.g. 32 x the
    median tokens per sample. Needs enabled = true and loss.negatives = microbatch; not planned by [memory]."""


@dataclass
class Data:
    dataset: Literal[
        "fashion_mnist", "emoji", "wordnet", "csv", "webdataset", "hf", "pairs", "vl_pairs", "synthetic"
    ] = "fashion_mnist"
    """Bundled: `fashion_mnist` (image-caption, zero-shot eval), `emoji` (image <-> name), `wordnet`
    (definition <-> lemma, bi_encoder). Yours: `csv` (image paths + captions), `webdataset` (tar shards),
    `hf` (a Hugging Face dataset on disk) for clip; `pairs` (JSONL/CSV/TSV/Parquet/HF text pairs) for
    bi_encoder; `vl_pairs` (rows query_image, query_text, doc_image, doc_text) for qwen_vl. `synthetic`:
    generated image-caption JPEGs (`synthetic_samples` of them) for speed runs (clip)."""
    synthetic_samples: int = _opt(65536, lambda v: v >= 1, "an integer >= 1")
    """synthetic: samples per epoch (every one decoded, cropped and tokenized like your own data)."""
    path: str = ""
    """Training data. Bundled sets: a folder (empty = the Debian package if installed, else the bundle).
    csv: the file. webdataset: tars as a brace pattern (`shards/{00000..00099}.tar`) or make_shards'
    `shards.json`. hf: a save_to_disk folder or a Parquet/JSON/Arrow/CSV file. pairs: a .jsonl/.csv/.tsv/
    .parquet/.arrow file or a save_to_disk folder. Several of one kind (csv, webdataset, hf, pairs, vl_pairs): `::`."""
    val_path: str = ""
    """Held-out data for evaluation (retrieval recall@1/5/10 both ways, or pair recall@1/10), of
    the same kind as `dataset`, except that a .csv/.tsv file is always read as csv; empty = no
    retrieval eval for your own data (the bundled sets bring their test split)."""
    upsampling_factors: list[float] = _opt([], lambda v: all(x > 0 for x in v), "a list of numbers > 0")
    """One factor per `::`-joined source of the training data: source i gives round(factor x its size)
    samples per epoch (open_clip's --train-data-upsampling-factors); empty = 1 each."""
    same_source_batches: bool = False
    """With several `::`-joined sources: each optimizer step's global batch comes from one source, the
    sources drawn in proportion to the steps they fill per epoch, so a query's in-batch negatives come
    from its own dataset (sentence-transformers' proportional multi-dataset batches); a source's
    remainder of a whole step is left out of that epoch (another part each epoch)."""
    query_prompts: list[str] = _opt([], None)
    """pairs: one prompt per `::`-joined source of `path`, prepended to its queries in place of model.query_prompt
    (a task's instruction), "" = none; vl_pairs: one template per source ("" = the model's). Evaluation keeps
    model.query_prompt. Empty = model.query_prompt for every source."""
    doc_prompts: list[str] = _opt([], None)
    """pairs, vl_pairs: the same for each source's documents and hard negatives; empty = model.doc_prompt."""
    csv_img_key: str = "filepath"
    """csv: column of image paths (relative paths resolve against the CSV's folder)."""
    csv_caption_key: str = "title"
    """csv: column of captions."""
    csv_separator: str = "\t"
    """csv: the column separator (open_clip's default is a tab)."""
    csv_negative_keys: list[str] = _opt([], None)
    """csv: columns of negative captions, one per column (hard negatives of the image); empty = none."""
    wds_image_key: str = "jpg;jpeg;png;webp"
    """webdataset: the image member's extensions, tried in order."""
    wds_caption_key: str = "txt"
    """webdataset: the caption member's extension, or `json:<field>` for a field of the sample's .json."""
    wds_negative_key: str = ""
    """webdataset: negative captions, `json:<field>` (a list in the sample's .json) or a member's
    extension whose text holds one caption per line; empty = none."""
    hf_image_column: str = "image"
    """hf: the column of images (an Image feature, bytes, or paths)."""
    hf_text_column: str = "text"
    """hf: the column of captions."""
    hf_negative_columns: list[str] = _opt([], None)
    """hf: string columns of negative captions, or one column holding a list of them; empty = none."""
    pairs_columns: list[str] = _opt([], lambda v: len(v) != 1, "empty or at least two column names")
    """pairs: the columns (query, positive, negatives...) of the rows; empty = the row's columns in
    order (sentence-transformers' convention: anchor, positive, then negatives; an `id` column is
    the positive's id, label/score columns are teacher scores for loss.distill)."""
    pairs_id_column: str = "id"
    """pairs: the column holding the id of each row's positive document, used by loss.mask_duplicates
    instead of the token ids (a negative whose text is a positive's gets that id); empty = none."""
    hard_negatives: bool = True
    """Serve the data's hard negatives (a pairs file's extra columns, WordNet's mined negative, the
    negative captions of csv/webdataset/hf); false = in-batch negatives only."""
    tokenizer: Literal["auto", "byte", "clip_bpe"] = "auto"
    """Caption tokenizer of image-text data: `byte` (UTF-8 bytes, the bundled sets' default) or
    `clip_bpe` (CLIP's 49,408-token BPE, context 77 as in CLIP; auto = clip_bpe for your own data)."""
    max_bad_fraction: float = _opt(0.001, lambda v: 0 <= v <= 1, "a fraction in [0, 1]")
    """Undecodable images, missing captions and unreadable files or shards are skipped, counted and
    logged; past this fraction of the samples loaded (at least one epoch's worth) the run stops."""
    pixels_on_device: bool = True
    """On a GPU, images decoded from files (csv, webdataset, hf, synthetic) leave the loader as uint8
    and are normalized on the device (a quarter of the bytes to pin and copy); false: float32 from the workers."""
    num_workers: int = _opt(0, lambda v: v >= 0, "an integer >= 0")
    """DataLoader worker processes (0 loads in the training process; right for the in-memory
    bundled sets; 2 or more for your own data, which is decoded per sample)."""
    context_length: int = _opt(0, lambda v: v == 0 or v >= 4, "0 (the tokenizer's default) or an integer >= 4")
    """Text tokens per caption, start and end tokens included; 0 = 32 for the byte tokenizer and
    the pairs' queries, 77 for clip_bpe."""
    doc_context_length: int = _opt(0, lambda v: v == 0 or v >= 4, "0 (the model's default) or an integer >= 4")
    """Text pairs: tokens per document (context_length is the queries'); 0 = the model folder's max_seq_length
    (512 at most), 16 for the bundled MiniLM."""
    augment: bool = True
    """Per-sample augmentation in the train split (a pure function of seed, epoch and index): flips
    of the bundled images, random-resized crops of your own."""
    image_size: int = _opt(0, lambda v: v >= 0, "0 (native size) or a size in pixels")
    """0 = the dataset's native size (224 for your own data); N = images resized to N x N, e.g. 224
    for clip/vit_b32 (patch 32) on the 28x28 Fashion-MNIST."""
    image_sizes: list[int] = _opt([], lambda v: all(x >= 1 for x in v), "a list of sizes in pixels, each >= 1")
    """Mixed resolutions (model.name=vlm or vae): each image is served at one of these square sizes
    (train: drawn per sample and epoch; test: cycled), as Qwen-VL-style packed patches (vlm) or
    zero-padded with a pixel mask (vae). Empty = one size (image_size or native)."""
    retrieval_mode: Literal["t2i", "i2t", "i2i", "t2t", "m2i"] = "t2i"
    """qwen_vl: each side's kind (t2i: texts query images; i2t, i2i, t2t; m2i: image + text queries,
    images); image-text data trains t2i and i2t, the others need data.dataset = "vl_pairs"."""
    min_pixels: int = _opt(0, lambda v: v >= 0, "an integer >= 0")
    """qwen_vl: images resized to at least this many pixels; 0 = the model folder's image processor's."""
    max_pixels: int = _opt(0, lambda v: v >= 0, "an integer >= 0")
    """qwen_vl: and to at most this many (visual tokens = pixels / (14·2)² for Qwen2-VL); 0 = the folder's."""


@dataclass
class Memory:
    budget_gib: float = _non_negative(0.0)
    """Per-device memory budget; > 0 turns on the planner: real train steps at a few chunk sizes are
    measured and the fastest chunk that fits is used (docs/memory-planner.md). 0 = off."""
    plan: bool = False
    """With budget_gib: print the plan and exit without training (a dry run)."""
    margin: float = _opt(0.05, lambda v: 0 <= v < 0.5, "a fraction in [0, 0.5)")
    """Head-room kept below the budget (allocator fragmentation, data-dependent sizes)."""


@dataclass
class Eval:
    enable: bool = True
    """Evaluate at all (every `freq` steps and after the last step)."""
    freq: int = _opt(0, lambda v: v >= 0, "an integer >= 0 (0 = only after the last step)")
    """Evaluate every this many steps (and always after the last step)."""
    batch_size: int = _positive(500)
    """Images per evaluation batch; the eval loss is the mean over consecutive batches of this size."""
    zero_shot_path: str = ""
    """Zero-shot classification on an ImageFolder-layout folder (one sub-folder of images per
    class), as well as the run's own evaluation; empty = none."""
    zero_shot_names: str = ""
    """A text file of class names, one per line in sorted sub-folder order; empty = the folder
    names (underscores as spaces)."""
    zero_shot_templates: str = "openai"
    """Prompt templates: `openai` (CLIP's 80 ImageNet prompts, as open_clip), `simple` (open_clip's
    short list), or a text file with one template per line, each with `{}` for the class name."""
    beir_path: str = ""
    """Text pairs: also retrieval on a BEIR folder (corpus.jsonl, queries.jsonl, qrels/), embedded once
    across the ranks: nDCG@10, MRR@10, MAP@100, Recall@1/10/100 (keys `beir/...`); `bundled` = the
    WordNet set in assets/wordnet_beir; empty = none."""
    beir_split: str = "test"
    """Which qrels file of `beir_path` (qrels/{split}.tsv)."""
    dims: list[int] = _opt([], lambda v: all(x >= 1 for x in v), "integers >= 1")
    """Also the retrieval recall of the embeddings cut to their first m dims and re-normalized, per
    m (keys `dim{m}/...`): a Matryoshka model's smaller embeddings, or a plain model's truncated
    ones; empty = `loss.matryoshka_dims`."""


@dataclass
class Metrics:
    log_freq: int = _positive(10)
    """Log step, loss, lr, grad norm, samples/s, memory and data-loading share every N steps."""
    enable_tensorboard: bool = True
    """Write TensorBoard events to `{dump_folder}/tb` (rank 0)."""
    peak_tflops: float = _non_negative(0.0)
    """Device peak TFLOP/s for MFU; 0 = look up known GPUs (H100/H200/A100), no MFU on CPU."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save DCP checkpoints and resume from the latest complete one at start."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder; each checkpoint is `step-N`."""
    interval: int = _positive(100)
    """Save every this many steps (and after the last step, and after the step a SIGTERM/SIGUSR1 stops)."""
    keep_latest_k: int = _opt(2, lambda v: v >= 0, "an integer >= 0 (0 keeps all)")
    """Keep only the newest k complete checkpoints (and the best by keep_best); 0 keeps all."""
    keep_best: str = ""
    """An eval metric (`beir/ndcg@10`, `query_to_doc_r@1`, `loss`: lower is better for *loss) whose best
    checkpoint pruning spares, named in `<folder>/best.json` (HF's metric_for_best_model); needs eval.freq
    to divide interval. Empty = off."""
    load_step: int = _opt(-1, lambda v: v == -1 or v >= 0, "-1 (latest complete) or a step >= 0")
    """Step to resume from; -1 = the latest complete checkpoint. A missing step is an error."""


@dataclass
class Comm:
    init_timeout_seconds: int = _positive(300)
    """Collective timeout from process-group start to the end of the first step (data indexing, model build, ...)."""
    train_timeout_seconds: int = _positive(300)
    """Collective timeout after the first step: a rank that waits longer for its peers (one
    stalled or died) ends the job with exit code 4 instead of hanging. It must exceed the longest
    gap between two collectives: a step, an evaluation, a checkpoint save with its checksums
    (torchtitan's default is 100 on GPUs; 300 leaves room for CPU steps and large saves)."""


@dataclass
class JobConfig:
    """titan_contrastive training job. Values come from defaults, then the TOML given by
    --job.config_file, then --section.key=value overrides."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    lora: Lora = field(default_factory=Lora)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    loss: Loss = field(default_factory=Loss)
    pixel_loss: PixelLoss = field(default_factory=PixelLoss)
    gradcache: GradCacheConfig = field(default_factory=GradCacheConfig)
    data: Data = field(default_factory=Data)
    memory: Memory = field(default_factory=Memory)
    eval: Eval = field(default_factory=Eval)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    comm: Comm = field(default_factory=Comm)
