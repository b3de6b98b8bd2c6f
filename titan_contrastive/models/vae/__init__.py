"""The vae family: a group-norm conv autoencoder (debug for CPU, sd shaped like the SD / FLUX VAE)
trained with the chunked pixel loss. Importing this package registers it under the name "vae"."""

from titan_contrastive.components.evaluate import evaluate_reconstructions
from titan_contrastive.datasets.layouts import MASKED_IMAGES
from titan_contrastive.models.registry import ModelSpec, register_model
from titan_contrastive.models.vae.args import VAEArgs, vae_flavors
from titan_contrastive.models.vae.model import AutoEncoder, Decoder, Encoder, vae_blocks
from titan_contrastive.steps.pixel import PixelStep

__all__ = ["AutoEncoder", "Decoder", "Encoder", "VAEArgs", "vae_blocks", "vae_flavors"]

register_model(
    ModelSpec(
        name="vae",
        flavors=vae_flavors,
        build_model=AutoEncoder,
        blocks=vae_blocks,
        input_keys=("image", "mask"),
        layout=MASKED_IMAGES,
        build_step=PixelStep.build,
        own_loss="pixel",
        evaluate=evaluate_reconstructions,
    )
)
