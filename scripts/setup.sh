#!/usr/bin/env bash
# Create a venv (.venv, or $VENV) with a CPU build of torch and titan_contrastive (editable, with test extras).
#   VENV              the venv's folder (default .venv)
#   PIP_CONSTRAINT    pip's own: a constraints file, e.g. scripts/floors.txt (every dependency at its floor)
#   EXTRAS            the extras installed (default dev,data,hf,wandb; EXTRAS=dev: the suite without the optional ones)
#   TORCH_SPEC        torch requirement (default torch==2.13.0)
#   TORCH_INDEX_URL   extra index for torch, e.g. https://download.pytorch.org/whl/cpu on a CPU-only
#                     machine whose pip would otherwise pull the multi-GB CUDA build from PyPI.
# GPU users: create the venv, install the torch build for their CUDA, then `pip install -e '.[dev,data,hf,wandb]'`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if ! "$VENV"/bin/python -c "import torch" 2>/dev/null; then
    "$VENV"/bin/pip install -q ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
fi
"$VENV"/bin/pip install -q -e ".[${EXTRAS:-dev,data,hf,wandb}]"
# Triton runs the fused-kernel tests on CPU (TRITON_INTERPRET=1) and compiles them for sm_90 (the SASS tests),
# pinned: its interpreter and compiler decide what those tests see; CUDA torch builds bring their own.
"$VENV"/bin/python -c "import triton" 2>/dev/null || "$VENV"/bin/pip install -q triton==3.9.0
# open_clip's SigLipLoss is the reference of tests/test_siglip.py, which loads only its loss.py (torch
# alone); --no-deps: the package's torchvision would pull another torch and does not import on CPU here.
"$VENV"/bin/pip install -q --no-deps open-clip-torch==3.3.0
"$VENV"/bin/python -c "import torch, titan_contrastive; print(f'titan_contrastive {titan_contrastive.__version__}, torch {torch.__version__}, cuda {torch.cuda.is_available()}')"
