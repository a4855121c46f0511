#!/usr/bin/env bash
# Runs lychee_exp under torchrun on one or several nodes; lychee_exp sees torchrun's environment and trains
# in place (it does not launch ranks again). Start the same command on every node, changing NODE_RANK.
#
#   one node, 4 GPUs:   GPUS_PER_NODE=4 launch/torchrun.sh experiment=lychee_lora model.path=/models/lychee
#   two nodes x 8 GPUs: RUN_ID=exp42 NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 GPUS_PER_NODE=8 launch/torchrun.sh ...
#                       RUN_ID=exp42 NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 GPUS_PER_NODE=8 launch/torchrun.sh ...
#
# RUN_ID must be the same on every node (required with NNODES > 1; one node: derived from the time); it names the
# rendezvous and the run directory, so all ranks share one outputs/runs/<stamp> and only global rank 0 writes.
set -euo pipefail
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
GPUS_PER_NODE=${GPUS_PER_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l || echo 1)}
[ "$GPUS_PER_NODE" -ge 1 ] || GPUS_PER_NODE=1
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
if [ "$NNODES" -gt 1 ] && [ -z "${RUN_ID:-}" ]; then
  # a default derived from the date could differ between nodes started around midnight: rendezvous would hang
  echo "error: set RUN_ID (the same on every node) for a multi-node run" >&2
  exit 2
fi
RUN_ID=${RUN_ID:-lychee-$(date +%Y%m%d-%H%M%S)-${MASTER_ADDR//./-}-${MASTER_PORT}}
PYTHON=${PYTHON:-python}

export LYCHEE_RUN_STAMP=${LYCHEE_RUN_STAMP:-$(date +%Y-%m-%d)_${RUN_ID}}
exec "$PYTHON" -m torch.distributed.run \
  --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node="$GPUS_PER_NODE" \
  --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$RUN_ID" \
  --max-restarts="${MAX_RESTARTS:-0}" \
  -m lychee_exp.run parallel=ddp "$@"
