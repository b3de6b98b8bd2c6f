#!/usr/bin/env bash
# Launch training with torchrun, torchtitan style, through titan_contrastive/launch.py: torchrun
# without its ChildFailedError traceback, exiting with the failed rank's own code.
#   NGPU          processes per node, a positive integer (default: visible GPUs, else 1; on CPU each is a gloo process)
#   CONFIG_FILE   TOML config (default: train_configs/debug.toml next to this script)
#   LOG_RANK      local ranks whose output is shown (default: 0; e.g. 0,1)
#   PYTHON        interpreter (default: python)
#   TORCH_ELASTIC_SHUTDOWN_TIMEOUT  seconds the other ranks get after one fails, from SIGTERM to
#                 SIGKILL (default here 5, torchrun's is 30: a hung or stopped rank ignores SIGTERM)
#   TITAN_PREEMPT_GRACE_SECONDS  when this script gets SIGTERM (scancel, Kubernetes) or SIGUSR1 (sbatch
#                 --signal=USR1@120), every rank finishes its step and saves a checkpoint; the seconds
#                 it waits for them before SIGKILL (default 120; a step and a save must fit in it and in the cluster's own grace)
# Multi-node (same command on every node; nothing else assumes a single node):
#   NNODES        number of nodes, a positive integer (default 1: torchrun --standalone)
#   NODE_RANK     this node's rank 0..NNODES-1 (optional with c10d rendezvous; e.g. $SLURM_NODEID)
#   RDZV_ENDPOINT host:port of the rendezvous (default $MASTER_ADDR:${MASTER_PORT:-29500})
#   RDZV_ID       job id shared by all nodes (default titan_contrastive; e.g. $SLURM_JOB_ID)
# Extra arguments go to the trainer, e.g. --training.steps=50
# Exit codes (the first rank to fail; one list: EXIT_CODES in titan_contrastive/exit_codes.py):
#   0 success   1 unexpected error (a bug; traceback shown)   2 bad config, data or checkpoint
#   3 non-finite loss or gradient norm   4 a collective timed out or a peer rank failed
#   5 stopped by SIGTERM/SIGUSR1 after a step, checkpoint saved (if enabled): rerun the same command to resume
#   128+N a rank was killed by signal N (137: SIGKILL, often the out-of-memory killer)
set -euo pipefail

positive_int() {  # name, value, what it counts, example
    [[ $2 =~ ^[0-9]*[1-9][0-9]*$ ]] || { echo "run_train.sh: $1=$2: must be a positive integer ($3), e.g. $1=$4" >&2; exit 2; }
}

if [ -z "${NGPU:-}" ]; then
    NGPU=$( (command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -c '^GPU') || true)
    [ "${NGPU:-0}" -ge 1 ] 2>/dev/null || NGPU=1
fi
CONFIG_FILE=${CONFIG_FILE:-"$(dirname "$0")/train_configs/debug.toml"}
LOG_RANK=${LOG_RANK:-0}
PYTHON=${PYTHON:-python}
NNODES=${NNODES:-1}
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-5}
positive_int NGPU "$NGPU" "processes per node" 2
positive_int NNODES "$NNODES" "number of nodes" 2

if [ "$NNODES" -gt 1 ]; then
    endpoint=${RDZV_ENDPOINT:-${MASTER_ADDR:?set RDZV_ENDPOINT=host:port (or MASTER_ADDR) for a multi-node launch}:${MASTER_PORT:-29500}}
    launch=(--nnodes="$NNODES" --rdzv_backend=c10d --rdzv_endpoint="$endpoint" --rdzv_id="${RDZV_ID:-titan_contrastive}")
    [ -n "${NODE_RANK:-}" ] && launch+=(--node_rank="$NODE_RANK")
else
    launch=(--standalone)
fi

exec "$PYTHON" -m titan_contrastive.launch "${launch[@]}" --nproc_per_node="$NGPU" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m titan_contrastive.train --job.config_file "$CONFIG_FILE" "$@"
