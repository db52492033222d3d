"""The chapters' commands run, in the order they are printed, as a reader would paste them.

A chapter (chapters/*.md, and README.md) marks a command block as runnable with the line

    <!-- runnable -->

immediately before a ```bash fence. For each file this test copies the repository to a temporary
folder, then runs every runnable block of the file, top to bottom, in ONE bash session from the copy's
root (so a variable one block sets is there for the next, as in the reader's terminal), under
`set -euo pipefail`. The conventions the chapters follow (chapter 00 states them for readers):

- `python` means the interpreter that has the requirements. The test puts shims first on PATH:
  `python` and `python3` run this test's interpreter (sys.executable), and `torchrun` runs
  `sys.executable -m torch.distributed.run` (the same thing as .venv/bin/torchrun). Blocks never spell
  `.venv/bin/`.
- Every output goes under `$RUN`: each chapter's first runnable block says `export RUN=${RUN:-runs/course}`,
  and the test sets RUN to a fresh scratch folder. No runnable block writes to /tmp.
- Long runs are shortened by rewriting the text (minibert itself reads no environment variable for it).
  In each command (a line with its backslash continuations):
    * `--train-iters N` with N > SHORT_ITERS becomes SHORT_ITERS, and `--lr-decay-iters`,
      `--lr-warmup-iters`, `--eval-interval`, `--save-interval`, `--log-interval`, `--exit-interval` are
      scaled by the same factor (rounded, at least 1); `--eval-iters` becomes at most SHORT_EVAL_ITERS
      (and `--eval-iters SHORT_EVAL_ITERS` follows `--train-iters` when the command has none);
    * in a command without `--train-iters`, an interval flag above SHORT_ITERS becomes SHORT_ITERS;
    * `make train-small` gets the Makefile's own schedule shortened the same way, through
      TRAIN_SMALL_ARGS (appended after any TRAIN_SMALL_ARGS the chapter passes: the later flag wins);
    * `python -m pytest ...` gets `--collect-only`: the command runs and finds its tests, which this suite
      runs itself (running them twice doubles their time); a pytest command whose output is piped into
      another command runs as printed, since the chapter reads what it prints.
  torchrun's `--nproc_per_node` is never changed. The test runs on the CPU (CUDA_VISIBLE_DEVICES="").
- A block whose printed output (the plain ``` block right after it) shows lines `exit N` must print
  the same `exit N` lines: write an expected failure as `command || echo "exit $?"`.
- `make test` is never runnable (it would run this test inside itself); blocks that need a GPU or take
  long get no marker, and the text says so.

One test per file, so a failure names the file; its message names the block and its line, and shows
the end of that block's output."""
import functools
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "<!-- runnable -->"
DOCUMENTS = ["README.md"] + sorted(os.path.join("chapters", name) for name in os.listdir(os.path.join(ROOT, "chapters"))
                                   if name.endswith(".md") and name[0].isdigit())  # the chapters, not the glossary
SHORT_ITERS = 10
SHORT_EVAL_ITERS = 2
SCALED_FLAGS = ("--lr-decay-iters", "--lr-warmup-iters", "--eval-interval", "--save-interval", "--log-interval",
                "--exit-interval")
CLAMPED_FLAGS = ("--eval-interval", "--save-interval", "--log-interval", "--exit-interval")
NOT_COPIED = {".git", ".venv", "runs", "__pycache__", ".pytest_cache", ".ipynb_checkpoints"}
TIMEOUT_S = 1800  # a whole file; a hang fails the test instead of blocking CI


def runnable_blocks(relative_path):
    """[(line number of the fence, the block's text, the printed output after it or None)]."""
    with open(os.path.join(ROOT, relative_path), encoding="utf-8") as f:
        lines = f.read().split("\n")
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        assert i + 1 < len(lines) and lines[i + 1].strip() == "```bash", \
            f"{relative_path}:{i + 1}: {MARKER} must be followed directly by a ```bash fence"
        end = closing_fence(lines, i + 2)
        output = None
        if end + 1 < len(lines) and lines[end + 1].strip() == "```":  # the printed output follows at once
            output = textwrap.dedent("\n".join(lines[end + 2:closing_fence(lines, end + 2)]))
        # a block inside a list item is indented: dedent it as the reader's paste would be
        blocks.append((i + 2, textwrap.dedent("\n".join(lines[i + 2:end])) + "\n", output))
    return blocks


def closing_fence(lines, start):
    return next(j for j in range(start, len(lines)) if lines[j].strip() == "```")


def commands(text):
    """Split a block into commands: a line and the lines its trailing backslashes join to it."""
    out, current = [], []
    for line in text.split("\n"):
        current.append(line)
        if not line.endswith("\\"):
            out.append("\n".join(current))
            current = []
    if current:
        out.append("\n".join(current))
    return out


def flag_value(command, flag):
    m = re.search(rf"(?<![\w-]){re.escape(flag)}[ =](\d+)\b", command)
    return int(m[1]) if m else None


def set_flag(command, flag, value):
    return re.sub(rf"((?<![\w-]){re.escape(flag)}[ =])(\d+)\b", lambda m: f"{m[1]}{value}", command)


def shorten_command(command):
    """The short setting of one command (see the module docstring)."""
    if re.match(r"\s*python -m pytest\b", command) and "|" not in command:
        return command.replace("python -m pytest", "python -m pytest --collect-only", 1)
    iters = flag_value(command, "--train-iters")
    if iters is not None and iters > SHORT_ITERS:
        factor = SHORT_ITERS / iters
        command = set_flag(command, "--train-iters", SHORT_ITERS)
        for flag in SCALED_FLAGS:
            value = flag_value(command, flag)
            if value is not None:
                command = set_flag(command, flag, max(1, round(value * factor)))
        value = flag_value(command, "--eval-iters")
        if value is not None:
            command = set_flag(command, "--eval-iters", min(value, SHORT_EVAL_ITERS))
        else:  # Megatron's default is 100 batches per evaluation: too many for a short run
            command = set_flag(command, "--train-iters", f"{SHORT_ITERS} --eval-iters {SHORT_EVAL_ITERS}")
    elif iters is None:
        for flag in CLAMPED_FLAGS:
            value = flag_value(command, flag)
            if value is not None and value > SHORT_ITERS:
                command = set_flag(command, flag, SHORT_ITERS)
    return command


def short_train_small_args():
    """The Makefile's train-small schedule, shortened by shorten_command, as TRAIN_SMALL_ARGS."""
    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as f:
        recipe = f.read().split("\ntrain-small:", 1)[1].split("\n\n", 1)[0]
    flags = ["--train-iters", *SCALED_FLAGS, "--eval-iters"]
    original = " ".join(f"{flag} {flag_value(recipe, flag)}" for flag in flags if flag_value(recipe, flag) is not None)
    return shorten_command(original)


def shorten(text):
    short = "\n".join(shorten_command(c) for c in commands(text))
    extra = short_train_small_args()

    def train_small(m):
        if m[1]:  # TRAIN_SMALL_ARGS="..." given: ours after theirs
            return f'make train-small TRAIN_SMALL_ARGS="{m[2]} {extra}"'
        return f'make train-small TRAIN_SMALL_ARGS="{extra}"'
    return re.sub(r'make train-small( TRAIN_SMALL_ARGS="([^"]*)")?', train_small, short)


def check_conventions(relative_path, line, text):
    where = f"{relative_path}:{line}"
    assert not re.search(r"(^|[\s;&|(])make test\b", text), f"{where}: make test is never a runnable block"
    assert ".venv/bin/" not in text, f"{where}: write `python` (chapter 00), not .venv/bin/..."
    assert "/tmp/" not in text, f"{where}: write outputs under $RUN, not /tmp"


def make_shims(folder):
    os.makedirs(folder)
    shims = {"python": f'exec "{sys.executable}" "$@"', "python3": f'exec "{sys.executable}" "$@"',
             "torchrun": f'exec "{sys.executable}" -m torch.distributed.run "$@"'}
    for name, line in shims.items():
        path = os.path.join(folder, name)
        with open(path, "w") as f:
            f.write(f"#!/bin/sh\n{line}\n")
        os.chmod(path, 0o755)


def run_document(relative_path, tmp_path, report=print):
    """Runs the file's runnable blocks; returns [(line, block, output, printed output)]."""
    blocks = runnable_blocks(relative_path)
    assert blocks, f"{relative_path} has no {MARKER} block"
    repo, scratch, shims, logs = (tmp_path / name for name in ("repo", "run", "bin", "logs"))
    shutil.copytree(ROOT, repo, ignore=lambda d, names: [n for n in names if n in NOT_COPIED
                                                         or n.endswith(".egg-info")])
    make_shims(shims)
    os.makedirs(logs)
    driver = ["set -euo pipefail"]
    for n, (line, text, _) in enumerate(blocks):
        check_conventions(relative_path, line, text)
        (logs / f"{n}.sh").write_text(shorten(text))
        driver += [f"echo {n} > '{logs}/current'", f"date +%s.%N > '{logs}/{n}.start'",
                   f"source '{logs}/{n}.sh' > '{logs}/{n}.out' 2>&1", f"date +%s.%N > '{logs}/{n}.end'"]
    driver.append(f"echo done > '{logs}/current'")
    (logs / "driver.sh").write_text("\n".join(driver) + "\n")
    env = {key: value for key, value in os.environ.items()
           if key not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"PATH": os.pathsep.join([str(shims), os.path.dirname(sys.executable), env.get("PATH", "")]),
                "RUN": str(scratch), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg",
                "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    result = subprocess.run(["bash", str(logs / "driver.sh")], cwd=repo, env=env, capture_output=True, text=True,
                            timeout=TIMEOUT_S)
    current = (logs / "current").read_text().strip()
    if result.returncode != 0 or current != "done":
        n = int(current)
        line, text, _ = blocks[n]
        output = (logs / f"{n}.out").read_text() if (logs / f"{n}.out").exists() else ""
        pytest.fail(f"{relative_path}: the runnable block at line {line} failed (exit {result.returncode}):\n"
                    f"{textwrap.indent(shorten(text), '    ')}\n--- the end of its output ---\n{output[-4000:]}"
                    f"{result.stderr[-1000:]}")
    times = [float((logs / f"{n}.end").read_text()) - float((logs / f"{n}.start").read_text())
             for n in range(len(blocks))]
    report(f"{relative_path}: {sum(times):.1f} s; per block (line: s) " +
           ", ".join(f"{line}: {t:.1f}" for (line, _, _), t in zip(blocks, times)))
    return [(line, text, (logs / f"{n}.out").read_text(), printed)
            for n, (line, text, printed) in enumerate(blocks)]


@pytest.mark.parametrize("relative_path", DOCUMENTS)
def test_runnable_blocks_run_in_order(relative_path, tmp_path, record_property):
    report = functools.partial(record_property, "report")  # shown after the run (tests/conftest.py)
    for line, text, output, printed in run_document(relative_path, tmp_path, report):
        expected_exits = re.findall(r"^exit \d+$", printed or "", re.M)
        actual_exits = re.findall(r"^exit \d+$", output, re.M)
        assert actual_exits == expected_exits, (
            f"{relative_path}:{line}: the block printed {actual_exits}, the chapter shows {expected_exits}\n"
            f"{output[-3000:]}")


def test_the_short_setting():
    """The rewrite rules, on the kinds of line the chapters hold."""
    course = ('COURSE="--num-layers 4 --train-iters 200 --lr-decay-iters 100 --log-interval 10 \\\n'
              '  --save-interval 100 --eval-interval 50 --eval-iters 10 --fp16"')
    assert shorten(course) == ('COURSE="--num-layers 4 --train-iters 10 --lr-decay-iters 5 --log-interval 1 \\\n'
                               '  --save-interval 5 --eval-interval 2 --eval-iters 2 --fp16"')
    assert shorten("python minibert/train.py $COURSE --train-iters 20 --save-interval 10 --eval-iters 2") == \
        "python minibert/train.py $COURSE --train-iters 10 --save-interval 5 --eval-iters 2"
    assert shorten("python minibert/train.py $COURSE --train-iters 6 --log-interval 1") == \
        "python minibert/train.py $COURSE --train-iters 6 --log-interval 1"  # short already
    assert shorten("python minibert/train.py $COURSE --lr 1e-3 --log-interval 20") == \
        "python minibert/train.py $COURSE --lr 1e-3 --log-interval 10"
    assert shorten("torchrun --nproc_per_node 2 minibert/train.py --train-iters 40 --log-interval 4") == \
        "torchrun --nproc_per_node 2 minibert/train.py --train-iters 10 --eval-iters 2 --log-interval 1"
    assert shorten("python -m pytest -q tests/test_plan.py") == "python -m pytest --collect-only -q tests/test_plan.py"
    assert shorten("python -m pytest -q -s tests/t.py -k x | grep y") == "python -m pytest -q -s tests/t.py -k x | grep y"
    args = short_train_small_args()
    assert flag_value(args, "--train-iters") == SHORT_ITERS and flag_value(args, "--eval-iters") <= SHORT_EVAL_ITERS
    assert shorten("make train-small") == f'make train-small TRAIN_SMALL_ARGS="{args}"'
    assert shorten('make train-small TRAIN_SMALL_ARGS="--lr 2e-4"') == \
        f'make train-small TRAIN_SMALL_ARGS="--lr 2e-4 {args}"'


OUTSIDE_REFERENCES = re.compile(r"(FORMATS|DESIGN|PERF|STYLE)\.md|\.\./shared|reference/README|the issue")


def test_learner_facing_text_names_nothing_outside_the_repository():
    """Readers have this repository and nothing else: no notes, issue texts or folders around it."""
    found = []
    for folder in ("chapters", "notebooks", "docs", "."):
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            path = os.path.join(folder, name)
            if (folder != "." or name == "README.md") and name.endswith((".md", ".ipynb")):
                with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                    found += [f"{path}:{i}: {line.strip()}" for i, line in enumerate(f, 1)
                              if OUTSIDE_REFERENCES.search(line)]
    assert not found, "\n".join(found)


def test_every_test_the_text_names_exists():
    """A chapter that says "tests/test_x.py::test_y checks this" points at a test that exists (tests are
    merged and renamed as the suite changes)."""
    named = set()
    for folder in ("chapters", "docs", "notebooks", "bench", "."):
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if (folder != "." or name == "README.md") and name.endswith((".md", ".ipynb")):
                with open(os.path.join(ROOT, folder, name), encoding="utf-8") as f:
                    named |= {(folder, name, m[0], m[1]) for m in re.findall(r"(tests/\w+\.py)::(\w+)", f.read())}
    missing = []
    for folder, name, path, test in sorted(named):
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            if not re.search(rf"^def {test}\b", f.read(), re.M):
                missing.append(f"{folder}/{name}: {path}::{test}")
    assert named and not missing, "\n".join(missing)


def test_every_training_run_in_the_text_can_run_twice():
    """A learner runs a block again: a training command with --save D then meets its own checkpoints in D,
    which the trainer refuses to write over unless the run resumes from them (--load D), starts over
    (--overwrite-save), or the block removes D first (rm -rf D before the command)."""
    for path in DOCUMENTS:
        for line, text, _ in runnable_blocks(path):
            removed = []
            for command in commands(text):
                removed += [word for m in re.finditer(r"\brm -rf ([^;&|\n]+)", command) for word in m[1].split()]
                save, load = (re.search(rf"{flag}[ =](\S+)", command) for flag in ("--save", "--load"))
                if "minibert/train.py" not in command or save is None or "--overwrite-save" in command:
                    continue
                assert (load and load[1] == save[1]) or any(f"{save[1]}/".startswith(f"{r}/") for r in removed), \
                    f"{path}:{line}: --save {save[1]} would refuse a second run: rm -rf it first in the block"


@pytest.mark.parametrize("relative_path", [d for d in DOCUMENTS if d.startswith("chapters")])
def test_chapter_shape(relative_path):
    """Each chapter opens with what you will learn and the tools it needs, and has a "Run it now"
    section with commands to run and exercises that say what to expect; each lesson (chapters 1-8) shows
    at least one figure and ends with a recap (before any appendix)."""
    with open(os.path.join(ROOT, relative_path), encoding="utf-8") as f:
        sections = f.read().split("\n## ")
    assert "**What you will learn**" in sections[0] and "**Tools**" in sections[0], relative_path
    run_it_now = [s for s in sections[1:] if "Run it now" in s.split("\n", 1)[0]]
    assert len(run_it_now) == 1, f"{relative_path}: no (or more than one) 'Run it now' section"
    assert MARKER in run_it_now[0], f"{relative_path}: 'Run it now' has no runnable commands"
    assert "**Try this**" in run_it_now[0], f"{relative_path}: 'Run it now' has no exercises"
    if not os.path.basename(relative_path).startswith("00"):
        titles = [section.split("\n", 1)[0] for section in sections[1:]]
        assert "Recap" in titles, f"{relative_path}: no '## Recap' section"
        assert all(t == "Recap" or t.startswith("Appendix") for t in titles[titles.index("Recap"):]), \
            f"{relative_path}: only appendices may follow the recap"
        assert "](figures/" in "".join(sections), f"{relative_path}: no figure"
