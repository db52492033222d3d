"""The pipeline-schedules notebook (notebooks/pipeline_schedules.ipynb) runs from top to bottom and draws.

It is executed by nbclient in a kernel started with the interpreter running these tests (not whatever a
"python3" kernelspec on the machine points at, which may lack minibert's dependencies). It only
simulates schedules, so it takes seconds on a CPU. matplotlib is a test-only extra: without it the
test is skipped."""
import os
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")
from jupyter_client.kernelspec import KernelSpec  # noqa: E402  (installed with nbclient)
from jupyter_client.manager import KernelManager  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "pipeline_schedules.ipynb")
CELL_TIMEOUT_S = 120  # each cell takes well under a second; a hang fails instead of blocking CI


class ThisPythonKernelManager(KernelManager):
    """A kernel run by the interpreter running the tests."""

    @property
    def kernel_spec(self):
        return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                          display_name="minibert tests", language="python")


def outputs_of(nb, output_type=None):
    return [output for cell in nb.cells if cell.cell_type == "code" for output in cell.outputs
            if output_type is None or output.output_type == output_type]


def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, cell in enumerate(nb.cells)
             if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)]
    assert not dirty, f"cells {dirty} have outputs or execution counts: clear them before committing"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("schedules_notebook")
    notebooks_before = set(os.listdir(os.path.join(ROOT, "notebooks")))
    env = {"OMP_NUM_THREADS": "1",
           "IPYTHONDIR": str(tmp / "ipython"),      # the kernel's history database stays out of $HOME
           "MPLCONFIGDIR": str(tmp / "matplotlib")}  # and so does matplotlib's font cache
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)  # the kernel process inherits this environment
    try:
        nb = nbformat.read(NOTEBOOK, as_version=4)
        nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_manager_class=ThisPythonKernelManager,
                                resources={"metadata": {"path": os.path.join(ROOT, "notebooks")}}).execute()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    assert set(os.listdir(os.path.join(ROOT, "notebooks"))) == notebooks_before, "left files in notebooks/"
    return nb


def test_notebook_draws_the_schedules_the_bubble_and_the_memory(executed):
    images = [output for output in outputs_of(executed) if "image/png" in output.get("data", {})]
    assert len(images) >= 3, "expected the timelines, the bubble plot and the in-flight plot"
    assert not outputs_of(executed, "error")


def test_notebook_prints_what_it_says(executed):
    text = "".join(output.get("text", "") for output in outputs_of(executed, "stream"))
    assert os.path.realpath(sys.executable) in {os.path.realpath(line.split()[-1]) for line in
                                                text.splitlines() if line.startswith("python:")}
    assert "stage 3 | .  .  .  F0 B0" in text                       # the text drawing of 1F1B
    assert "1f1b         p=4 m=8 v=1: measured 3/8 = 0.3750" in text  # bubble: simulated = formula
    assert "1F1B                           [4, 3, 2, 1]" in text      # at most p - r in flight
    assert "deadlock: rank 0 after B0b" in text                      # the plain rule, interleaved
