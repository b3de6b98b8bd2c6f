#!/usr/bin/env bash
# Launch training with torchrun, torchtitan style.
#   NGPU        processes per node (default: visible GPUs, else 1; on CPU each is a gloo process)
#   CONFIG_FILE TOML config (default: train_configs/debug.toml)
#   LOG_RANK    ranks whose output is shown (default: 0; e.g. 0,1)
#   extra arguments are passed to the trainer, e.g. --training.steps=50
set -euo pipefail

if [ -z "${NGPU:-}" ]; then
    NGPU=$( (command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -c '^GPU') || true)
    [ "${NGPU:-0}" -ge 1 ] 2>/dev/null || NGPU=1
fi
CONFIG_FILE=${CONFIG_FILE:-"$(dirname "$0")/train_configs/debug.toml"}
LOG_RANK=${LOG_RANK:-0}
PYTHON=${PYTHON:-python}

exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m titan_contrastive.train --job.config_file "$CONFIG_FILE" "$@"
