#!/usr/bin/env bash
# GPU acceptance check, one command, <= 8 minutes on one GPU (see launch/gpu_check.py for what it runs):
#   bash launch/gpu_check.sh [--out gpu_check.json] [--steps 8] [--seq-lens 512,2048]
# Writes one JSON (device, tokens/s, MFU, peak memory, pass/fail per check); exits 1 on any failed check and
# 2, with one line, on a machine without an NVIDIA GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU on this machine (nvidia-smi finds none); nothing to check" >&2
  exit 2
fi
python=${PYTHON:-}
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
exec "$python" launch/gpu_check.py "$@"
