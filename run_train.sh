#!/usr/bin/env bash
# Launch training with torchrun, torchtitan style.
#   NGPU          processes per node (default: visible GPUs, else 1; on CPU each is a gloo process)
#   CONFIG_FILE   TOML config (default: train_configs/debug.toml next to this script)
#   LOG_RANK      ranks whose output is shown (default: 0; e.g. 0,1)
#   PYTHON        interpreter (default: python)
# Multi-node (same command on every node; nothing else assumes a single node):
#   NNODES        number of nodes (default 1: torchrun --standalone)
#   NODE_RANK     this node's rank 0..NNODES-1 (optional with c10d rendezvous; e.g. $SLURM_NODEID)
#   RDZV_ENDPOINT host:port of the rendezvous (default $MASTER_ADDR:${MASTER_PORT:-29500})
#   RDZV_ID       job id shared by all nodes (default titan_contrastive; e.g. $SLURM_JOB_ID)
# Extra arguments go to the trainer, e.g. --training.steps=50
set -euo pipefail

if [ -z "${NGPU:-}" ]; then
    NGPU=$( (command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -c '^GPU') || true)
    [ "${NGPU:-0}" -ge 1 ] 2>/dev/null || NGPU=1
fi
CONFIG_FILE=${CONFIG_FILE:-"$(dirname "$0")/train_configs/debug.toml"}
LOG_RANK=${LOG_RANK:-0}
PYTHON=${PYTHON:-python}
NNODES=${NNODES:-1}

if [ "$NNODES" -gt 1 ]; then
    endpoint=${RDZV_ENDPOINT:-${MASTER_ADDR:?set RDZV_ENDPOINT=host:port (or MASTER_ADDR) for a multi-node launch}:${MASTER_PORT:-29500}}
    launch=(--nnodes="$NNODES" --rdzv_backend=c10d --rdzv_endpoint="$endpoint" --rdzv_id="${RDZV_ID:-titan_contrastive}")
    [ -n "${NODE_RANK:-}" ] && launch+=(--node_rank="$NODE_RANK")
else
    launch=(--standalone)
fi

exec "$PYTHON" -m torch.distributed.run "${launch[@]}" --nproc_per_node="$NGPU" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m titan_contrastive.train --job.config_file "$CONFIG_FILE" "$@"
