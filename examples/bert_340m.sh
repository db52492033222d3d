#!/bin/bash
# BERT 340M (BERT-large: 24 layers, hidden 1024, 16 heads, seq 512) on one node of 8 GPUs.
#
#   bash examples/bert_340m.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE DATA_PATH
#   DRY_RUN=1 bash examples/bert_340m.sh ...     # print the launch, run the planner, train nothing
#
# Layout: TP 1 x PP 1 x DP 8 (DP = every GPU launched). The whole model with its fp32 grads and Adam
# state is ~6 GiB, its activations ~2 GiB at micro-batch 4: an H200 (~139 GiB) holds it many times over,
# so splitting it (TP, PP) would only add communication inside every layer and a pipeline bubble (the
# planner: 17.9 ms per step against 22.8 ms for TP 2 x PP 2 x DP 2). Data parallelism costs one gradient
# all-reduce per step, overlapped with the backward (--overlap-grad-reduce). The guide's TP 8 x PP 16
# needs 128 GPUs and cannot split 24 layers over 16 stages: `python -m minibert.tools.plan` refuses it.
# Precision: bf16, not the guide's fp16: the same speed on an H200, fp32's exponent range, so no loss
# scale to find (fp16 skips its first iterations while the scale comes down) and no overflow.
# Node, launcher and SLURM settings: see examples/launch.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/launch.sh"

MODEL_ARGS=(--preset 340m --attention-backend auto)
TRAINING_ARGS=(--micro-batch-size 4 --global-batch-size 32 --train-iters 1000000 --weight-decay 1e-2 --clip-grad 1.0
               --bf16 --lr 1e-4 --lr-decay-iters 990000 --lr-decay-style linear --min-lr 1e-5 --lr-warmup-fraction .01)
PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --overlap-grad-reduce)

launch "$@"
