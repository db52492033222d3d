"""bench/train_bench.py end to end on the CPU at tiny shapes: every section prints its rows, with finite numbers.

The GPU numbers only mean something on the GPU; this checks that the bench runs through every contender
(HF eager included; HF compiled is skipped on the CPU) and reports what it promises."""
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (section, words every one of its rows must hold, how many rows)
EXPECTED = {
    1: [("minibert, seq/s", 1), ("minibert, real tokens/s", 1), ("minibert, model TFLOP/s", 1),
        ("minibert, MFU", 1), ("HF eager, seq/s", 1), ("HF eager, real tokens/s", 1), ("HF eager, MFU", 1),
        ("minibert / HF eager", 1)],
    2: [("mean real tokens per sample", 3), ("length histogram, median real tokens per sample", 3), ("minibert packed, real tokens/s", 3),
        ("minibert packed, real tokens/s vs full-length", 3), ("minibert padded, real tokens/s", 3),
        ("minibert padded, real tokens/s vs full-length", 3), ("HF eager + mask, real tokens/s", 3),
        ("HF eager + mask, real tokens/s vs full-length", 3)],
    3: [("minibert, seq/s", 1), ("HF eager, seq/s", 1), ("minibert / HF eager", 1)],
    4: [("fp32: ms per iteration, pre-built batches", 1), ("bf16: ms per iteration, pre-built batches", 1),
        ("fp32: ms per iteration, through the DataLoader", 1)],
}


def parse(stdout):
    """-> {section: [(name, value, unit)]} from the '== section N' headers and '  name | value | unit | notes'."""
    sections, current = {}, 0
    for line in stdout.splitlines():
        if line.startswith("== section "):
            current = int(line.split()[2].rstrip(":"))
            sections[current] = []
        elif line.startswith("  ") and line.count(" | ") >= 3:
            name, value, unit = (cell.strip() for cell in line.strip().split(" | ")[:3])
            sections.setdefault(current, []).append((name, value, unit))
    return sections


def test_tiny_cpu_run_prints_every_section():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # ~12 s of CPU; the timeout leaves room for a loaded 2-core machine
    result = subprocess.run([sys.executable, "bench/train_bench.py", "--device", "cpu", "--tiny"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    sections = parse(result.stdout)
    setup = sections[0]
    assert setup[0][0] == "setup" and "transformers" in setup[0][1] and "torch" in setup[0][1]
    assert "HF compiled: skipped on the CPU" in result.stdout
    assert "levers: skipped on the CPU" in result.stdout and sections.get(5) == []  # section 5 is GPU-only
    for number, expected in EXPECTED.items():
        rows = sections[number]
        for words, count in expected:
            matching = [r for r in rows if r[0].endswith(words)]
            assert len(matching) == count, (number, words, rows)
        for name, value, unit in rows:
            number_value = float(value.replace(",", ""))
            assert math.isfinite(number_value) and number_value >= 0, (name, value)
            assert unit, name
