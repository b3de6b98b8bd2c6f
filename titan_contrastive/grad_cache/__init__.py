"""GradCache: cached-gradient contrastive training with chunked forwards (seeds 000 and 002).

`GradCache` (the algorithm), `cached` (its functional form), `engine` (the two passes over chunks
that both use and the streaming global-negatives step shares), input splitting and representation
extraction (`inputs`), and the VLM-aware split (`vlm`). RNG replay is
`titan_contrastive.components.rng.RandContext`; retrieval-batch unpacking is
`titan_contrastive.datasets.retrieval.unpack_batch`.
"""

from titan_contrastive.grad_cache.engine import float_dot, forward_backward, forward_no_grad
from titan_contrastive.grad_cache.functional import cached
from titan_contrastive.grad_cache.grad_cache import GradCache
from titan_contrastive.grad_cache.inputs import GradCacheError, get_rep, split_inputs
from titan_contrastive.grad_cache.vlm import split_vlm_inputs

__all__ = ["GradCache", "GradCacheError", "cached", "float_dot", "forward_backward", "forward_no_grad", "get_rep", "split_inputs",
           "split_vlm_inputs"]
