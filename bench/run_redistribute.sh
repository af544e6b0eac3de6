#!/usr/bin/env bash
# Run bench/redistribute.py on 2 and then 4 gloo ranks (CPU), one thread per rank.
# Usage: bench/run_redistribute.sh [--quick]    (extra arguments go to redistribute.py)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
for ranks in 2 4; do
    torchrun --standalone --nproc-per-node "$ranks" bench/redistribute.py "$@" 2> >(grep -v -e '^W[0-9]' -e '^\*\*\*' -e 'OMP_NUM_THREADS' >&2)
done
