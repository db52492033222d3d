"""Tensor parallelism on CPU (gloo): every layer against nn.Linear / nn.Embedding / F.cross_entropy at TP 2
and 4 (tests/distributed/check_tp_layers.py), the layout-invariant init, the collectives per layer, and the
whole model through `torchrun minibert/train.py`: TP 2, TP 4, TP 2 with sequence parallelism (and
--no-residual-layernorm-fusion: the others chain the LayerNorms, the default), TP 2 x DP 2 give the single-process
losses, accuracies and grad norms (relative 1e-5); bad layouts are refused before any collective
(checked in-process; tests/test_data_parallel.py shows every rank's line through torchrun)."""
import os
import re
import subprocess

import pytest

from tests import launch
from tests.conftest import layout_args

ROOT = launch.ROOT
LAYOUTS = {
    "tp2": (2, ["--tensor-model-parallel-size", 2]),
    "tp4": (4, ["--tensor-model-parallel-size", 4]),
    "tp2-sp": (2, ["--tensor-model-parallel-size", 2, "--sequence-parallel",
                   "--no-residual-layernorm-fusion"]),  # each layer's own LN1 (the others: chained, the default)
    "tp2-dp2": (4, ["--tensor-model-parallel-size", 2, "--use-distributed-optimizer"]),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_tensor_parallel_equals_one_process(tiny_data, tmp_path_factory, layout_reference, name):
    nproc, flags = LAYOUTS[name]
    result, scalars = launch.layout_run(tiny_data, tmp_path_factory, name, nproc, *flags)
    worst = launch.assert_close_runs(layout_reference["scalars"], scalars)
    print(f"{name}: worst relative difference {worst:.2e}")
    assert len([line for line in result.stdout.splitlines() if line.startswith("iteration ")]) == 8


@pytest.mark.parametrize("tp", [2, 4])
def test_layers_init_and_collectives(tp):
    script = os.path.join(ROOT, "tests", "distributed", "check_tp_layers.py")
    command = launch.torchrun_command(tp, [])[:-1] + [script]
    result = subprocess.run(command, capture_output=True, text=True, env=launch.env(), cwd=ROOT, timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    out = result.stdout
    for check in ("column/row-parallel linear ok", "gather_output and input_is_parallel=False ok",
                  "vocab-parallel embedding and cross entropy ok", "vocab-parallel accuracy ok",
                  "layout-invariant init ok"):
        assert out.count(check) == tp, check
    # Megatron's communication per transformer layer: 2 all-reduces forward and 2 backward; with sequence
    # parallelism 2 all-gathers + 2 reduce-scatters forward, and in the backward 4 all-gathers (2 of them
    # re-gather the inputs instead of keeping them) + 2 reduce-scatters
    assert out.count("collectives sp=False forward [('all_reduce', 2)] backward [('all_reduce', 2)]") == tp
    assert out.count("collectives sp=True forward [('all_gather_single', 2), ('reduce_scatter_single', 2)] "
                     "backward [('all_gather_single', 4), ('reduce_scatter_single', 2)]") == tp
    worst = max(float(e) for e in re.findall(r"worst relative error ([\d.e+-]+)", out))
    assert worst <= 1e-6
    print(f"TP {tp}: worst norm-wise relative error of the layers {worst:.2e}")


@pytest.mark.parametrize("flags,message", [
    (["--tensor-model-parallel-size", 2, "--num-attention-heads", 3, "--hidden-size", 36],
     "--num-attention-heads 3 must be divisible by --tensor-model-parallel-size 2"),
    (["--tensor-model-parallel-size", 2, "--ffn-hidden-size", 33], "--ffn-hidden-size 33 must be divisible"),
    (["--tensor-model-parallel-size", 3], "cannot be split into TP x PP = 3 x 1"),
])
def test_bad_tensor_parallel_layouts_are_refused_before_any_collective(tiny_data, tmp_path, flags, message):
    assert message in launch.usage_error(layout_args(tiny_data, tmp_path / "tb", *flags), world_size=2)


def test_sequence_parallel_without_tensor_parallel_warns_and_runs(tiny_data, tmp_path):
    result = launch.run(1, layout_args(tiny_data, tmp_path / "tb", "--sequence-parallel", "--train-iters", 3))
    assert result.returncode == 0, result.stderr
    assert "warning: --sequence-parallel needs --tensor-model-parallel-size > 1" in result.stderr
