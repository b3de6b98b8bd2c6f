"""The static family: sentence-transformers' StaticEmbedding (a table of token vectors, averaged) as a dual
encoder, from a StaticEmbedding or model2vec folder or started at random over a tokenizer (`[model] static_dim`).

Importing this package registers the family; sentence-transformers and transformers are imported only when a
model or tokenizer is built (`pip install -e '.[hf]'`).
"""

from titan_contrastive.models.registry import ModelSpec, folder_guide, register_model
from titan_contrastive.models.static.args import StaticArgs, static_flavors
from titan_contrastive.models.static.export import ADAPTER
from titan_contrastive.models.static.model import StaticEmbedder, build_tokenizer, static_blocks

__all__ = ["StaticArgs", "StaticEmbedder", "build_tokenizer", "static_blocks", "static_flavors"]

register_model(
    ModelSpec(
        name="static",
        flavors=static_flavors,
        build_model=StaticEmbedder,
        blocks=static_blocks,
        input_keys=("query", "doc"),
        build_tokenizer=build_tokenizer,
        towers={"query": "query_embedding.", "doc": "doc_embedding."},
        state_dict_adapter=ADAPTER,
        learns_bias=True,
        read_guide=folder_guide,
    )
)
