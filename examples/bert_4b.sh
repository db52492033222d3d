#!/bin/bash
# BERT 4B (48 layers, hidden 2560, 32 heads, seq 512: 3.87B parameters) on one GPU or pure data parallelism.
#
#   GPUS_PER_NODE=1 bash examples/bert_4b.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE DATA_PATH
#   bash examples/bert_4b.sh ...                 # one node of 8 GPUs: DP 8
#   DRY_RUN=1 bash examples/bert_4b.sh ...       # print the launch, run the planner, train nothing
#
# Layout: TP 1 x PP 1, as the guide has it. On one GPU: 18 bytes per parameter (bf16 weight, fp32 grad,
# fp32 master, Adam m and v) = 65 GiB, plus ~9 GiB of activations at micro-batch 4: it fits an H200's
# ~139 GiB with no model parallelism at all. With DP the distributed optimizer (ZeRO-1) shares the 12 bytes
# of fp32 master and moments over the replicas (about 2 + 4 + 12/8 bytes per parameter at DP 8), and the
# gradient all-reduce becomes a reduce-scatter plus an all-gather of the updated weights.
# Global batch 32 = micro 4 x DP x micro-batches: it divides for DP 1, 2, 4 and 8.
# Precision: bf16 (see bert_340m.sh). Node, launcher and SLURM settings: see examples/launch.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/launch.sh"

MODEL_ARGS=(--preset 4b --attention-backend auto)
TRAINING_ARGS=(--micro-batch-size 4 --global-batch-size 32 --train-iters 1000000 --weight-decay 1e-2 --clip-grad 1.0
               --bf16 --lr 1e-4 --lr-decay-iters 990000 --lr-decay-style linear --min-lr 1e-5 --lr-warmup-fraction .01)
PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --use-distributed-optimizer
               --overlap-grad-reduce)

launch "$@"
