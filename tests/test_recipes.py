"""The launch recipes (examples/bert_*.sh, examples/bert_sbatch.sh) run with DRY_RUN=1, as a user would
before a real launch: each prints its torchrun line and the planner's report for the same flags, with no
GPU and no data. Checked: the torchrun line (launcher settings from the environment and from SLURM, the
guide's training flags, a flag set the trainer parses and accepts), the report (the layout, the exact
parameter count), the refusals (a _text_document prefix, missing arguments), and the guide's shipped
340M flags refused by the planner with its two reasons."""
import os
import re
import shlex
import subprocess
import sys

import pytest

from minibert.config import parse_args
from minibert.tools import plan_memory as pm
from minibert.validate import validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = "minibert/vocab/bert-base-uncased-vocab.txt"
ARGS = ["runs/ckpt", "runs/tb", VOCAB, "runs/data/corpus_text_sentence"]  # fake paths: nothing is read but the vocab
LAUNCH_ENV = ("GPUS_PER_NODE", "NNODES", "NUM_NODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK",
              "LOCAL_RANK", "DRY_RUN", "PYTHON", "TORCHRUN")
# the guide's training, data and logging flags, as each recipe must pass them (bf16 replaces its fp16)
GUIDE_FLAGS = ["--train-iters 1000000", "--weight-decay 1e-2", "--clip-grad 1.0", "--bf16", "--lr 1e-4",
               "--lr-decay-iters 990000", "--lr-decay-style linear", "--min-lr 1e-5", "--lr-warmup-fraction .01",
               "--split 949,50,1", "--log-interval 100", "--save-interval 10000", "--eval-interval 1000",
               "--eval-iters 10", "--save runs/ckpt", "--load runs/ckpt", "--tensorboard-dir runs/tb",
               f"--vocab-file {VOCAB}", "--data-path runs/data/corpus_text_sentence"]
RECIPES = {  # recipe: (preset, TP, PP, micro, global, nodes by default)
    "bert_340m.sh": ("340m", 1, 1, 4, 32, 1),
    "bert_4b.sh": ("4b", 1, 1, 4, 32, 1),
    "bert_20b.sh": ("20b", 4, 4, 2, 128, 2),
}


@pytest.fixture(scope="module")
def shims(tmp_path_factory):
    """`python` is this interpreter; `torchrun` would be its torch.distributed.run (never run here)."""
    folder = tmp_path_factory.mktemp("bin")
    (folder / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (folder / "python").chmod(0o755)
    return folder


def run_recipe(shims, script, args=ARGS, cwd=ROOT, bin_folder=None, **env):
    """DRY_RUN=1 bash examples/SCRIPT ARGS, in a launch-free environment plus `env`; `bin_folder` goes
    first on PATH (stand-ins for scontrol, srun)."""
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV and not k.startswith("SLURM_")}
    path = os.pathsep.join(str(p) for p in (bin_folder, shims, clean["PATH"]) if p)
    clean.update(PATH=path, DRY_RUN="1", **env)
    return subprocess.run(["bash", os.path.join(ROOT, "examples", script), *args], capture_output=True, text=True,
                          cwd=cwd, env=clean, timeout=300)


def torchrun_lines(stdout):
    return [line for line in stdout.splitlines() if line.startswith("torchrun ")]


def trainer_flags(line):
    words = shlex.split(line)
    return words[words.index(next(w for w in words if w.endswith("minibert/train.py"))) + 1:]


@pytest.mark.parametrize("script", sorted(RECIPES))
def test_each_recipe_prints_its_launch_and_the_plan(shims, script):
    preset, tp, pp, micro, global_batch, nodes = RECIPES[script]
    result = run_recipe(shims, script)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = torchrun_lines(result.stdout)
    assert line.startswith(f"torchrun --nproc_per_node 8 --nnodes {nodes} --node_rank 0 --master_addr localhost "
                           "--master_port 29500 minibert/train.py ")
    for flag in GUIDE_FLAGS + [f"--preset {preset}", f"--micro-batch-size {micro}",
                               f"--global-batch-size {global_batch}", f"--tensor-model-parallel-size {tp}",
                               f"--pipeline-model-parallel-size {pp}"]:
        assert f" {flag} " in line + " ", (flag, line)
    world = 8 * nodes
    cfg = validate(parse_args(trainer_flags(line)), world_size=world, device_type="cuda", warn=None)
    assert f"total parameters: {pm.total_parameters(cfg)} " in result.stdout
    assert f"TP {tp} x PP {pp} x DP {world // (tp * pp)}" in result.stdout
    assert "this run:" in result.stdout and "fits" in result.stdout and "= step" in result.stdout


def test_the_launcher_reads_its_place_from_the_environment(shims):
    result = run_recipe(shims, "bert_340m.sh", GPUS_PER_NODE="4", NNODES="2", NODE_RANK="1", MASTER_ADDR="10.0.0.7",
                        MASTER_PORT="6001")
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = torchrun_lines(result.stdout)
    assert line.startswith("torchrun --nproc_per_node 4 --nnodes 2 --node_rank 1 --master_addr 10.0.0.7 "
                           "--master_port 6001 ")
    assert "layout: 8 GPUs = 2 nodes x 4 GPUs = TP 1 x PP 1 x DP 8" in result.stdout


def test_under_slurm_node_0_is_the_first_host(shims, tmp_path):
    slurm = dict(SLURM_NNODES="2", SLURM_NODEID="1", SLURM_JOB_NODELIST="gpu[07-08,11],login3")
    (line,) = torchrun_lines(run_recipe(shims, "bert_20b.sh", **slurm).stdout)  # no scontrol here: parsed
    assert " --nnodes 2 --node_rank 1 --master_addr gpu07 " in line
    scontrol = tmp_path / "scontrol"  # with scontrol, its answer wins
    scontrol.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu[07-08,11],login3" ] && printf "a7\\na8\\n"\n')
    scontrol.chmod(0o755)
    result = run_recipe(shims, "bert_20b.sh", bin_folder=tmp_path, **slurm)
    (line,) = torchrun_lines(result.stdout)
    assert " --master_addr a7 " in line


def test_the_sbatch_example_runs_the_recipe_once_per_node(shims, tmp_path):
    srun = tmp_path / "srun"  # a stand-in for srun: one task per node, SLURM_NODEID set for each
    srun.write_text('#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\n'
                    'for ((n = 0; n < SLURM_NNODES; n++)); do SLURM_NODEID=$n "$@" || exit $?; done\n')
    srun.chmod(0o755)
    result = run_recipe(shims, "bert_sbatch.sh", bin_folder=tmp_path, SLURM_NNODES="2",
                        SLURM_JOB_NODELIST="node[1-2]", SLURM_SUBMIT_DIR=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = torchrun_lines(result.stdout)
    assert [re.search(r"--node_rank (\d)", line)[1] for line in lines] == ["0", "1"]
    assert all(" --nnodes 2 " in line and " --master_addr node1 " in line and "--preset 20b" in line
               for line in lines)
    text = open(os.path.join(ROOT, "examples", "bert_sbatch.sh")).read()
    assert "#SBATCH --ntasks-per-node=1" in text and "srun" in text


def test_from_another_folder_the_trainer_path_is_absolute(shims, tmp_path):
    args = [str(tmp_path / "ckpt"), str(tmp_path / "tb"), os.path.join(ROOT, VOCAB), str(tmp_path / "c_text_sentence")]
    result = run_recipe(shims, "bert_4b.sh", args, cwd=tmp_path, GPUS_PER_NODE="1")
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = torchrun_lines(result.stdout)
    assert f" {os.path.join(ROOT, 'minibert', 'train.py')} " in line and "TP 1 x PP 1 x DP 1" in result.stdout


@pytest.mark.parametrize("args, message", [
    (ARGS[:3] + ["runs/data/corpus_text_document"], "_text_document prefix"),
    (ARGS[:3] + ["runs/data/corpus_text_sentence.bin"], "without .bin or .idx"),
    (ARGS[:3], "usage: bash"),
])
def test_a_recipe_refuses_bad_arguments_in_one_line(shims, args, message):
    result = run_recipe(shims, "bert_340m.sh", args)
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().split("\n")) == 1 and message in result.stderr, result.stderr


def test_a_layout_the_node_count_does_not_fit_is_refused_by_the_planner(shims):
    result = run_recipe(shims, "bert_20b.sh", NNODES="1")  # 8 GPUs for TP 4 x PP 4
    assert result.returncode == 2 and "TP 4 x PP 4 needs 16 GPUs" in result.stderr
    assert len(torchrun_lines(result.stdout)) == 1  # the line is printed first, then the planner refuses


def test_the_guides_340m_script_is_refused_by_the_planner():
    guide = ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 512 "
             "--max-position-embeddings 512 --attention-backend auto --micro-batch-size 4 --global-batch-size 32 "
             "--train-iters 1000000 --weight-decay 1e-2 --clip-grad 1.0 --fp16 --lr 0.0001 --lr-decay-iters 990000 "
             "--lr-decay-style linear --min-lr 1.0e-5 --lr-warmup-fraction .01 --tensor-model-parallel-size 8 "
             "--pipeline-model-parallel-size 16 "
             f"--data-path data/my-bert_text_document --vocab-file {VOCAB} --split 949,50,1 --log-interval 100 "
             "--save-interval 10000 --eval-interval 1000 --save ckpt --load ckpt --eval-iters 10 --tensorboard-dir tb")
    result = subprocess.run([sys.executable, "-m", "minibert.tools.plan", *guide.split(), "--nnodes", "1",
                             "--nproc-per-node", "8"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "error: TP 8 x PP 16 needs 128 GPUs for one copy of the model, but the run has 8: launch a multiple of 128 "
        "GPUs (--nnodes x --nproc-per-node), or lower --tensor-model-parallel-size / --pipeline-model-parallel-size",
        "error: --num-layers 24 cannot be split evenly over --pipeline-model-parallel-size 16 stages: use a PP that "
        "divides 24 (1, 2, 3, 4, 6, 8, 12, 24), or give the first/last stage its own count "
        "(--decoder-first/last-pipeline-num-layers)"]
