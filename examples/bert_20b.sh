#!/bin/bash
# BERT 20B (48 layers, hidden 6144, 96 heads, seq 512: 22.0B parameters) on 16 GPUs per model replica.
#
#   bash examples/bert_20b.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE DATA_PATH   # on each of 2 nodes,
#                                                       with NODE_RANK=0 / 1 and MASTER_ADDR=node 0
#   NNODES=4 ...                                        # 32 GPUs: 2 replicas (DP 2)
#   sbatch --nodes=2 examples/bert_sbatch.sh ...        # SLURM: one recipe per node (examples/bert_sbatch.sh)
#   DRY_RUN=1 bash examples/bert_20b.sh ...             # print the launch, run the planner, train nothing
#
# Layout: TP 4 x PP 4 x DP, the guide's. TP 4 splits every layer's matrices over 4 GPUs of one node (its 4
# all-reduces per layer stay on NVLink: the rank grid puts TP ranks next to each other); PP 4 cuts the 48
# layers into 4 stages of 12; DP replicates that 16-GPU model. Sequence parallelism divides the LayerNorm
# and dropout activations by TP too; ZeRO-1 shares the optimizer over DP; 64 micro-batches of 2 per step
# (global 128 at DP 1) keep the 1F1B bubble at (p-1)/m = 3/64. DEFAULT_NNODES=2: the 16 GPUs of one replica.
# Precision: bf16 (see bert_340m.sh). Node, launcher and SLURM settings: see examples/launch.sh.
set -euo pipefail
DEFAULT_NNODES=2
source "$(dirname "${BASH_SOURCE[0]}")/launch.sh"

MODEL_ARGS=(--preset 20b --attention-backend auto)
TRAINING_ARGS=(--micro-batch-size 2 --global-batch-size 128 --train-iters 1000000 --weight-decay 1e-2 --clip-grad 1.0
               --bf16 --lr 1e-4 --lr-decay-iters 990000 --lr-decay-style linear --min-lr 1e-5 --lr-warmup-fraction .01)
PARALLEL_ARGS=(--tensor-model-parallel-size 4 --pipeline-model-parallel-size 4 --sequence-parallel
               --use-distributed-optimizer --overlap-grad-reduce)

launch "$@"
