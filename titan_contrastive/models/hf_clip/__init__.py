"""The hf_clip family (a Hugging Face CLIP or SigLIP folder as an image-text dual encoder); importing this
package registers it. transformers is imported only when a model or tokenizer is built (`.[hf]`)."""

from titan_contrastive.datasets.layouts import FOLDER_IMAGES
from titan_contrastive.models.hf_clip.export import ADAPTER
from titan_contrastive.models.hf_clip.guide import read_guide
from titan_contrastive.models.hf_clip.model import HFClip, HFClipArgs, build_tokenizer, hf_clip_blocks, hf_clip_flavors
from titan_contrastive.models.registry import ModelSpec, register_model

__all__ = ["HFClip", "HFClipArgs", "hf_clip_blocks", "hf_clip_flavors"]

register_model(
    ModelSpec(
        name="hf_clip",
        flavors=hf_clip_flavors,
        build_model=HFClip,
        blocks=hf_clip_blocks,
        learns_bias=True,
        build_tokenizer=build_tokenizer,
        layout=FOLDER_IMAGES,
        towers={"image": "visual.", "text": "text."},
        state_dict_adapter=ADAPTER,
        read_guide=read_guide,
        guide_temperature=True,
    )
)
