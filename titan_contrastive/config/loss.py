"""The `[loss]` section: the training objective, its temperature, negatives, masks, weights and the terms beside it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from titan_contrastive.config.fields import non_negative, opt, positive

__all__ = ["Loss"]


@dataclass
class Loss:
    name: str = ""
    """Training objective (`titan_contrastive.losses`); empty = the family's own. `clip`: InfoNCE with a learned
    logit scale, symmetric unless `symmetric = false` (clip, bi_encoder, vlm). `siglip`: SigLIP's sigmoid loss
    (clip family; adds a `logit_bias`). `pairwise`: softplus of each query's hardest in-batch negative's score minus
    its positive's (ColPali's and colpali-engine's PairwiseCELoss; one-way). `pixel`: the masked reconstruction loss
    of [pixel_loss] (vae). Objectives
    registered with `losses.register_objective` (e.g. from `job.custom_import`) are named the same way."""
    symmetric: bool = True
    """clip: add the document -> query direction over the positives (CLIP's loss); false: queries
    -> documents only (sentence-transformers' MultipleNegativesRankingLoss)."""
    maxsim_normalize: bool = False
    """Late interaction (`[model] pooling = "colbert"`): divide each query's MaxSim by its token count (ColPali's
    normalize_scores; with `init_logit_scale` = ln 50, fixed, ColPali's ColbertLoss at its temperature 0.02)."""
    joint_directions: list[str] = opt([], None)
    """clip, one-way: more candidates in each query's one softmax (sentence-transformers' joint directions):
    query_to_query, doc_to_query, doc_to_doc; GTE: all three, Qwen3-Embedding: the first and last."""
    hardness_strength: float = non_negative(0.0)
    """clip, one-way: + strength x cos(q, d) (no gradient) on hardness_mode's negatives (LLaVE); 0 = off."""
    hardness_mode: Literal["in_batch_negatives", "hard_negatives", "all_negatives"] = "in_batch_negatives"
    """Which negatives hardness_strength weighs: other queries' documents, own hard negatives, or both."""
    pairwise_in_batch_weight: float = opt(0.5, lambda v: 0 <= v <= 1, "a number in [0, 1]")
    """pairwise, with hard negatives: the in-batch term's weight w beside each hard negative's softplus term's
    1 - w (colpali-engine's in_batch_term_weight); without hard negatives the in-batch term is the loss."""
    pairwise_in_batch: Literal["hardest", "infonce"] = "hardest"
    """pairwise: the in-batch term; `hardest`: softplus against each query's hardest other positive (colpali-engine's
    PairwiseCELoss); `infonce`: one-way InfoNCE over the positives (its NegativeCELoss, beside the hard negatives)."""
    mask_duplicates: bool = False
    """Mask columns that are the same document as a query's positive out of its negatives: the same
    token ids (a text family's documents), e.g. a positive repeated in the batch or mined as a negative."""
    mask_margin: float | None = None
    """Mask columns with cos(q, d) > cos(q, positive) + mask_margin out of q's negatives (e.g. 0.1); MaxSim in the
    place of cos under model.pooling=colbert."""
    mask_relative: float | None = opt(None, lambda v: v is None or 0 < v <= 1, "a number in (0, 1], or empty")
    """Mask columns with cos(q, d) > mask_relative x cos(q, positive) (NV-Retriever; e.g. 0.95); MaxSim in the place
    of cos under model.pooling=colbert (colpali-engine's positive-aware negative filtering)."""
    guide_model: str = ""
    """A frozen model folder whose cosines the margin and relative masks compare (GISTEmbed's guide; bi_encoder)."""
    guide_embeddings: str = ""
    """A .parquet/.jsonl file of a guide's embeddings of the data's texts (text, embedding[, side]; written by
    `python -m titan_contrastive.embed`, or for image-text data `embed_images`), used as guide_model's are, with no
    guide running (pairs, wordnet, and image-text data)."""
    distill: Literal["", "kl", "margin_mse", "cosent", "mse"] = ""
    """Add a term on the data's scores (pairs' label/score column, 1 + k per row): a teacher's, distilled by kl or
    margin_mse; or gold labels (an STS set's), every (query, own document) pair ranked by cosent (CoSENT); or mse,
    the model's embeddings regressed onto a teacher's (teacher_embeddings or teacher_model, of the model's width)."""
    cosent_similarity: Literal["cosine", "angle"] = "cosine"
    """distill=cosent: what its pairs' logits are t x: cosine (CoSENT), or angle (AnglE: |cos + sin| of each
    embedding's halves read as complex numbers, sentence-transformers' AnglELoss)."""
    distill_weight: float = non_negative(1.0)
    """The distillation term's weight (loss = contrastive_weight x objective + distill_weight x term)."""
    contrastive_weight: float = non_negative(1.0)
    """The contrastive objective's weight beside loss.distill; 0 = distillation alone."""
    distill_temperature: float = opt(1.0, lambda v: v >= 0, "a number > 0, or 0 for the teacher's own")
    """distill=kl: the teacher's temperature tau, its targets being softmax(scores / tau); 0: a CLIP or SigLIP teacher's
    own, 1 / exp(logit_scale), of its teacher_model (clip, hf_clip) or kept in its teacher_embeddings (embed_images)."""
    distill_symmetric: bool = False
    """distill=kl with a teacher model (or its embeddings): also each positive document's softmax over the queries
    toward the teacher's, the two directions averaged, as open_clip's DistillClipLoss distills a CLIP."""
    distill_minmax: bool = False
    """distill=kl: each query's logits over its own documents scaled to [0, 1] before the softmax,
    (S - min) / (max - min + 1e-8) (PyLate's Distillation normalize_scores)."""
    gor_weight: float = non_negative(0.0)
    """Global orthogonal regularization's second-moment term, relu(mean (x_i . x_j)^2 - 1/d) over each column's
    pairs (EmbeddingGemma's spread-out regularizer), by this weight; 0 = off."""
    gor_mean_weight: float = non_negative(0.0)
    """GOR's mean term, (mean x_i . x_j)^2 over each column's pairs, by this weight; 0 = off."""
    gor_aggregation: Literal["sum", "mean"] = "sum"
    """How GOR combines its columns (queries, positives, each hard negative): sum (EmbeddingGemma) or mean
    (sentence-transformers' GlobalOrthogonalRegularizationLoss default)."""
    flops_query_weight: float = non_negative(0.0)
    """The FLOPS regularizer on the queries, sum_j (mean_i q_ij)^2 by this weight (SPLADE's lambda_q,
    sentence-transformers' SpladeLoss query_regularizer_weight; e.g. 5e-5); 0 = off."""
    flops_doc_weight: float = non_negative(0.0)
    """The FLOPS regularizer on the documents (positives and hard negatives), by this weight (SPLADE's lambda_d,
    SpladeLoss document_regularizer_weight; e.g. 3e-5); 0 = off."""
    flops_query_threshold: int = opt(0, lambda v: v >= 0, "an integer >= 0")
    """Only queries with more than this many non-zero dimensions count towards their FLOPS term (the mean still
    over every query): sentence-transformers' FlopsLoss threshold, FLOPS with l0 masking (OpenSearch's
    inference-free models); 0 = every query."""
    flops_doc_threshold: int = opt(0, lambda v: v >= 0, "an integer >= 0")
    """The same for the documents' FLOPS term (SpladeLoss document_regularizer_threshold); 0 = every document."""
    flops_warmup_steps: int = opt(0, lambda v: v >= 0, "an integer >= 0")
    """Both FLOPS weights rise as (step / N)^2 from 0 to full over the first N optimizer steps (SPLADE's
    quadratic warmup; sentence-transformers' SparseEncoderTrainer does it over a third of the run); 0 = none."""
    teacher_model: str = ""
    """distill=kl: a frozen model folder whose cosines over every column are the teacher's scores (bi_encoder); mse:
    whose embeddings the model's are regressed onto."""
    teacher_embeddings: str = ""
    """distill=kl or mse: a .parquet/.jsonl file of a teacher's embeddings of the data's texts (as guide_embeddings),
    read as teacher_model's are, with no teacher running (pairs, wordnet; images and captions for image-text data,
    written by `python -m titan_contrastive.embed_images`)."""
    matryoshka_dims: list[int] = opt([], lambda v: all(x >= 1 for x in v), "integers >= 1")
    """Train the loss on each of these leading-dimension prefixes, renormalized (e.g. [384, 256, 128, 64]); each
    token's, for a ColBERT model."""
    matryoshka_weights: list[float] = opt([], lambda v: all(x > 0 for x in v), "numbers > 0")
    """One weight per matryoshka_dims entry; empty = all 1."""
    adaptive_layers: list[int] = opt([], lambda v: all(x >= 0 for x in v), "integers >= 0")
    """bi_encoder: also train the embeddings of these earlier layers (each pooled as the last's, after block k of
    the tower; 0: the token embeddings), so the model can be cut to them (sentence-transformers' AdaptiveLayerLoss;
    with matryoshka_dims its Matryoshka2dLoss). E.g. [2, 4, 6] of a 12-layer model."""
    adaptive_layer_weights: list[float] = opt([], lambda v: all(x > 0 for x in v), "numbers > 0")
    """One weight per adaptive_layers entry; empty = each 1 / len(adaptive_layers) (the last layer's is 1)."""
    adaptive_layers_per_step: int = opt(0, lambda v: v >= 0, "an integer >= 0")
    """adaptive_layers: draw this many of them at each step (sentence-transformers' n_layers_per_step, its default
    1), each weighted len(adaptive_layers) / this; 0 = every one at every step."""
    adaptive_final_norm: bool = False
    """adaptive_layers on a decoder: each earlier layer's hidden states through the model's final norm, as its last
    layer's are (LayerSkip's early exit), so the model cut to that layer (`export --layers`) embeds exactly as
    trained; false = sentence-transformers' AdaptiveLayerLoss (the raw hidden states)."""
    adaptive_kl_weight: float = opt(1.0, lambda v: v >= 0, "a number >= 0")
    """adaptive_layers: the weight of the KL divergence of each earlier layer's embedding softmax from the last's."""
    adaptive_kl_temperature: float = opt(0.3, lambda v: v >= 0, "a number >= 0")
    """adaptive_layers: the softmax temperature of that KL term; 0 = no KL term."""
    negatives: Literal["microbatch", "global"] = "microbatch"
    """Which samples form one contrastive problem. `microbatch`: the current microbatches of all DP
    ranks; `global`: the whole global batch, exactly, at O(N d) memory (the streamed step)."""
    stream_chunk_size: int = positive(1024)
    """negatives=global, PyTorch path: logit rows per block; extra memory ~ 2 x stream_chunk_size x N floats."""
    kernel: Literal["auto", "pytorch", "triton", "triton_exact"] = "auto"
    """negatives=global: `pytorch` streamed blocks (the reference); `triton` fused kernels (TF32 dots for
    float32), `triton_exact` IEEE dots; `auto`: on CUDA the fused kernels after a self-check, else pytorch."""
    init_logit_scale: float | None = None
    """t' at the start, t = exp(t'); empty = the loss's own: log(1/0.07) clip, log(10) siglip (every family),
    log(20) bi_encoder. A learned t' is clamped to [0, log 100] after every step, so it must start there; a
    fixed one (learn_logit_scale = false) is never clamped, any value in [-log 1e4, log 1e4]."""
    init_logit_bias: float | None = None
    """siglip: the bias b at the start; empty = -10 (SigLIP's init)."""
    learn_logit_scale: bool = True
    """Train t' (true) or keep it fixed at its initial value (false)."""
    learn_logit_bias: bool = True
    """siglip: train b (true) or keep it fixed at its initial value (false)."""
