"""What the notebook tests share: a kernel run by this interpreter, executing a notebook in a clean
environment, and reading its outputs.

The kernel is started with the interpreter running the tests (not whatever a "python3" kernelspec on
the machine points at, which may lack minibert's dependencies). nbformat, nbclient and ipykernel are
test-only extras: a test module importing this one is skipped without them."""
import os
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
from jupyter_client.kernelspec import KernelSpec  # noqa: E402  (installed with nbclient)
from jupyter_client.manager import KernelManager  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")


class ThisPythonKernelManager(KernelManager):
    """A kernel run by the interpreter running the tests (with its ipykernel and torch)."""

    @property
    def kernel_spec(self):
        return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                          display_name="minibert tests", language="python")


def read(path):
    return nbformat.read(path, as_version=4)


def dirty_cells(path):
    """Indices of the code cells of the committed notebook that hold outputs or execution counts."""
    nb = read(path)
    nbformat.validate(nb)
    code_cells = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code_cells, f"{path} has no code cells"
    return [i for i, cell in enumerate(code_cells) if cell.outputs or cell.execution_count is not None]


def execute(nb, tmp, cell_timeout_s, env=None):
    """Run every cell of `nb` (in place) from notebooks/, as Jupyter would. The kernel inherits
    OMP_NUM_THREADS=1 (the CI machine has 2 cores), an IPython folder and a matplotlib cache under
    `tmp` (out of $HOME), and `env`; os.environ is restored afterwards. Raises CellExecutionError,
    naming the cell, if a cell fails. The run must leave no file in the repository."""
    files_before = repository_files()
    env = {"OMP_NUM_THREADS": "1", "IPYTHONDIR": str(tmp / "ipython"), "MPLCONFIGDIR": str(tmp / "matplotlib"),
           **(env or {})}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        nbclient.NotebookClient(nb, timeout=cell_timeout_s, kernel_manager_class=ThisPythonKernelManager,
                                resources={"metadata": {"path": NOTEBOOKS}}).execute()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    new = repository_files() - files_before
    assert not new, f"the notebook left files in the repository: {sorted(new)[:10]}"
    return nb


def repository_files():
    """Every file under the repository root but git's folder, the virtual environment and Python's caches."""
    found = set()
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if d not in (".git", ".venv", "__pycache__", ".pytest_cache")]
        found |= {os.path.relpath(os.path.join(folder, name), ROOT) for name in files}
    return found


def stream_text(nb):
    """Everything the cells printed."""
    return "".join(output.get("text", "") for output in outputs_of(nb, "stream"))


def printed_executables(nb):
    """The real paths the notebook printed on its `python: PATH` lines (its sys.executable)."""
    return {os.path.realpath(line.split()[-1]) for line in stream_text(nb).splitlines() if line.startswith("python:")}


def outputs_of(nb, output_type=None):
    return [output for cell in nb.cells if cell.cell_type == "code" for output in cell.outputs
            if output_type is None or output.output_type == output_type]
