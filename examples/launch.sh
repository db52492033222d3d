# What every recipe (examples/bert_*.sh) shares: its four arguments, where the node sits in the job, the
# data/logging flags of Megatron's BERT example, and the launch itself. Sourced, not run: a recipe sets
# MODEL_ARGS, PARALLEL_ARGS and TRAINING_ARGS (bash arrays) and then calls `launch "$@"`.
#
#   bash examples/bert_340m.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE DATA_PATH
#
# DATA_PATH is the prefix that `minibert/preprocess.py --split-sentences` writes: it ends in
# _text_sentence (the .bin/.idx pair beside it). Megatron's guide says _text_document, the prefix of a
# run *without* --split-sentences, whose one-"sentence" documents cannot make sentence-order samples.
#
# Where this node sits (each read from the environment, first match wins):
#   GPUS_PER_NODE  processes on this node        GPUS_PER_NODE, SLURM_GPUS_ON_NODE, else 8
#   NNODES         nodes in the job              NNODES, NUM_NODES (the guide's name), SLURM_NNODES, else the
#                                                recipe's DEFAULT_NNODES (1, or 2 for the 20B)
#   NODE_RANK      this node's index             NODE_RANK, SLURM_NODEID, else 0
#   MASTER_ADDR    node 0's address              MASTER_ADDR, the first host of SLURM_JOB_NODELIST, else localhost
#   MASTER_PORT    a free port on node 0         MASTER_PORT, else 29500
# DRY_RUN=1 prints the torchrun command instead of running it, then runs the planner
# (python -m minibert.tools.plan) with the same flags for the same number of GPUs: no GPU and no data needed.
# PYTHON / TORCHRUN name the interpreter and launcher (default: python, or python3; torchrun).
#
# Not exported, unlike Megatron's script: CUDA_DEVICE_MAX_CONNECTIONS=1. Megatron needs it to order its
# overlapped tensor-parallel communication before the compute that waits for it; minibert overlaps none.

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

die() {
    echo "error: $*" >&2
    exit 2
}

# "gpu[07-09,12],login1" -> gpu07: the first host of a SLURM node list, without scontrol.
first_host() {
    local list=$1
    local prefix=${list%%[\[,]*}            # everything before the first '[' or ','
    if [[ ${list:${#prefix}:1} == "[" ]]; then
        local inside=${list:$((${#prefix} + 1))}
        echo "${prefix}${inside%%[-,\]]*}"  # the prefix and the first number of the bracket
    else
        echo "$prefix"
    fi
}

# A command as one line a shell can paste back: each argument quoted only where it needs it.
show() {
    local words=() word
    for word in "$@"; do
        if [[ $word =~ ^[A-Za-z0-9_./=:,@%+-]+$ ]]; then words+=("$word"); else words+=("$(printf '%q' "$word")"); fi
    done
    echo "${words[*]}"
}

master_addr() {
    if [[ -n ${MASTER_ADDR:-} ]]; then
        echo "$MASTER_ADDR"
    elif [[ -n ${SLURM_JOB_NODELIST:-} ]]; then
        if command -v scontrol > /dev/null; then
            scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1
        else
            first_host "$SLURM_JOB_NODELIST"
        fi
    else
        echo localhost
    fi
}

launch() {
    [[ $# -eq 4 ]] || die "usage: bash $0 CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE DATA_PATH (got $# arguments)"
    local checkpoint_path=$1 tensorboard_logs_path=$2 vocab_file=$3 data_path=$4
    case $data_path in
        *_text_document) die "DATA_PATH $data_path is a _text_document prefix: BERT's sentence-order samples" \
                             "need sentence-split documents; preprocess with --split-sentences and pass its" \
                             "_text_sentence prefix" ;;
        *.bin | *.idx) die "DATA_PATH $data_path: pass the prefix, without .bin or .idx" ;;
    esac
    local gpus_per_node=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
    local nnodes=${NNODES:-${NUM_NODES:-${SLURM_NNODES:-${DEFAULT_NNODES:-1}}}}
    local node_rank=${NODE_RANK:-${SLURM_NODEID:-0}}
    local python=${PYTHON:-$(command -v python > /dev/null && echo python || echo python3)}

    local DISTRIBUTED_ARGS=(--nproc_per_node "$gpus_per_node" --nnodes "$nnodes" --node_rank "$node_rank"
                            --master_addr "$(master_addr)" --master_port "${MASTER_PORT:-29500}")
    local DATA_ARGS=(--data-path "$data_path" --vocab-file "$vocab_file" --split 949,50,1)
    local EVAL_AND_LOGGING_ARGS=(--log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10
                                 --save "$checkpoint_path" --load "$checkpoint_path"
                                 --tensorboard-dir "$tensorboard_logs_path")
    local FLAGS=("${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}"
                 "${EVAL_AND_LOGGING_ARGS[@]}")
    # from the repository root the command reads minibert/train.py; from elsewhere, its full path
    local train=minibert/train.py
    [[ $ROOT == "$PWD" ]] || train=$ROOT/minibert/train.py
    local COMMAND=("${TORCHRUN:-torchrun}" "${DISTRIBUTED_ARGS[@]}" "$train" "${FLAGS[@]}")

    if [[ ${DRY_RUN:-0} == 1 ]]; then
        echo "DRY_RUN=1: the launch command on node $node_rank (not run):"
        show "${COMMAND[@]}"
        echo "the planner's report for the same flags (--nnodes $nnodes --nproc-per-node $gpus_per_node):"
        PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$python" -m minibert.tools.plan "${FLAGS[@]}" \
            --nnodes "$nnodes" --nproc-per-node "$gpus_per_node"
        return
    fi
    exec "${COMMAND[@]}"
}
