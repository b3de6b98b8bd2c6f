"""GradCache: cached-gradient contrastive training with chunked forwards (seeds 000 and 002).

`GradCache` (the algorithm), `cached` (its functional form), `engine` (the two passes over chunks
that both use and the streaming global-negatives step shares), input splitting and representation
extraction (`inputs`), token-aware chunking of text inputs (`tokens`: chunks cut to their longest
sequence, chunks packed by a token budget), and the VLM-aware split (`vlm`). RNG replay is
`titan_contrastive.components.rng.RandContext`; retrieval-batch unpacking is
`titan_contrastive.datasets.retrieval.unpack_batch`.
"""

from titan_contrastive.grad_cache.engine import float_dot, forward_backward, forward_no_grad
from titan_contrastive.grad_cache.functional import cached
from titan_contrastive.grad_cache.grad_cache import GradCache
from titan_contrastive.grad_cache.inputs import GradCacheError, get_rep, split_inputs
from titan_contrastive.grad_cache.tokens import right_trimmed, token_chunks, trim_padding
from titan_contrastive.grad_cache.vlm import split_vlm_inputs

__all__ = ["GradCache", "GradCacheError", "cached", "float_dot", "forward_backward", "forward_no_grad", "get_rep", "right_trimmed",
           "split_inputs", "split_vlm_inputs", "token_chunks", "trim_padding"]
