"""The pipeline-schedules notebook (notebooks/pipeline_schedules.ipynb) runs from top to bottom and draws.

It is executed by nbclient in a kernel started with the interpreter running these tests (not whatever a
"python3" kernelspec on the machine points at, which may lack minibert's dependencies). It only
simulates schedules, so it takes seconds on a CPU. matplotlib is a test-only extra: without it the
test is skipped."""
import os
import sys

import pytest

pytest.importorskip("matplotlib")
from tests import notebooks  # noqa: E402  (skips this module without nbformat, nbclient, ipykernel)
from tests.notebooks import outputs_of  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "pipeline_schedules.ipynb")
CELL_TIMEOUT_S = 120  # each cell takes well under a second; a hang fails instead of blocking CI


def test_committed_notebook_has_no_outputs():
    dirty = notebooks.dirty_cells(NOTEBOOK)
    assert not dirty, f"code cells {dirty} have outputs or execution counts: clear them before committing"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("schedules_notebook")
    return notebooks.execute(notebooks.read(NOTEBOOK), tmp, CELL_TIMEOUT_S)


def test_notebook_draws_the_schedules_the_bubble_and_the_memory(executed):
    images = [output for output in outputs_of(executed) if "image/png" in output.get("data", {})]
    assert len(images) >= 3, "expected the timelines, the bubble plot and the in-flight plot"
    assert not outputs_of(executed, "error")


def test_notebook_prints_what_it_says(executed):
    text = notebooks.stream_text(executed)
    assert os.path.realpath(sys.executable) in notebooks.printed_executables(executed)
    assert "stage 3 | .  .  .  F0 B0" in text                       # the text drawing of 1F1B
    assert "1f1b         p=4 m=8 v=1: measured 3/8 = 0.3750" in text  # bubble: simulated = formula
    assert "1F1B                           [4, 3, 2, 1]" in text      # at most p - r in flight
    assert "deadlock: rank 0 after B0b" in text                      # the plain rule, interleaved
