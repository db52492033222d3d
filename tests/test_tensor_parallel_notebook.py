"""The tensor-parallel notebook (notebooks/tensor_parallel.ipynb) runs from top to bottom and draws.

It is executed by nbclient in a kernel started with the interpreter running these tests (not whatever a
"python3" kernelspec on the machine points at, which may lack minibert's dependencies). It simulates the
ranks as tensors in one process, with no process group, so it takes seconds on a CPU. matplotlib is a
test-only extra: without it the test is skipped."""
import os
import sys

import pytest

pytest.importorskip("matplotlib")
from tests import notebooks  # noqa: E402  (skips this module without nbformat, nbclient, ipykernel)
from tests.notebooks import outputs_of  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "tensor_parallel.ipynb")
CELL_TIMEOUT_S = 120  # each cell takes well under a second; a hang fails instead of blocking CI


def test_committed_notebook_has_no_outputs():
    dirty = notebooks.dirty_cells(NOTEBOOK)
    assert not dirty, f"code cells {dirty} have outputs or execution counts: clear them before committing"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tensor_parallel_notebook")
    return notebooks.execute(notebooks.read(NOTEBOOK), tmp, CELL_TIMEOUT_S)


def test_notebook_draws_the_splits(executed):
    images = [output for output in outputs_of(executed) if "image/png" in output.get("data", {})]
    assert len(images) >= 2, "expected the weights coloured by rank and the sequence-parallel layouts"
    assert not outputs_of(executed, "error")


def test_notebook_prints_what_it_says(executed):
    text = notebooks.stream_text(executed)
    assert os.path.realpath(sys.executable) in notebooks.printed_executables(executed)
    for line in [
        "| concatenated == X W^T: True",                                   # column-parallel
        "| summed == X W^T: True",                                         # row-parallel
        "f backward: rank 0's dL/dX alone == the whole gradient: False",
        "f backward: the sum over ranks == the whole gradient:   True",
        "g backward: every rank's gradient == dL/dZ, unchanged:  True",
        "MLP: sum over ranks of GeLU(X A_r) B_r == GeLU(X A) B: True",
        "[heads, 3, d]: rank 0 heads ['q0 k0 v0', 'q1 k1 v1'] | rank 1 heads ['q2 k2 v2', 'q3 k3 v3']",
        "SelfAttention split by heads: sum of ranks + bias == unsplit: True",
        "the [3, heads, d] layout split the same way == unsplit:   False",
        "vocab-parallel embedding: sum over ranks == F.embedding: True",
        "TP 1: vocab 30524 padded to 30592 rows", "TP 2: vocab 30524 padded to 30720 rows",
        "TP 4: vocab 30524 padded to 30720 rows",
        "vocab-parallel cross entropy from blocks == F.cross_entropy: True",
        "vocab_parallel_cross_entropy(group=None) == F.cross_entropy: True",
        "its gradient == autograd's: True | padded columns' gradient all zero: True",
        "TP 2: the ranks' blocks == the one-process tensor: True; with a generator per rank instead: False",
        "the 30524 real rows equal: True | padding rows all 0: True",
        "outside the region, every rank drops the same entries: True",
        "inside the region, the ranks' patterns differ:         True",
        "reduce-scatter then all-gather == all-reduce: True",
        "one rank's LayerNorm weight gradient == the whole one: False",
        "summed over the ranks (finalize_model_grads) == the whole one: True",
    ]:
        assert line in text, line
