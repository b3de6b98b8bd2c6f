#!/usr/bin/env bash
# The venv that benchmarks/pylate_interop.py calls PyLate in: PyLate 1.6 pins sentence-transformers 5.3.0 and
# transformers <= 5.3.0, which cannot sit beside the repo's, and fast-plaid, which pins another torch. So this venv
# holds the repo's torch, PyLate's two pins and PyLate itself without its index dependencies (fast-plaid,
# fastkmeans: retrieval indexes, which the interop check does not touch). A few minutes, from the package index.
#
#     bash benchmarks/pylate_venv.sh [VENV]          # default /tmp/pylate_venv (or $PYLATE_VENV)
#     .venv/bin/python -m benchmarks.pylate_interop --pylate-python VENV/bin/python   # from the repository root
set -euo pipefail

VENV=${1:-${PYLATE_VENV:-/tmp/pylate_venv}}
PYTHON=${PYTHON:-python3}
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)
"${PIP[@]}" torch==2.13.0 sentence-transformers==5.3.0 transformers==5.3.0 ujson pandas datasets safetensors
"${PIP[@]}" --no-deps pylate==1.6.0
"$VENV/bin/python" -c "import pylate.models, pylate.losses; print('pylate', pylate.__version__)"
