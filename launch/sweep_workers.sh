#!/usr/bin/env bash
# Starts K sweep workers on this machine that share one Optuna study, splitting the GPUs between them.
#   launch/sweep_workers.sh K [overrides...]
# e.g. 8 GPUs as 2 workers x 4 GPUs, the study in PostgreSQL (workers on other machines may join it):
#   launch/sweep_workers.sh 2 hparams_search=lr_batch parallel=ddp \
#       hydra.sweeper.storage=postgresql://user:password@dbhost/optuna
# Worker i gets CUDA_VISIBLE_DEVICES=<its share> and gpus=<share size>, and takes the study's next trial as
# soon as it is free (no worker waits for another's trial). Without a storage URL the workers share the sqlite
# file in the sweep directory: fine on one machine, use PostgreSQL/MySQL across machines.
# NUM_GPUS: devices to split (default: nvidia-smi -L; without GPUs, set it to split CPU ranks).
# Logs: $LOG_DIR/worker_<i>.log (default outputs/sweep_workers). Exit status: the first failing worker's.
set -euo pipefail
k=${1:?usage: launch/sweep_workers.sh K [overrides...]}
shift
python=${PYTHON:-python3}
log_dir=${LOG_DIR:-outputs/sweep_workers}
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && [ -z "${NUM_GPUS:-}" ]; then
  IFS=, read -r -a visible <<< "$CUDA_VISIBLE_DEVICES"
  num=${#visible[@]}  # nvidia-smi lists every GPU, not the visible subset
else
  num=${NUM_GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l || true)}
fi
if [ "${num:-0}" -lt "$k" ] || [ "$k" -lt 1 ]; then
  echo "error: cannot split ${num:-0} device(s) between $k worker(s) (set NUM_GPUS on a machine without GPUs)" >&2
  exit 2
fi
per=$((num / k))
# the devices to split: the ones already visible to this script, else 0..num-1
IFS=, read -r -a devices <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((num - 1)))}"
mkdir -p "$log_dir"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' INT TERM
for ((i = 0; i < k; i++)); do
  share=$(IFS=,; echo "${devices[*]:$((i * per)):$per}")
  if [ -z "$share" ]; then
    echo "error: worker $i would get no device (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset}, NUM_GPUS=$num)" >&2
    exit 2
  fi
  echo "worker $i: CUDA_VISIBLE_DEVICES=$share gpus=$per, log $log_dir/worker_$i.log"
  # LYCHEE_SWEEP_WORKER shifts the sampler's seed: workers must not draw the same params
  LYCHEE_SWEEP_WORKER=$i CUDA_VISIBLE_DEVICES=$share \
    "$python" -m lychee_exp.run -m "gpus=$per" "$@" >"$log_dir/worker_$i.log" 2>&1 &
  pids+=($!)
  sleep "${STAGGER_S:-2}"  # the first worker creates the study (and schema) before the others open it
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
done
exit "$status"
