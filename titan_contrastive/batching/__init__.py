"""Cutting a batch into chunks of samples: the layer both the data side and GradCache read.

- `inputs`: the one error type (`BatchError`), the batch size every tensor of an input shares,
  consecutive chunks (`split_inputs`) and chunks of a permutation of the samples (`take_chunks`);
- `vlm`: Qwen-VL-style packed patches cut on image boundaries (`split_vlm_inputs`; per-side
  groups in batch order, `split_sides`; chunks of a permutation of the samples, `take_vlm_chunks`) and the names
  of those image fields (`IMAGE_FIELDS`);
- `negatives`: hard negatives laid out beside their positives as one document input
  (`with_negatives`, the batch key `NEGATIVES`), the documents' ids (`document_ids`, or the
  data's own under the batch key `DOC_IDS`), a teacher's scores of them (`TEACHER_SCORES`) and a frozen
  model's embeddings computed ahead (`FROZEN_QUERIES`, `FROZEN_DOCS`);
- `tokens`: right-padded token ids, each chunk cut to its longest sequence (`trim_padding`,
  `right_trimmed`) and chunks packed by a token budget (`token_chunks`), whose plan every rank
  of a process group runs alike (`max_over_ranks`).

The rule that keeps the layers apart: this package imports only torch and itself. `datasets/`
(its layouts, retrieval batches) and `grad_cache/` both import it, and neither imports the other,
so the data side never loads the training engine and `grad_cache/` can be copied into another
project together with this folder. Imports inside the package are relative for that reason.
"""

from .inputs import BatchError, batch_size, split_inputs, take_chunks
from .negatives import (
    DOC_IDS,
    FROZEN_DOCS,
    FROZEN_QUERIES,
    NEGATIVES,
    OWN_GROUP,
    TEACHER_SCORES,
    document_ids,
    with_negatives,
)
from .tokens import PaddedField, max_over_ranks, padded_fields, right_trimmed, token_chunks, trim_padding
from .vlm import IMAGE_FIELDS, interleave_images, split_sides, split_vlm_inputs, take_vlm_chunks

__all__ = [
    "DOC_IDS",
    "FROZEN_DOCS",
    "FROZEN_QUERIES",
    "IMAGE_FIELDS",
    "NEGATIVES",
    "OWN_GROUP",
    "TEACHER_SCORES",
    "BatchError",
    "PaddedField",
    "batch_size",
    "document_ids",
    "max_over_ranks",
    "padded_fields",
    "right_trimmed",
    "split_inputs",
    "interleave_images",
    "split_sides",
    "split_vlm_inputs",
    "take_chunks",
    "take_vlm_chunks",
    "token_chunks",
    "trim_padding",
    "with_negatives",
]
