#!/usr/bin/env bash
# GPU acceptance check, one command, within a time budget (default 330 s; --ablation 450 s) on one GPU (docs/gpu_check.md):
#   bash benchmarks/gpu_check.sh [--out gpu_check.json] [--budget-s 330] [--hf-compile] [--ablation] [--tiny]
# Writes one JSON (commit, device, tokens/s, MFU, peak memory, pass/fail per check); exits 1 on any failed check
# and 2, with one line, on a machine without an NVIDIA GPU (--tiny / --dry-run: the same checks on the CPU).
# Wheels in .whl/ (gpu_wheels.sh beside this file, for a machine without network) go into /tmp/lychee_site first.
set -euo pipefail
cd "$(dirname "$0")/.."
tiny=0
for arg in "$@"; do [ "$arg" = "--tiny" ] || [ "$arg" = "--dry-run" ] && tiny=1; done
if [ "$tiny" = 0 ] && { ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; }; then
  echo "gpu_check: no NVIDIA GPU on this machine (nvidia-smi finds none); nothing to check (--tiny runs on the CPU)" >&2
  exit 2
fi
python=${PYTHON:-}
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
# (only where lychee_exp's own dependencies are missing: a set-up venv has them, and other wheels of .whl/ are cp312)
if compgen -G ".whl/*.whl" >/dev/null && ! "$python" -c "import hydra, omegaconf, optuna, bm25s, Stemmer" 2>/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/lychee_site .whl/*.whl
  export PYTHONPATH="/tmp/lychee_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
exec "$python" -m benchmarks.gpu_check "$@"
