"""The single-GPU lesson (notebooks/single_gpu_lesson.ipynb) runs from top to bottom and does what it says.

The notebook is executed by nbclient in a Jupyter kernel, in QUICK mode (25 iterations) with every
file it writes under a temporary folder. Which Python runs the kernel matters: the kernelspec named
"python3" may come from a user-level Jupyter folder and point at another interpreter (one without
torch). So the kernel is started with the interpreter running these tests, whatever the kernelspecs
on the machine say, and the notebook's own printout of sys.executable is checked against it.

After the notebook's cells, the test appends one cell of its own (to the in-memory copy, never to
the file) that prints the variables the lesson leaves behind as JSON, and checks them here."""
import json
import math
import os
import sys
import time

import pytest

from tests import notebooks  # noqa: E402  (skips this module without nbformat, nbclient, ipykernel)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "single_gpu_lesson.ipynb")
STATE_MARKER = "NOTEBOOK_STATE "
CELL_TIMEOUT_S = 600  # a cell of QUICK mode takes seconds; a hang fails the test instead of blocking CI

PROBE = f"""
import json
print({STATE_MARKER!r} + json.dumps({{
    "executable": sys.executable,
    "quick": QUICK,
    "out_dir": str(OUT_DIR),
    "save_dir": str(SAVE_DIR),
    "vocab_size": tokenizer.vocab_size,
    "initial_lm_loss": initial_lm_loss,
    "train_losses": train_losses,
    "iterations": result.iteration,
    "same_logits": same_logits,
    "predictions": predictions,
}}))
"""


def cell_text(cell):
    """All text a code cell printed (streams and text/plain results)."""
    parts = []
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream":
            parts.append(output.get("text", ""))
        elif "data" in output:
            parts.append(output["data"].get("text/plain", ""))
    return "".join(parts)


def test_committed_notebook_has_no_outputs():
    dirty = notebooks.dirty_cells(NOTEBOOK)
    assert not dirty, f"code cells {dirty} have outputs or execution counts: clear them before committing"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """(executed notebook, probe state, seconds, output folder) for one QUICK run in a temporary folder."""
    tmp = tmp_path_factory.mktemp("notebook")
    out_dir = tmp / "out"
    runs_before = os.path.exists(os.path.join(ROOT, "runs", "notebook"))

    nb = notebooks.read(NOTEBOOK)
    nb.cells.append(notebooks.nbformat.v4.new_code_cell(PROBE))
    start = time.perf_counter()
    notebooks.execute(nb, tmp, CELL_TIMEOUT_S,
                      env={"MINIBERT_NOTEBOOK_QUICK": "1", "MINIBERT_NOTEBOOK_OUT": str(out_dir)})
    seconds = time.perf_counter() - start

    probe_lines = [line for line in cell_text(nb.cells[-1]).splitlines() if line.startswith(STATE_MARKER)]
    assert len(probe_lines) == 1, cell_text(nb.cells[-1])
    state = json.loads(probe_lines[0][len(STATE_MARKER):])
    assert os.path.exists(os.path.join(ROOT, "runs", "notebook")) == runs_before, "wrote into runs/notebook"
    print(f"\nnotebook executed in {seconds:.1f} s")
    return nb, state, seconds, out_dir


def test_notebook_runs_in_this_python_in_quick_mode(executed):
    _, state, _, out_dir = executed
    assert os.path.realpath(state["executable"]) == os.path.realpath(sys.executable)
    assert state["quick"] is True
    assert os.path.realpath(state["out_dir"]) == os.path.realpath(out_dir)


def test_initial_loss_is_that_of_a_uniform_guess(executed):
    _, state, _, _ = executed
    assert abs(state["initial_lm_loss"] - math.log(state["vocab_size"])) < 0.5


def test_training_logged_and_the_loss_went_down(executed):
    nb, state, _, _ = executed
    iterations = [it for it, _ in state["train_losses"]]
    assert state["iterations"] == 25
    assert iterations == [5, 10, 15, 20, 25]
    # nan: an interval whose steps were all skipped (fp16 on a GPU, while the loss scale comes down)
    updated = [loss for _, loss in state["train_losses"] if math.isfinite(loss)]
    assert len(updated) >= 2, state["train_losses"]
    assert updated[-1] < updated[0], state["train_losses"]
    text = "".join(cell_text(cell) for cell in nb.cells if cell.cell_type == "code")
    for line in ("building train/valid/test datasets ...", "starting training",
                 "validation loss at iteration 25 on test set"):
        assert line in text, f"the trainer's output lacks {line!r}"


def test_checkpoint_written_and_reloads_to_the_same_logits(executed):
    _, state, _, out_dir = executed
    save_dir = state["save_dir"]
    assert os.path.realpath(save_dir).startswith(os.path.realpath(out_dir))
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "25"
    for iteration in (10, 20, 25):  # save_interval 10, and the final save
        path = os.path.join(save_dir, f"iter_{iteration:07d}", "mp_rank_00", "model_optim_rng.pt")
        assert os.path.isfile(path), path
    assert state["same_logits"] is True


def test_the_live_loss_plot_is_a_figure(executed):
    """matplotlib is in notebooks/requirements.txt, so the training cell draws a real figure (updated in
    place through one display handle), not the text bars of the fallback."""
    pytest.importorskip("matplotlib", reason="matplotlib is in notebooks/requirements.txt: install it")
    nb, _, _, _ = executed
    (train_cell,) = [cell for cell in nb.cells if cell.cell_type == "code" and "class LiveLossPlot" in cell.source]
    images = [output for output in train_cell.outputs
              if output.get("output_type") in ("display_data", "execute_result") and "image/png" in output.get("data", {})]
    assert len(images) == 1, [output.get("output_type") for output in train_cell.outputs]
    assert "[plot]" not in cell_text(train_cell), "the text fallback ran although matplotlib is installed"


def test_fill_mask_prints_five_predictions(executed):
    nb, state, _, _ = executed
    assert len(state["predictions"]) == 5
    assert all(isinstance(token, str) and token for token in state["predictions"])
    text = "".join(cell_text(cell) for cell in nb.cells if cell.cell_type == "code")
    assert "[MASK]" in text
