"""Pipeline parallelism through `torchrun minibert/train.py` on CPU (gloo, fp32, dropout off, 8 iterations):
PP 2 and PP 4 with 1F1B and AFAB, interleaved PP 2 with 2 virtual stages (and --gradient-accumulation-
fusion), TP 2 x PP 2 (and --no-residual-layernorm-fusion; the others chain the LayerNorms), DP 2 x PP 2 and
TP 2 x PP 2 x DP 2 (8 processes) give the single-process losses, accuracies and grad norms (relative 1e-5); TP 2 x PP 2
with dropout, stopped and resumed, logs the unbroken run's lines (another layout is refused); checkpoints are mp_rank_TT_PPP with
full-model names; --pipeline-trace prints each rank's sends and receives; bad splits are refused before any collective (in-process; tests/test_data_parallel.py shows
every rank's line through torchrun)."""
import os

import pytest
import torch

from minibert.training import checkpoint
from tests import launch
from tests.conftest import layout_args

LAYOUTS = {
    "pp2-1f1b": (2, ["--pipeline-model-parallel-size", 2]),
    "pp2-afab": (2, ["--pipeline-model-parallel-size", 2, "--pipeline-schedule", "afab",
                     "--pipeline-trace"]),  # read by test_pipeline_trace_prints_each_send_and_receive too
    "pp4-1f1b": (4, ["--pipeline-model-parallel-size", 4]),
    "pp4-afab": (4, ["--pipeline-model-parallel-size", 4, "--pipeline-schedule", "afab"]),
    "pp2-interleaved": (2, ["--pipeline-model-parallel-size", 2, "--num-layers-per-virtual-pipeline-stage", 1]),
    "tp2-pp2": (4, ["--pipeline-model-parallel-size", 2, "--tensor-model-parallel-size", 2, "--sequence-parallel",
                    "--no-residual-layernorm-fusion"]),  # each layer's own LN1 (the others: chained, the default)
    "dp2-pp2": (4, ["--pipeline-model-parallel-size", 2, "--use-distributed-optimizer"]),
    "tp2-pp2-dp2": (8, ["--pipeline-model-parallel-size", 2, "--tensor-model-parallel-size", 2,
                        "--num-layers-per-virtual-pipeline-stage", 1, "--use-distributed-optimizer",
                        "--overlap-grad-reduce"]),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_pipeline_equals_one_process(tiny_data, tmp_path_factory, layout_reference, name):
    nproc, flags = LAYOUTS[name]
    result, scalars = launch.layout_run(tiny_data, tmp_path_factory, name, nproc, *flags)
    worst = launch.assert_close_runs(layout_reference["scalars"], scalars)
    print(f"{name}: worst relative difference {worst:.2e}")
    lines = launch.comparable_lines(result.stdout)
    assert len([line for line in lines if line.startswith("iteration ")]) == 8  # one rank prints
    assert len([line for line in lines if line.startswith("validation")]) == 4  # evaluation through the stages


def test_stopped_and_resumed_tp2_pp2_with_dropout_logs_the_unbroken_run(tiny_data, tmp_path):
    """TP 2 x PP 2 with dropout (the tensor-parallel generators and the pipeline's stage files), stopped at 4 and
    resumed: the lines of the unbroken run; a layout the checkpoint was not written for is refused, naming the
    converter."""
    nproc, dropout = 4, ["--hidden-dropout", 0.1, "--attention-dropout", 0.1, "--pipeline-model-parallel-size", 2,
                         "--tensor-model-parallel-size", 2]
    unbroken = launch.run(nproc, layout_args(tiny_data, tmp_path / "tb0", *dropout))
    first = launch.run(nproc, layout_args(tiny_data, tmp_path / "tb1", *dropout, "--save", tmp_path / "ckpt",
                                          "--exit-interval", 4))
    second = launch.run(nproc, layout_args(tiny_data, tmp_path / "tb2", *dropout, "--load", tmp_path / "ckpt"))
    for result in (unbroken, first, second):
        assert result.returncode == 0, result.stderr[-3000:]
    assert launch.comparable_lines(first.stdout) + launch.comparable_lines(second.stdout) == \
        launch.comparable_lines(unbroken.stdout)
    iteration_dir = tmp_path / "ckpt" / "iter_0000004"
    assert sorted(os.listdir(iteration_dir)) == ["manifest.json"] + [f"mp_rank_{t:02d}_{p:03d}" for t in range(2)
                                                                     for p in range(2)]
    first_stage = torch.load(checkpoint.checkpoint_path(str(tmp_path / "ckpt"), 4, 0, 0, 2), weights_only=True)
    last_stage = torch.load(checkpoint.checkpoint_path(str(tmp_path / "ckpt"), 4, 0, 1, 2), weights_only=True)
    assert {k.split(".")[1] for k in first_stage["model"] if k.startswith("layers.")} == {"0", "1"}
    assert {k.split(".")[1] for k in last_stage["model"] if k.startswith("layers.")} == {"2", "3"}
    name = "embedding.word_embeddings.weight"  # the tied table and its copy on the last stage: in step
    assert torch.equal(first_stage["model"][name], last_stage["model"][name])
    # one process cannot load it: the message names the converter
    other = launch.run(1, layout_args(tiny_data, tmp_path / "tb3", "--load", tmp_path / "ckpt"), timeout=120)
    errors = launch.error_lines(other.stderr)
    assert other.returncode == 2 and len(errors) == 1 and "python -m minibert.tools.reshard convert" in errors[0]


def test_pipeline_trace_prints_each_send_and_receive(tiny_data, tmp_path_factory, layout_reference):
    nproc, flags = LAYOUTS["pp2-afab"]
    result, _ = launch.layout_run(tiny_data, tmp_path_factory, "pp2-afab", nproc, *flags)
    sends = [line for line in result.stdout.splitlines() if line.startswith("[pipeline rank 0] send")]
    receives = [line for line in result.stdout.splitlines() if line.startswith("[pipeline rank 1] recv")]
    # each of the 8 training steps sends its 8 micro-batches' activations from stage 0 to 1 (a global batch of
    # 16 in micro-batches of 2); the trace follows the training schedule's exchanges, not evaluation's sends
    assert len(sends) == len(receives) == 8 * 8
    assert sends[0] == "[pipeline rank 0] send activation of micro-batch 0 for stage 1 to pipeline rank 1"
    assert [line.split("micro-batch ")[1].split()[0] for line in sends[:8]] == [str(m) for m in range(8)]  # AFAB


@pytest.mark.parametrize("flags,message", [
    (["--pipeline-model-parallel-size", 2, "--num-layers", 3], "3 layers cannot be split evenly over 2"),
    (["--pipeline-model-parallel-size", 2, "--num-layers-per-virtual-pipeline-stage", 1,
      "--global-batch-size", 6], "a multiple of --pipeline-model-parallel-size 2"),
], ids=["layers", "interleaved-micro-batches"])
def test_bad_pipeline_layouts_are_refused_before_any_collective(tiny_data, tmp_path, flags, message):
    assert message in launch.usage_error(layout_args(tiny_data, tmp_path / "tb", *flags), world_size=2)


def test_uneven_split_puts_the_given_layers_on_the_first_stage(tiny_data, tmp_path_factory, layout_reference):
    """--decoder-first-pipeline-num-layers 1 on 2 stages: layer 0 on stage 0, layers 1..3 on stage 1."""
    result, scalars = launch.layout_run(tiny_data, tmp_path_factory, "pp2-uneven", 2,
                                        "--pipeline-model-parallel-size", 2, "--decoder-first-pipeline-num-layers", 1)
    launch.assert_close_runs(layout_reference["scalars"], scalars)
