"""The configuration tree: one dataclass per TOML section (`[data]`'s in `data.py`, `[loss]`'s in `loss.py`, `[eval]`'s
in `evaluation.py`), every field documented.

The docstring under each field is what `--help` prints (tyro reads it). Range constraints live next to the
field (`fields.py`: `opt(default, predicate, "what is valid")`): `manager.py` names key, value and fix in one line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from titan_contrastive.config.data import Data
from titan_contrastive.config.evaluation import Eval
from titan_contrastive.config.fields import non_negative, opt, positive
from titan_contrastive.config.loss import Loss

# A learned logit scale t' is clamped to [0, MAX_LOGIT_SCALE] after every step (CLIP's temperature
# cap, t = exp(t') <= 100); a fixed one is kept as given, within +-MAX_FIXED_LOGIT_SCALE (t between
# 1e-4 and 1e4: beyond, the logits overflow float16, or no longer tell pairs apart).
MAX_LOGIT_SCALE = math.log(100.0)
MAX_FIXED_LOGIT_SCALE = math.log(1e4)


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
    """Registered model family: `clip`, `hf_clip` (a Hugging Face CLIP or SigLIP from `path`, needs `.[hf]`),
    `bi_encoder` (a Hugging Face text model from `path`, `.[hf]`), `lit` (a ViT against the pretrained MiniLM
    text tower, `.[hf]`), `qwen_vl` (a Qwen2-VL / Qwen2.5-VL / Qwen3-VL embedder from `path`, `.[hf]`), `vlm`
    (a small packed-patch model for CPU tests), `vae` (pixel loss), `static` (sentence-transformers' StaticEmbedding:
    a table of token vectors, averaged, `.[hf]`), or your own."""
    flavor: str = ""
    """Size preset of the family (empty = its first): clip `debug` (CPU) / `vit_b32` / `vit_b16` / `vit_l14`;
    bi_encoder `shared` / `dual` (one tower or two); hf_clip `folder`; lit `minilm_debug`; qwen_vl `default`;
    vlm `debug`; vae `debug` / `sd`; static `shared` / `dual`."""
    init_from: str = ""
    """Start from a checkpoint's weights (clip): a Hugging Face CLIP folder (config.json +
    model.safetensors) or a step-N folder of one of our runs; its architecture replaces the
    flavor's. The data must match it (data.image_size, data.tokenizer = clip_bpe for CLIP's
    vocabulary, data.context_length). Empty = random init."""
    path: str = ""
    """bi_encoder, qwen_vl: a local transformers or sentence-transformers folder (BERT, XLM-R, MPNet, ModernBERT,
    T5's encoder, a Qwen3, Llama or Gemma 3 decoder; Dense modules after the pooling), or a hub id already in
    the local cache; never downloaded, and code the folder ships runs only with `trust_remote_code`. Empty = the
    bundled all-MiniLM-L6-v2.
    hf_clip: a transformers CLIP or SigLIP folder with its tokenizer and preprocessor_config.json (required).
    static: a sentence-transformers StaticEmbedding folder, a model2vec folder, or any folder with a tokenizer
    (with `static_dim`); empty = the bundled MiniLM's tokenizer (with `static_dim`)."""
    static_dim: int = opt(0, lambda v: v >= 0, "an integer >= 0")
    """static: start a table of this width at random, N(0, 1) as sentence-transformers' StaticEmbedding does, over
    the vocabulary of `path`'s tokenizer (1024: static-retrieval-mrl-en-v1's); 0 = the folder's own table."""
    pooling: Literal[
        "auto", "cls", "mean", "last_token", "max", "mean_sqrt_len", "weighted_mean", "splade", "colbert"
    ] = "auto"
    """bi_encoder: `auto` = the sentence-transformers folder's pooling, else mean (encoders) / last_token (decoders);
    max, mean_sqrt_len (the sum over sqrt(tokens)) and weighted_mean (token t weighted t, SGPT's) as
    sentence-transformers' Pooling computes them; splade: a masked LM's vocabulary-wide sparse embedding, the max
    over the tokens of log(1 + relu(logits)) (`splade_pooling`, `splade_activation`), scored by dot product
    (t = 1); colbert: every token projected and normalized, scored by late interaction (MaxSim, t = 1; a PyLate
    folder's `auto`). qwen_vl: last_token, mean or colbert (ColPali's ColQwen: every text and visual token
    projected and normalized, scored by MaxSim; a ColQwen folder's projection read); `auto` = the
    sentence-transformers folder's, else last_token."""
    query_prompt: str = "auto"
    """bi_encoder: text prepended to every query (E5 "query: ", an instruction); `auto` = the folder's query prompt.
    qwen_vl: the query's template, `{text}` for the caption, `{image}` for the image; `auto` = a sentence-transformers
    folder's chat template as it renders a query (its query prompt the system message), else `{text}` / `{image}`."""
    doc_prompt: str = "auto"
    """bi_encoder: text prepended to every document; `auto` = the folder's `document` / `passage` prompt.
    qwen_vl: the document's template (t2i: e.g. "{image} Summarize above image in one word:"); `auto` as for the
    query's."""
    inference_free: bool | None = None
    """bi_encoder with pooling=splade: queries embedded without a forward pass, a learned weight on each vocabulary
    entry among their tokens (sentence-transformers' SparseStaticEmbedding; OpenSearch's inference-free models),
    documents by the masked LM. The weights start at the folder's, else 1 (`optimizer.static_query_lr` sets their
    learning rate). Unset (`none`) = the folder's: a SparseEncoder Router whose query route is a
    SparseStaticEmbedding."""
    splade_pooling: Literal["auto", "max", "sum"] = "auto"
    """bi_encoder with pooling=splade: the tokens' weights pooled by max (SPLADE v2 and later) or sum (SPLADE v1);
    `auto` = the SparseEncoder folder's, else max."""
    splade_activation: Literal["auto", "relu", "log1p_relu"] = "auto"
    """bi_encoder with pooling=splade: a token's weight, log(1 + relu(logit)) (relu) or one more log(1 + .)
    (log1p_relu, OpenSearch's inference-free document models); `auto` = the SparseEncoder folder's, else relu."""
    colbert_dim: int = 0
    """pooling=colbert: the width of a token's vector; 0 = the PyLate (bi_encoder) or ColQwen (qwen_vl) folder's,
    else 128 (a new projection; ColQwen3's 320 on a Qwen3-VL folder)."""
    query_expansion: bool | None = None
    """bi_encoder with pooling=colbert: pad queries to data.context_length with the mask token and score every
    position (PyLate's `do_query_expansion`); unset (`none`) = the PyLate folder's, else true."""
    include_prompt: bool | None = None
    """bi_encoder: whether the pooling reads the prompts' tokens (sentence-transformers' Pooling `include_prompt`);
    false = INSTRUCTOR's way, the prompt conditions the text but is left out of the embedding's pooling. Unset
    (`none`) = the folder's, true for a plain folder. Exported to sentence-transformers with the pooling."""
    bidirectional: bool | None = None
    """bi_encoder: true lets a decoder's tokens attend to the whole text, not only to those before them (LLM2Vec,
    GritLM, NV-Embed; transformers' `is_causal=False`), and its exports keep it (config.json `is_causal`); `auto`
    pooling is then mean and cls is allowed. Unset (`none`) = the folder's: causal for a decoder, unless its config
    says otherwise (EmbeddingGemma). false on a folder that attends both ways is an error."""
    attn_implementation: Literal["", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"] = ""
    """bi_encoder, qwen_vl: the attention kernel transformers runs the loaded model with (its `attn_implementation`):
    sdpa (PyTorch's fused attention, transformers' default), eager, flash_attention_2 / flash_attention_3 (the
    flash-attn package, GPU; padding is unpadded per sequence) or flex_attention; empty = transformers' choice."""
    freeze: list[str] = opt([], None)
    """Locked towers / partial tuning: tower names (clip `image`, `text`; bi_encoder `query`, `doc`)
    or fnmatch patterns over parameter names. Frozen parameters get no gradients and no optimizer
    state; a wholly frozen tower runs without a graph (LiT: `["text"]` or `["image"]`)."""
    unlocked_layers: int = opt(0, lambda v: v >= 0, "an integer >= 0")
    """Of each tower named in `freeze`, the last N residual blocks (and the norm and projection
    after them) stay trainable (open_clip's --lock-image-unlocked-groups)."""
    patch_dropout: float = opt(0.0, lambda v: 0 <= v < 1, "a number in [0, 1)")
    """FLIP's patch dropout (clip, lit, hf_clip's CLIP, MetaCLIP 2 and SigLIP): in training each image keeps a
    random 1 - p of its patches (the class token always), so its tower costs about 1 - p per sample; evaluation
    sees every patch. Replayed exactly in every step kind; may change on resume (FLIP's unmasked tuning: 0)."""
    trust_remote_code: bool = False
    """bi_encoder, static: run the Python code a folder ships for its model and tokenizer (config.json `auto_map`:
    nomic-embed-text, gte-*-v1.5, jina-embeddings-v2), for `path` and a guide's or teacher's folder, as
    transformers' `trust_remote_code=True`. Off, such a folder is refused in one line. Only for folders you trust."""


@dataclass
class Lora:
    """LoRA adapters (peft) on the bi_encoder's Hugging Face towers: only the adapters (and the logit
    scale) train; checkpoints hold only them, the frozen base comes from `[model] path` again."""

    enable: bool = False
    rank: int = positive(8)
    """r: the adapters' inner dimension. A resumed run must keep it (the saved adapters' shapes)."""
    alpha: float = opt(16.0, lambda v: v > 0, "a number > 0")
    """The adapters' output is scaled by alpha / rank."""
    dropout: float = opt(0.05, lambda v: 0 <= v < 1, "a number in [0, 1)")
    """Dropout on the adapters' input (replayed exactly in a GradCache re-forward)."""
    use_rslora: bool = False
    """rsLoRA: the adapters' output scaled by alpha / sqrt(rank) instead of alpha / rank, so the update keeps
    its size as the rank grows (peft's `use_rslora`)."""
    use_dora: bool = False
    """DoRA: each adapted weight trains as a magnitude per output row and a direction that the adapters
    update (peft's `use_dora`); more compute per step than LoRA."""
    target_modules: list[str] = opt([], None)
    """Names (or name suffixes) of the linear layers to adapt; empty = peft's default for the
    architecture (BERT: query, value; Qwen and Llama: q_proj, v_proj); ['all-linear'] = every linear
    layer but an output head (peft's choice; MPNet, DistilBERT and ModernBERT have no default)."""
    modules_to_save: list[str] = opt([], None)
    """Modules trained in full beside the adapters (peft's `modules_to_save`: names or name suffixes
    of modules that do not nest), e.g. ['word_embeddings'] (BERT) or ['embed_tokens'] (Qwen,
    Llama); empty = the whole base stays frozen."""


@dataclass
class Training:
    local_batch_size: int = positive(128)
    """Samples per process per forward/backward (one microbatch)."""
    global_batch_size: int = opt(-1, lambda v: v == -1 or v >= 1, "-1 (= local batch x DP degree) or an integer >= 1")
    """Samples per optimizer step over all processes. Gradient accumulation steps =
    global_batch_size // (local_batch_size * dp_degree); -1 means one microbatch per step."""
    steps: int = positive(200)
    """Number of optimizer steps (in place of which `epochs`, when set, gives them)."""
    epochs: int = opt(0, lambda v: v >= 0, "an integer >= 0 (0: training.steps gives the run's length)")
    """Passes over the train set; > 0 sets the run's steps to the optimizer steps of that many epochs (an epoch's
    loader steps x epochs // the accumulation steps; an epoch drops the samples short of a whole batch), in place of
    `steps`. 0: `steps`."""
    max_norm: float = non_negative(1.0)
    """Clip the total gradient norm to this after the last microbatch; 0 disables clipping."""
    seed: int = opt(0, lambda v: v >= 0, "an integer >= 0")
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
    max_consecutive_skips: int = positive(10)
    """With on_nonfinite=skip: past this many skipped steps in a row the run stops as `stop` does
    (exit code 3): a run that only skips is stuck."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = opt(1, lambda v: v == -1 or v >= 1, "-1 (fill the rest) or an integer >= 1")
    """Replicas (DDP when alone, the outer dimension of HSDP); -1 fills what the shard degree leaves."""
    data_parallel_shard_degree: int = opt(-1, lambda v: v == -1 or v >= 1, "-1 (fill the rest) or an integer >= 1")
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
    lr: float = opt(1e-3, lambda v: v > 0, "a number > 0")
    """Peak learning rate (reached at the end of warmup)."""
    beta1: float = opt(0.9, lambda v: 0 <= v < 1, "a number in [0, 1)")
    """AdamW beta1."""
    beta2: float = opt(0.98, lambda v: 0 <= v < 1, "a number in [0, 1)")
    """AdamW beta2 (0.98 as in CLIP)."""
    eps: float = opt(1e-6, lambda v: v > 0, "a number > 0")
    """AdamW epsilon."""
    weight_decay: float = non_negative(0.1)
    """Decoupled weight decay on matrices; biases, norms, embeddings and logit_scale get none."""
    layer_decay: float = opt(1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")
    """Layer-wise learning-rate decay (BEiT's; fine-tuning pretrained towers): in each tower of L blocks, block i
    trains at lr x layer_decay^(L - i), the embeddings at layer_decay^(L + 1), what follows the blocks (and the
    logit scale) at lr; 1 = off. Families with named towers (clip, hf_clip, lit, bi_encoder)."""
    static_query_lr: float = non_negative(0.0)
    """The learning rate of inference-free SPLADE's query weights (`model.inference_free`; sentence-transformers'
    `learning_rate_mapping` for SparseStaticEmbedding.weight, e.g. 1e-3 beside an lr of 2e-5), following the
    same schedule; 0 = `lr`."""
    implementation: Literal["fused", "foreach"] = "fused"
    """`fused`: one kernel updates every parameter (torch's fused AdamW, on CUDA and CPU); `foreach`: a few
    batched kernels per step. The update is the same up to rounding."""


@dataclass
class LRScheduler:
    warmup_steps: int = opt(20, lambda v: v >= 0, "an integer >= 0")
    """Linear warmup from lr/(warmup_steps+1) to lr over this many steps (at or beyond training.steps: a warning)."""
    decay_type: Literal["cosine", "linear", "sqrt", "none"] = "cosine"
    """Decay after warmup (or after the stable phase), down to lr * min_lr_factor at the last step."""
    decay_ratio: float | None = opt(None, lambda v: v is None or 0 < v <= 1, "a number in (0, 1], or unset")
    """Warmup-stable-decay (torchtitan's `decay_ratio`): the lr holds its peak after warmup and decays over the
    last round(decay_ratio x training.steps) steps only. Unset: it decays from the end of warmup. A run resumed
    with more training.steps and a decay_ratio branches a decay off a stable run."""
    min_lr_factor: float = opt(0.0, lambda v: 0 <= v <= 1, "a number in [0, 1]")
    """Final learning rate as a fraction of the peak."""


@dataclass
class PixelLoss:
    """The vae family's masked pixel loss (seed 003); see components/pixel_loss.py."""

    mode: Literal["v0", "chunked", "per_chunk_backward"] = "per_chunk_backward"
    """`v0` decodes the batch at once; `chunked` decodes in chunks but keeps every chunk's graph
    until backward; `per_chunk_backward` backpropagates each chunk at once (peak activations of
    one chunk). All three give the same loss and gradients. Env PIXEL_LOSS_USE_V0=1 forces v0."""
    loss_type: Literal["l2", "mse", "l1"] = "l2"
    """Per-pixel difference in [0, 1] space: squared (l2, mse) or absolute (l1)."""
    chunk_size: int = positive(2)
    """Images per decode when `adaptive` is false."""
    adaptive: bool = True
    """Pick the chunk size from the resolution: >= 1 MP -> 1, >= 0.25 MP -> 2, else 4."""
    empty_cache_every: int = opt(0, lambda v: v >= 0, "an integer >= 0 (0 = never)")
    """CUDA only: torch.cuda.empty_cache() every this many chunks (seed 003 used 2)."""


@dataclass
class GradCacheConfig:
    enabled: bool = False
    """Forward each microbatch in chunks (GradCache): the contrastive problem stays the
    microbatch of all DP ranks (negatives=microbatch) or the global batch (negatives=global),
    while activation memory is that of one chunk. Costs one extra forward per sample."""
    chunk_sizes: list[int] = opt(
        [32],
        lambda v: 1 <= len(v) <= 2 and all(x >= 1 for x in v),
        "one or two integers >= 1 (one chunk size, or image and text tower)",
    )
    """Samples per forward chunk: one value, or one per tower (image, text). The clip family runs
    both towers in one forward, so its two values must be equal."""
    chunk_tokens: int = opt(0, lambda v: v >= 0, "0 (off) or an integer >= 1")
    """Tokens per forward chunk instead of `chunk_sizes` samples, for text families (bi_encoder); 0 = off.
    Samples sorted by length fill each chunk (samples x its longest query + longest document <= chunk_tokens;
    at least one): sentence-transformers' mini_batch_num_tokens, exact at any chunking. E.g. 32 x the
    median tokens per sample. Needs enabled = true and loss.negatives = microbatch; not planned by [memory]."""


@dataclass
class Memory:
    budget_gib: float = non_negative(0.0)
    """Per-device memory budget; > 0 turns on the planner: real train steps at a few chunk sizes are
    measured and the fastest chunk that fits is used (docs/memory-planner.md). 0 = off."""
    plan: bool = False
    """With budget_gib: print the plan and exit without training (a dry run)."""
    margin: float = opt(0.05, lambda v: 0 <= v < 0.5, "a fraction in [0, 0.5)")
    """Head-room kept below the budget (allocator fragmentation, data-dependent sizes)."""


@dataclass
class Metrics:
    log_freq: int = positive(10)
    """Log step, loss, lr, grad norm, samples/s, memory and data-loading share every N steps."""
    enable_tensorboard: bool = True
    """Write TensorBoard events to `{dump_folder}/tb` (rank 0)."""
    enable_wandb: bool = False
    """Also log every record to Weights & Biases (rank 0; the `wandb` extra): project `$WANDB_PROJECT` (default
    titan_contrastive), the run's config as its config, files in `{dump_folder}/wandb`; `WANDB_MODE=offline` logs
    without a network (`wandb sync` uploads later). A run resumed from a checkpoint continues the dump folder's W&B
    run (id in `{dump_folder}/wandb/run_id`)."""
    peak_tflops: float = non_negative(0.0)
    """Device peak TFLOP/s for MFU; 0 = look up known GPUs (H100/H200/A100), no MFU on CPU."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save DCP checkpoints and resume from the latest complete one at start."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder; each checkpoint is `step-N`."""
    interval: int = positive(100)
    """Save every this many steps (and after the last step, and after the step a SIGTERM/SIGUSR1 stops)."""
    every_epoch: bool = False
    """Save after each epoch's last step (the optimizer step holding its last batch), in place of `interval`."""
    keep_latest_k: int = opt(2, lambda v: v >= 0, "an integer >= 0 (0 keeps all)")
    """Keep only the newest k complete checkpoints (and the best by keep_best); 0 keeps all."""
    keep_best: str = ""
    """An eval metric (`beir/ndcg@10`, `query_to_doc_r@1`, `loss`: lower is better for *loss) whose best
    checkpoint pruning spares, named in `<folder>/best.json` (HF's metric_for_best_model); needs eval.freq
    to divide interval. Empty = off."""
    load_step: int = opt(-1, lambda v: v == -1 or v >= 0, "-1 (latest complete) or a step >= 0")
    """Step to resume from; -1 = the latest complete checkpoint. A missing step is an error."""
    async_mode: str = opt(
        "disabled",
        lambda v: v in ("disabled", "async", "async_with_pinned_mem"),
        '"disabled", "async" or "async_with_pinned_mem"',
    )
    """"async" (torchtitan's names): an interval's save copies the state to host memory and returns; the
    files, checksums and rename follow in a background thread, waited for by the next save (the last
    step's save stays synchronous). Costs a host copy of the checkpointed state while it writes.
    "async_with_pinned_mem": the same, the host copy allocated once (pinned on CUDA), reused by every save
    and filled while the next step's forward and backward run (complete before its optimizer step): a
    shorter wait, that copy's memory held for the whole run; refused for a model with BatchNorm."""


@dataclass
class Comm:
    init_timeout_seconds: int = positive(300)
    """Collective timeout from process-group start to the end of the first step (data indexing, model build, ...)."""
    train_timeout_seconds: int = positive(300)
    """Collective timeout after the first step: a rank that waits longer for its peers (one
    stalled or died) ends the job with exit code 4 instead of hanging. It must exceed the longest
    gap between two collectives: a step, an evaluation, a checkpoint save with its checksums
    (torchtitan's default is 100 on GPUs; 300 leaves room for CPU steps and large saves)."""


@dataclass
class Profiling:
    enable: bool = False
    """Trace windows of steps with torch.profiler (CPU and CUDA activities, op shapes): per rank and window, a
    Chrome/Perfetto trace and a table of the costliest ops in `{dump_folder}/{folder}/step-{N}/` (N: the
    window's first step). A traced step is a whole loop iteration: its data wait, step, logging, eval, checkpoint."""
    folder: str = "profile_traces"
    """Trace folder, relative to job.dump_folder."""
    start_step: int = positive(3)
    """First step of the first window; the step before it warms the profiler up (the first steps compile and
    fill caches)."""
    steps: int = positive(1)
    """Steps per window."""
    freq: int = opt(0, lambda v: v >= 0, "an integer >= 0 (0 traces one window)")
    """A window again every this many steps after start_step; 0 = one window."""
    memory_snapshot: bool = False
    """CUDA: record the caching allocator's history from the first step and dump it at each window's end and on
    an out-of-memory error (`rank{r}_memory_snapshot.pickle`, for pytorch.org/memory_viz); with or without
    `enable`. Costs time at every allocation: for diagnosis runs."""


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
    profiling: Profiling = field(default_factory=Profiling)
