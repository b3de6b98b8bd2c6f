"""titan_contrastive: exact large-batch contrastive training, torchtitan style."""

import re

import torch

__version__ = "0.1.0"
MIN_TORCH = (2, 9)  # DCP's DefaultStager (background checkpoints); pyproject.toml says the same

if tuple(int(n) for n in re.match(r"(\d+)\.(\d+)", torch.__version__).groups()) < MIN_TORCH:
    raise ImportError(
        f"titan_contrastive needs torch >= {'.'.join(map(str, MIN_TORCH))}, this is torch {torch.__version__}: "
        "install a newer torch built for your CUDA (README.md: GPU users) and run again"
    )
