"""The vlm family: an embedder whose image tower reads Qwen-VL-style packed patches
(`pixel_values` [total_patches, C·p·p] + `image_grid_thw`) at mixed resolutions, and a causal
text tower. Importing this package registers it under the name "vlm"."""

from titan_contrastive.datasets.layouts import PACKED_PATCHES
from titan_contrastive.models.registry import ModelSpec, register_model
from titan_contrastive.models.vlm.args import VLMArgs, vlm_flavors
from titan_contrastive.models.vlm.model import PackedImageTower, VLMEmbedder, vlm_blocks

__all__ = ["PackedImageTower", "VLMArgs", "VLMEmbedder", "vlm_blocks", "vlm_flavors"]

register_model(
    ModelSpec(
        name="vlm",
        flavors=vlm_flavors,
        build_model=VLMEmbedder,
        blocks=vlm_blocks,
        input_keys=("pixel_values", "image_grid_thw", "text"),
        layout=PACKED_PATCHES,
        learns_bias=True,
    )
)
