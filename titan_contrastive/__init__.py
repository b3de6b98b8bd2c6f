"""titan_contrastive: exact large-batch contrastive training, torchtitan style."""

__version__ = "0.1.0"
