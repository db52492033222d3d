#!/bin/bash
# SLURM: run a recipe once per node; each copy starts that node's GPUs with torchrun.
#
#   sbatch examples/bert_sbatch.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE DATA_PATH
#   RECIPE=examples/bert_340m.sh sbatch --nodes=1 examples/bert_sbatch.sh ...
#   DRY_RUN=1 sbatch ...          # every node prints its torchrun line and the planner's report
#
# Submit from the repository root (relative paths are read from there). srun starts one task per node;
# the recipe finds its place from SLURM's variables (examples/launch.sh): SLURM_NNODES nodes, this one
# SLURM_NODEID, node 0 = the first host of SLURM_JOB_NODELIST (via scontrol), 8 GPUs per node.
# In a container (pyxis/enroot): add --container-image=<the image built from Dockerfile> and
# --container-mounts=<data folder> to the srun line.
#SBATCH --job-name=minibert-bert
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"   # sbatch runs a copy of this script from its spool folder
RECIPE=${RECIPE:-examples/bert_20b.sh}
srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash "$RECIPE" "$@"
