"""The GPU tests run compiled kernels, which Triton's interpreter cannot stand in for on CUDA tensors. The
suite's conftest turns the interpreter on unless TRITON_INTERPRET is set (the CPU tests need it), so a
plain `python -m pytest tests/gpu`, or `make test` on a machine with a GPU, would run these tests through
the interpreter and fail for that reason alone: they are skipped then, with the command that runs them
(`make test-gpu` sets TRITON_INTERPRET=0)."""
import os
import pathlib

import pytest

HERE = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    skip = pytest.mark.skip(reason="Triton's interpreter is on (TRITON_INTERPRET=1): run the GPU tests with "
                                   "`make test-gpu` (or TRITON_INTERPRET=0 python -m pytest tests/gpu)")
    for item in items:
        if HERE in pathlib.Path(str(item.fspath)).parents:
            item.add_marker(skip)
