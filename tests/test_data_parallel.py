"""Data parallelism through `torchrun ... minibert/train.py`, as a user runs it (gloo, one thread per
process): DP = 2 and 4, with and without ZeRO-1 and overlap (DP 2 with ZeRO-1 also with the gradient-
accumulation fusion), on one node and on two "nodes" of this machine, give the single-process run's losses, accuracies and grad norms (relative 1e-5, read from TensorBoard);
a stopped and resumed DP=2 run logs the unbroken run's lines; a ZeRO-1 checkpoint resumes at another
data-parallel size; a bad layout exits 2 on every rank before any collective."""
import os
import re
import subprocess

import pytest
import torch

from minibert.training import checkpoint
from tests import launch
from tests.conftest import layout_args

ROOT = launch.ROOT
RUNS = launch.RUNS


def dp_run(data, tmp_path_factory, name, nproc, *extra):
    return launch.layout_run(data, tmp_path_factory, name, nproc, *extra)


def optimizer_bytes(stdout) -> int:
    return int(re.search(r"optimizer state per rank \(fp32 masters and Adam moments\): (\d+) bytes", stdout)[1])


LAYOUTS = {  # name -> (processes, flags)
    "dp2": (2, []),
    "dp4": (4, []),
    "dp2-zero1": (2, ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", 3000]),
    "dp4-zero1": (4, ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", 3000]),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_data_parallel_equals_one_process(tiny_data, tmp_path_factory, layout_reference, name):
    nproc, flags = LAYOUTS[name]
    result, scalars = dp_run(tiny_data, tmp_path_factory, name, nproc, *flags)
    worst = launch.assert_close_runs(layout_reference["scalars"], scalars)
    print(f"{name}: worst relative difference {worst:.2e}")
    # the same rows were consumed, at the same learning rates, and one rank printed each line
    ours = [line.split("| lm loss")[0] for line in launch.comparable_lines(result.stdout) if line.startswith("iteration")]
    theirs = [line.split("| lm loss")[0] for line in launch.comparable_lines(layout_reference["stdout"])
              if line.startswith("iteration")]
    assert ours == theirs and len(ours) == 8
    # ZeRO-1 divides the optimizer state (fp32 run: two Adam moments, 8 bytes a parameter) by DP. The shards
    # are equal slices of buffers with alignment gaps (up to 63 elements after each parameter): in this
    # ~105k-element model with 3000-element buckets the printing rank's share is 3.8% under 1/DP at DP 4
    one = optimizer_bytes(layout_reference["stdout"])
    expected = one / nproc if "zero1" in name else one
    assert abs(optimizer_bytes(result.stdout) - expected) <= 0.05 * expected, (optimizer_bytes(result.stdout), one)


def test_two_nodes_equal_one_process(tiny_data, tmp_path, layout_reference):
    """torchrun --nnodes 2 --node_rank R on this machine: 2 x 2 processes, TP 2 inside each node and data
    parallelism (ZeRO-1) across the two nodes."""
    tb = tmp_path / "tb"
    results = launch.run_nodes(2, 2, layout_args(tiny_data, tb, "--use-distributed-optimizer",
                                                 "--tensor-model-parallel-size", 2))
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    printed = [line for r in results for line in r.stdout.splitlines() if line.startswith("iteration ")]
    assert len(printed) == 8  # one rank (the last, on node 1) prints
    worst = launch.assert_close_runs(layout_reference["scalars"], launch.tensorboard_scalars(tb))
    print(f"two nodes (TP 2 x DP 2): worst relative difference {worst:.2e}")


def test_stopped_and_resumed_dp2_logs_the_unbroken_run(tiny_data, tmp_path_factory, tmp_path):
    nproc, flags = LAYOUTS["dp2-zero1"]
    unbroken, _ = dp_run(tiny_data, tmp_path_factory, "dp2-zero1", nproc, *flags)
    save = tmp_path / "ckpt"
    first = launch.run(2, layout_args(tiny_data, tmp_path / "tb1", *flags, "--save", save, "--exit-interval", 4))
    assert first.returncode == 0, first.stderr[-3000:]
    shards = os.listdir(os.path.dirname(checkpoint.checkpoint_path(str(save), 4)))
    assert sorted(shards) == ["distrib_optim_dp000.pt", "distrib_optim_dp001.pt", "model_optim_rng.pt"]
    for name in shards:  # everything loads without running code from the file
        torch.load(os.path.join(os.path.dirname(checkpoint.checkpoint_path(str(save), 4)), name), weights_only=True)
    second = launch.run(2, layout_args(tiny_data, tmp_path / "tb2", *flags, "--save", tmp_path / "ckpt2",
                                       "--load", save))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "loaded checkpoint" in second.stdout
    assert launch.comparable_lines(first.stdout) + launch.comparable_lines(second.stdout) == \
        launch.comparable_lines(unbroken.stdout)

    # the same ZeRO-1 checkpoint (2 shards) resumed by one process without the distributed optimizer
    resharded = launch.run(1, layout_args(tiny_data, tmp_path / "tb3", "--load", save))
    assert resharded.returncode == 0, resharded.stderr[-3000:]
    resumed = launch.tensorboard_scalars(tmp_path / "tb3")
    whole = RUNS["dp2-zero1"][1]
    launch.assert_close_runs({tag: whole[tag][4:] for tag in ("lm loss", "lm acc", "grad-norm")}, resumed,
                             tags=("lm loss", "lm acc", "grad-norm"))


def test_bucketed_reduction_equals_a_plain_all_reduce_per_parameter():
    script = os.path.join(ROOT, "tests", "distributed", "check_buckets.py")
    command = launch.torchrun_command(2, [])[:-1] + [script]
    result = subprocess.run(command, capture_output=True, text=True, env=launch.env(), cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stdout.count(" ok") == 8, result.stdout


def test_global_batch_not_divisible_exits_2_on_every_rank_before_any_collective(tiny_data, tmp_path):
    result = launch.run(2, layout_args(tiny_data, tmp_path / "tb", "--global-batch-size", 6), timeout=120,
                        monitor_interval=launch.EVERY_RANK_SPEAKS)
    assert result.returncode != 0  # torchrun reports its workers' exit code 2 as a failure (1)
    errors = launch.error_lines(result.stderr)
    assert len(errors) == 2 and all("--micro-batch-size x data-parallel size = 2 x 2" in e for e in errors), errors
    assert not re.search(r'File ".*minibert/', result.stderr)  # torchrun's own traceback only, none of ours
    assert "exitcode  : 2" in result.stderr
