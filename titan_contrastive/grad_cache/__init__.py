"""GradCache: cached-gradient contrastive training with chunked forwards (seeds 000 and 002).

`GradCache` (the algorithm), `cached` (its functional form), `engine` (the two passes over chunks
that both use and the streaming global-negatives step shares; `engine.Replay`, pass 1's outputs a
re-forward hands the model), calling a model and finding its representation (`inputs`), the RNG
replay (`rng.RandContext`, with the capture and restore of the process's generators) and the
data-parallel gradient-sync context (`sync.grad_sync`).

The rule that lets this folder stand alone: it imports torch, itself, and the batching layer
`titan_contrastive.batching` (which imports only torch), and nothing else of the project. Input
splitting, VLM-aware splitting and token-aware chunking are the batching layer's; they are
re-exported here under the names GradCache users know. The rest of the project imports the RNG
streams and the sync context from here (`grad_cache.rng`, `grad_cache.sync`), so each exists once.
Imports within the pair are relative: `grad_cache/` and `batching/` can be copied side by side
into another package and work unchanged. Unpacking a retrieval batch into query / positive /
negative sides is a data concern: `titan_contrastive.datasets.retrieval`.
"""

from ..batching import right_trimmed, split_inputs, split_vlm_inputs, token_chunks, trim_padding
from .engine import Replay, float_dot, forward_backward, forward_no_grad
from .functional import cached
from .grad_cache import GradCache
from .inputs import GradCacheError, get_rep
from .rng import RandContext
from .sync import grad_sync

__all__ = [
    "GradCache",
    "GradCacheError",
    "RandContext",
    "Replay",
    "cached",
    "float_dot",
    "forward_backward",
    "forward_no_grad",
    "get_rep",
    "grad_sync",
    "right_trimmed",
    "split_inputs",
    "split_vlm_inputs",
    "token_chunks",
    "trim_padding",
]
