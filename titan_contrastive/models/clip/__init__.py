"""The CLIP model family; importing this package registers it under the name "clip"."""

from titan_contrastive.models.clip.args import CLIPArgs, clip_flavors
from titan_contrastive.models.clip.model import CLIP, clip_blocks
from titan_contrastive.models.registry import ModelSpec, register_model

__all__ = ["CLIP", "CLIPArgs", "clip_blocks", "clip_flavors"]


def _read_checkpoint(path: str) -> tuple[CLIPArgs, dict]:
    from titan_contrastive.interop import read_checkpoint  # interop imports this package: import when used

    return read_checkpoint(path)


register_model(
    ModelSpec(
        name="clip",
        flavors=clip_flavors,
        build_model=CLIP,
        blocks=clip_blocks,
        learns_bias=True,
        read_checkpoint=_read_checkpoint,
        towers={"image": "visual.", "text": "text."},
    )
)
