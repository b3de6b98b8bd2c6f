"""The CLIP model family; importing this package registers it under the name "clip"."""

from titan_contrastive.models.clip.args import CLIPArgs, clip_flavors
from titan_contrastive.models.clip.model import CLIP, clip_blocks
from titan_contrastive.models.clip.state_dict_adapter import ADAPTER, load_clip, read_checkpoint, read_guide
from titan_contrastive.models.registry import ModelSpec, register_model

__all__ = ["CLIP", "CLIPArgs", "clip_blocks", "clip_flavors", "load_clip", "read_checkpoint"]

register_model(
    ModelSpec(
        name="clip",
        flavors=clip_flavors,
        build_model=CLIP,
        blocks=clip_blocks,
        learns_bias=True,
        state_dict_adapter=ADAPTER,
        read_guide=read_guide,
        guide_temperature=True,
        towers={"image": "visual.", "text": "text."},
    )
)
