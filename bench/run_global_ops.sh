#!/usr/bin/env bash
# Run bench/global_ops.py on the simulated mesh of 8, then on 2 and 4 gloo ranks (CPU), one
# thread per rank.
# Usage: bench/run_global_ops.sh [--quick]    (extra arguments go to global_ops.py)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
python bench/global_ops.py "$@"
for ranks in 2 4; do
    torchrun --standalone --nproc-per-node "$ranks" bench/global_ops.py "$@" 2> >(grep -v -e '^W[0-9]' -e '^\*\*\*' -e 'OMP_NUM_THREADS' >&2)
done
