"""Session-wide test setup.

Without CUDA, Triton kernels run in Triton's interpreter. The switch must be set before anything
imports triton (torch.compile's inductor does, in other tests), because triton reads it once.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
