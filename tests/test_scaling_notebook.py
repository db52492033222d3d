"""The scaling-memory notebook (notebooks/scaling_memory.ipynb) runs from top to bottom, draws, and
prints the planner's numbers.

It is executed by nbclient in a kernel started with the interpreter running these tests (not whatever a
"python3" kernelspec on the machine points at, which may lack minibert's dependencies). It is arithmetic
on the launch recipes' flags (minibert/tools/plan_memory.py), so it takes seconds on a CPU. Every number it
prints is checked against the planner itself: each recipe's `DRY_RUN=1` report (the planner run by the
recipe), and `python -m minibert.tools.plan` (its `main`, in this process) for the variants the notebook draws:
recompute none / selective / full crossed with ZeRO-1 off / on, local attention, the 4B on 1 to 16 GPUs,
and the H200 table's planner columns. matplotlib is a test-only extra: without it the test is skipped."""
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")
from minibert.tools import plan  # noqa: E402
from tests import notebooks  # noqa: E402  (skips this module without nbformat, nbclient, ipykernel)
from tests.notebooks import outputs_of  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "scaling_memory.ipynb")
CELL_TIMEOUT_S = 120  # each cell takes about a second; a hang fails instead of blocking CI


def test_committed_notebook_has_no_outputs():
    dirty = notebooks.dirty_cells(NOTEBOOK)
    assert not dirty, f"code cells {dirty} have outputs or execution counts: clear them before committing"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scaling_notebook")
    return notebooks.execute(notebooks.read(NOTEBOOK), tmp, CELL_TIMEOUT_S)


def test_notebook_draws_the_breakdowns(executed):
    images = [output for output in outputs_of(executed) if "image/png" in output.get("data", {})]
    assert len(images) == 5, "expected the recipes, the recompute x ZeRO-1 panels, ZeRO-1 against DP, " \
                             "the 20B's stages and the planner against the H200"
    assert not outputs_of(executed, "error")


@pytest.fixture(scope="module")
def printed(executed):
    """What the notebook printed, each run of spaces one space (the columns' widths aside)."""
    text = notebooks.stream_text(executed)
    assert os.path.realpath(sys.executable) in notebooks.printed_executables(executed)
    return " ".join(text.split())


# ---------------------------------------------------------------- the planner, called directly
RECIPES = {"340M": "bert_340m", "4B": "bert_4b", "20B": "bert_20b"}
VOCAB = "minibert/vocab/bert-base-uncased-vocab.txt"
RECOMPUTE_FLAGS = {"none": [], "selective": ["--recompute-activations"],
                   "full": ["--recompute-granularity", "full", "--recompute-method", "uniform"]}


def dry_run(recipe, **env):
    """DRY_RUN=1 bash examples/RECIPE.sh: (the trainer's flags, --nnodes, --nproc-per-node, the report)."""
    clean = {"PATH": os.environ["PATH"], "DRY_RUN": "1", "PYTHON": sys.executable, **env}
    result = subprocess.run(["bash", f"examples/{recipe}.sh", "CKPT", "TB", VOCAB, "DATA_text_sentence"], cwd=ROOT,
                            env=clean, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    words = shlex.split(lines[1])
    assert words[0] == "torchrun", lines[:2]
    train = words.index("minibert/train.py")
    nnodes, per_node = (int(words[words.index(flag) + 1]) for flag in ("--nnodes", "--nproc_per_node"))
    return words[train + 1:], nnodes, per_node, "\n".join(lines[3:])


@pytest.fixture(scope="module")
def recipes():
    return {name: dry_run(recipe) for name, recipe in RECIPES.items()}


def planner(flags, nnodes, per_node, *extra):
    """python -m minibert.tools.plan FLAGS --nnodes N --nproc-per-node G EXTRA, in this process: (exit, out, err)."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            plan.main([*map(str, flags), "--nnodes", str(nnodes), "--nproc-per-node", str(per_node), *map(str, extra)])
        except SystemExit as stop:
            code = stop.code
    return code, out.getvalue(), err.getvalue()


def variant(flags, recompute, zero1):
    """The recipe's flags with recompute `recompute` and ZeRO-1 on or off."""
    flags = [f for f in flags if f != "--use-distributed-optimizer"]
    return flags + RECOMPUTE_FLAGS[recompute] + (["--use-distributed-optimizer"] if zero1 else [])


def this_run(report):
    """(the most loaded stage, its GiB) from a report's memory heading and "this run:" line."""
    return (re.search(r"^memory per GPU: pipeline stage (\d+)", report, re.M)[1],
            re.search(r"^this run: ([\d.]+) of", report, re.M)[1])


def row(report, label):
    """The numbers of a report's table row that starts with `label`."""
    line = next(line for line in report.splitlines() if line.strip().startswith(label))
    return re.findall(r"\d+\.\d+|\d+", line[line.index(label) + len(label):])


def test_the_recipes_breakdown_is_the_planners(printed, recipes):
    """Section 3: weights, grads, optimizer, activations and total of each recipe's most loaded GPU."""
    for name, (flags, _, _, report) in recipes.items():
        zero1 = "--use-distributed-optimizer" in flags
        stage, total = this_run(report)
        optimizer = row(report, "optimizer with ZeRO-1")[-1] if zero1 else row(report, "optimizer (")[-1]
        activations = re.findall(r"\d+\.\d+", next(line for line in report.splitlines() if "<- this run" in line))[0]
        expected = " ".join([name, stage, row(report, "weights (")[-1], row(report, "gradients (")[-1], optimizer,
                             activations, total])
        assert expected in printed, expected


def test_recompute_and_zero1_are_the_planners(printed, recipes):
    """Section 4: every cell of recompute x ZeRO-1, each from the planner run with those flags."""
    for name, (flags, nnodes, per_node, _) in recipes.items():
        cells = []
        for zero1 in (False, True):
            for recompute in RECOMPUTE_FLAGS:
                code, out, err = planner(variant(flags, recompute, zero1), nnodes, per_node)
                assert code == 0, err
                stage, total = this_run(out)
                cells.append(f"{recompute}/{'ZeRO-1' if zero1 else 'no ZeRO-1'} {total} (stage {stage})")
        expected = f"{name}: " + "; ".join(cells)
        assert expected in printed, expected


def test_one_layers_activations_are_the_planners(printed, recipes):
    flags, nnodes, per_node, _ = recipes["340M"]
    for backend in ("flash", "local"):
        code, out, err = planner(flags, nnodes, per_node, "--attention-backend", backend)
        assert code == 0, err
        micro = row(out, "activations of one layer and one micro-batch [b")[0]
        expected = (f"340M, one layer, micro-batch {micro}, {backend} attention: no recompute "
                    f"{row(out, '= one layer, no recompute')[0]} MiB, selective "
                    f"{row(out, 'selective recompute (no attention core)')[0]} MiB, full "
                    f"{row(out, 'full recompute (the layer')[-1]} MiB")
        assert expected in printed, expected


def test_zero1_against_dp_is_the_planners(printed, recipes):
    """Section 5: the 4B recipe on 1, 2, 4, 8 GPUs of one node, with and without ZeRO-1; refused on 16."""
    flags = recipes["4B"][0]
    for gpus in (1, 2, 4, 8):
        totals = []
        for zero1 in (False, True):
            code, out, err = planner(variant(flags, "none", zero1), 1, gpus)
            assert code == 0, err
            totals.append(this_run(out)[1])
        expected = f"4B on {gpus} GPUs (DP {gpus}): {totals[0]} GiB without ZeRO-1, {totals[1]} with"
        assert expected in printed, expected
    code, out, err = planner(flags, 2, 8)
    refusals = [line[len("error: "):] for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(refusals) == 1, err
    assert f"4B on 16 GPUs: refused: {refusals[0]}" in printed, refusals[0]


def test_the_20b_stages_are_the_planners(printed, recipes):
    """Section 6: each stage's GiB and micro-batches in flight (the planner's "per stage" line), without
    and with full recompute, and the most parameters per GPU."""
    flags, nnodes, per_node, report = recipes["20B"]
    for recompute, label in (("none", "no recompute"), ("full", "full ")):  # the notebook pads the label
        code, out, err = planner(variant(flags, recompute, True), nnodes, per_node)
        assert code == 0, err
        per_stage = re.findall(r"(\d+): ([\d.]+) \(\d+ layers, (\d+) in flight\)",
                               next(line for line in out.splitlines() if line.startswith("per stage")))
        assert len(per_stage) == 4, out
        for stage, gib, in_flight in per_stage:
            pattern = rf"20B stage {stage}, {label}: [\d.]+M parameters per GPU, {in_flight} in flight, {gib} GiB"
            assert re.search(pattern, printed), pattern
    most = re.search(r"^parameters per GPU: \d+ \(([\d.]+M); pipeline stage (\d+)", report, re.M)
    assert f"20B stage {most[2]}, no recompute: {most[1]} parameters per GPU" in printed, most[0]


def test_the_h200_table_is_the_files_and_its_planner_columns_the_planners(printed):
    """Section 7 prints bench/results/plan_check_h200_2026-12-01.md's rows; their planner columns are what the planner says
    today for bench/plan_check.py's flags (so the measured ratios still compare with this planner)."""
    from bench.plan_check import COMMON, CONFIGS
    with open(os.path.join(ROOT, "bench", "results", "plan_check_h200_2026-12-01.md"), encoding="utf-8") as f:
        rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in f.read().splitlines()[2:]
                if line.startswith("|")]
    assert [r[0] for r in rows] == [name for name, *_ in CONFIGS]
    for cells, (name, flags, iterations, interval) in zip(rows, CONFIGS):
        assert " | ".join(cells) in printed, cells
        code, out, err = planner([*flags, *COMMON, "--train-iters", iterations, "--log-interval", interval], 1, 1)
        assert code == 0, err
        step = float(re.search(r"= step\s+([\d.]+) ms", out)[1])
        assert cells[1] == f"{float(this_run(out)[1]):.1f} GiB" and cells[4] == f"{step:.0f}", (name, cells)
