"""GradCache: cached-gradient contrastive training with chunked forwards (seeds 000 and 002).

`GradCache` (the algorithm), `cached` (its functional form), `RandContext` (RNG replay, shared
with the streaming CLIP step), input splitting and representation extraction (`inputs`), and the
VLM-aware split and retrieval-batch unpacking (`vlm`).
"""

from titan_contrastive.components.rand_context import RandContext
from titan_contrastive.grad_cache.functional import cached
from titan_contrastive.grad_cache.grad_cache import GradCache
from titan_contrastive.grad_cache.inputs import GradCacheError, get_rep, split_inputs
from titan_contrastive.grad_cache.vlm import MODES, split_vlm_inputs, unpack_batch

__all__ = ["MODES", "GradCache", "GradCacheError", "RandContext", "cached", "get_rep", "split_inputs", "split_vlm_inputs", "unpack_batch"]
