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
    # the three datasets, then the default corpus again at the full-length run's real tokens per micro-batch,
    # and with several micro-batches per step against a full-length run with the same accumulation
    2: [("mean real tokens per sample", 3), ("length histogram, median real tokens per sample", 3),
        ("minibert packed, real tokens/s", 5), ("minibert packed, real tokens/s vs full-length", 5),
        ("real tokens per micro-batch", 1), ("micro-batches per step, full-length: minibert, real tokens/s", 1),
        ("minibert padded, real tokens/s", 3),
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
    # ~30 s on an idle 2-core machine; the timeout leaves room for a loaded one
    result = subprocess.run([sys.executable, "bench/train_bench.py", "--device", "cpu", "--tiny"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
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


def test_contenders_runs_only_the_named_ones_and_refuses_an_unknown_name():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "bench/train_bench.py", "--device", "cpu", "--tiny", "--sections", "3"]
    result = subprocess.run(command[:-1] + ["2,3", "--contenders", "HF eager"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    sections = parse(result.stdout)
    names = [name for name, _, _ in sections[3]]
    assert names and all(": HF eager, " in name for name in names), names  # no minibert row, no ratio
    # section 2: HF eager + mask on each dataset against its own full-length reference; no minibert row, so
    # neither of the default corpus's packed-only additions (the larger micro-batch, the accumulation)
    names = [name for name, _, _ in sections[2] if "tokens/s" in name]
    assert len(names) == 7 and all("HF eager" in name for name in names), names
    result = subprocess.run(command + ["--contenders", "minibert;HF"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2 and "no contender 'HF'" in result.stderr, result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1


def test_profile_steps_puts_kernels_in_their_categories():
    """bench/profile_steps.py (a GPU script) sorts kernels by name: the names below are from its H200 run
    (bench/results/profile_steps_h200_2026-12-01.md), and the table sums each category per contender."""
    sys.path.insert(0, ROOT)
    from bench.profile_steps import category, tables
    names = {"void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_bf16_256x128_64x3_tn_align2>": "matrix multiplies",
             "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "matrix multiplies",
             "_attention_backward_dq_kernel": "attention",
             "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26": "attention",
             "_dropout_add_ln_bwd_kernel": "LayerNorm",
             "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, false>": "LayerNorm",
             "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous n": "optimizer (AdamW, grad norm)",
             "triton_poi_fused_gelu_gelu_backward_view_7": "compiled (Inductor's Triton kernels)",
             "_cross_entropy_fwd_kernel": "cross entropy",
             "void at::native::vectorized_elementwise_kernel<8, at::native::GeluBackwardCUDAKernelImpl(a": "elementwise",
             "void at::native::reduce_kernel<128, 4, at::native::ReduceOp<c10::BFloat16": "reductions",
             "something new": "other"}
    assert {name: category(name) for name in names} == names
    lines = tables("t", {"a": (10.0, {"nvjet_x": 3.0, "_attention_forward_kernel": 1.5, "nvjet_y": 1.0}),
                         "b | c": (4.0, {})})
    assert "| wall clock | 10.0 | 4.0 |" in lines and "| all kernels | 5.5 | 0.0 |" in lines
    assert "| matrix multiplies | 4.00 | 0.00 |" in lines and "| attention | 1.50 | 0.00 |" in lines
    assert "| `nvjet_x` | matrix multiplies | 3.00 |" in lines and not any("b | c, its" in line for line in lines)


def test_make_bench_only_refuses_an_unknown_section_and_writing_part_over_benchmarks_md(capsys):
    """bench/run.py --only: argument errors in-process (one line, exit 2), before any GPU check."""
    import pytest
    sys.path.insert(0, ROOT)
    from bench import run as bench_run
    with pytest.raises(SystemExit) as stop:
        bench_run.main(["--only", "no such section", "--output", os.path.join(ROOT, "x.md")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "no section's title contains 'no such section'" in err and "FP8" in err
    assert len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as stop:
        bench_run.main(["--only", "FP8"])  # the default --output, BENCHMARKS.md, holds a whole run
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "give it --output PATH" in err and len(err.strip().splitlines()) == 1
    assert [t for t, _ in bench_run.SECTIONS if "fp8" in t.lower()] == [
        "FP8 against bf16, one Linear of each preset's layer (minibert/fast/fp8.py, fp8_cast.py)",
        "FP8 against bf16, whole BERT-large steps (bench/fp8_steps.py)"]


def test_fp8_numerics_check_judges_each_run_by_the_tolerance_and_by_the_seeds_spread():
    sys.path.insert(0, ROOT)
    from bench.fp8_steps import CONTROL, check
    last = {"bf16": (4.0, 0.20), "bf16, seed 4321": (4.16, 0.18),  # the spread: 4% in loss, 10% in accuracy
            "fp8 delayed": (4.08, 0.19), "fp8 tensorwise": (4.04, 0.199), CONTROL[0]: (5.0, 0.19), "broken": None}
    rows = {line.split(" | ")[0].lstrip("| "): [c.strip(" |") for c in line.split(" | ")[1:]]
            for line in check(last, 1500) if line.startswith("| ") and "---" not in line}
    assert rows["fp8 delayed"][2:] == ["+2.00%", "-5.00%", "FAIL", "pass"]  # past 1.5%, inside the seeds' spread
    assert rows["fp8 tensorwise"][4:] == ["pass", "pass"]
    assert rows[CONTROL[0]][2:] == ["+25.00%", "-5.00%", "FAIL", "FAIL"]  # the loss is far outside the spread
    assert rows["bf16, seed 4321"][4:] == ["FAIL", "(the spread)"] and rows["broken"][0] == "failed"
