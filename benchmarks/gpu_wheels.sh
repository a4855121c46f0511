#!/usr/bin/env bash
# Run HERE (a machine with the package registry), before the device call: puts into .whl/ the wheels that
# lychee_exp and the GPU check need and that the GPU machine's image lacks (its image has torch, transformers,
# peft, accelerate, tokenizers, numpy, scipy, pyyaml, tqdm, psutil, matplotlib; it has no network). gpu_check.sh
# installs whatever .whl/ holds into /tmp/lychee_site first. Versions: the ones this repository was tested with.
#   bash benchmarks/gpu_wheels.sh     # .whl/ is git-ignored: the device call names it in `carry`
set -euo pipefail
cd "$(dirname "$0")/.."
pip=${PIP:-.venv/bin/pip}
mkdir -p .whl
platform=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# pure Python, wheels on the registry
"$pip" download -q --no-deps "${platform[@]}" -d .whl hydra-core==1.3.8 omegaconf==2.3.1 bm25s==0.3.16 \
  optuna==5.0.0 alembic==1.20.1 colorlog==6.12.0 Mako==1.4.3 cmaes==0.13.1 liger-kernel==0.8.5
# compiled: the GPU machine's CPython 3.12 on x86-64
"$pip" download -q --no-deps "${platform[@]}" -d .whl SQLAlchemy==2.1.9 greenlet PyStemmer==3.1.0
# omegaconf's parser runtime is an sdist only: built into a pure-Python wheel here
"$pip" wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
du -sh .whl && ls .whl
