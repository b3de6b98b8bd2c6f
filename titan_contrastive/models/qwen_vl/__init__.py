"""The qwen_vl family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL embedders from a local folder); importing this
package registers it. transformers is imported only when a model or processor is built."""

from titan_contrastive.datasets.layouts import PROCESSED
from titan_contrastive.models.qwen_vl.export import ADAPTER
from titan_contrastive.models.qwen_vl.guide import read_guide
from titan_contrastive.models.qwen_vl.model import QwenVLArgs, QwenVLEmbedder, qwen_vl_blocks, qwen_vl_flavors
from titan_contrastive.models.registry import ModelSpec, register_model

__all__ = ["QwenVLArgs", "QwenVLEmbedder", "qwen_vl_blocks", "qwen_vl_flavors"]

register_model(
    ModelSpec(
        name="qwen_vl",
        flavors=qwen_vl_flavors,
        build_model=QwenVLEmbedder,
        blocks=qwen_vl_blocks,
        input_keys=(
            "query",
            "doc",
            "query_pixel_values",
            "query_image_grid_thw",
            "doc_pixel_values",
            "doc_image_grid_thw",
            "neg_pixel_values",
            "neg_image_grid_thw",
            "query_image_counts",
            "doc_image_counts",
            "neg_image_counts",
        ),
        layout=PROCESSED,
        state_dict_adapter=ADAPTER,
        learns_bias=True,
        read_guide=read_guide,
    )
)
