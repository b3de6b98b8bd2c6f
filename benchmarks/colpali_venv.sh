#!/usr/bin/env bash
# The venv that benchmarks/colpali_interop.py calls colpali-engine in: colpali-engine 0.3 pins peft < 0.21, below the
# repo's, and imports torchvision (through transformers' image processors), which does not import beside torch
# 2.13.0. So this venv holds torch 2.14.1 and torchvision 0.29.1 (both on local disk, as benchmarks/peers_venv.sh),
# the repo's transformers, peft 0.20 and colpali-engine without its other dependencies (its torch < 2.14 pin is
# metadata: its ColQwen models run on 2.14). A few minutes, from the package index.
#
#     bash benchmarks/colpali_venv.sh [VENV]          # default /tmp/colpali_venv (or $COLPALI_VENV)
#     .venv/bin/python -m benchmarks.colpali_interop --colpali-python VENV/bin/python   # from the repository root
set -euo pipefail

VENV=${1:-${COLPALI_VENV:-/tmp/colpali_venv}}
PYTHON=${PYTHON:-python3}
PINS=(torch==2.14.1 torchvision==0.29.1 transformers==5.24.0 "peft>=0.20,<0.21")
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)
"${PIP[@]}" "${PINS[@]}" numpy pillow scipy requests safetensors
"${PIP[@]}" --no-deps colpali-engine==0.3.18
"$VENV/bin/python" -c "from colpali_engine.models import ColQwen2; from colpali_engine.loss import ColbertLoss; print('colpali-engine ok')"
