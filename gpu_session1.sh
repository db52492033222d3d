#!/bin/bash
# GPU session 1: correctness on CUDA, then throughput (one call).
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")"
{
date -u; nvidia-smi -L; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
echo "== make test-gpu"; time timeout 240 make test-gpu PYTEST_ARGS="-x -q -rA" 2>&1 | tail -25
echo "== train-small bf16"; time timeout 120 make train-small TRAIN_SMALL_ARGS="--bf16" 2>&1 | grep -E "^iteration|memory|validation loss at iteration 200" | tail -6
echo "== bench sections 1,2,4"; time timeout 330 python3 bench/train_bench.py --quick --sections 1,2,4 --work-dir /tmp/tb --output $OUT/train-quick.md 2>&1 | tail -45
} 2>&1 | tee $OUT/session1.log
