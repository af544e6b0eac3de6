#!/usr/bin/env bash
# The training-step benchmark: 4 gloo ranks (fd vs torch DTensor), then the simulated mesh
# (fd vs one device). Usage: bench/run_train_step.sh [--quick]  (arguments go to both parts)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
torchrun --standalone --nproc-per-node 4 bench/train_step.py "$@" \
    2> >(grep -v -e '^W[0-9]' -e '^\[rank[0-9]*\]:W[0-9]' -e '^\*\*\*' -e 'OMP_NUM_THREADS' >&2)
python bench/train_step.py "$@"
