"""FP8 against bf16 in whole training runs through minibert/train.py, on one GPU: step time, and the loss
curves of a longer run.

    python bench/fp8_steps.py steps    [--rounds 2] [--iters 30] [--layers-4b 8] [--micro-batches-4b 4,16]
                                       [--global-batch-4b 32] [--output PATH]
    python bench/fp8_steps.py numerics [--iters 1500] [--global-batch 128] [--micro-batch 64] [--lr 2e-4]
                                       [--output PATH] [--logs DIR]

steps: BERT-large (seq 512, micro-batch 32, CUDA graphs) and the 4B preset's layer shape (hidden 2560, 32
heads, seq 512, micro-batch 4 or those of --micro-batches-4b, the recipe's global batch of 32 sequences
(--global-batch-4b); --layers-4b of its 48 layers, so that it fits a GPU with CUDA graphs), each
in bf16, FP8 with delayed scaling and FP8 with tensorwise scaling (hybrid format), the variants alternating
in each round; a run's time is the median of its logged "elapsed time per iteration" after the first two
log intervals (warm-up and capture). The ratio is bf16's time / FP8's (above 1: FP8 is faster).

numerics: BERT-large at seq 128 (--micro-batch, --global-batch sequences a step, peak --lr with 10% warm-up,
CUDA graphs) for --iters iterations on the long-document corpus, five runs one after another: bf16 (seed
1234), bf16 with seed 4321 (how far apart two runs end that differ in nothing that matters), FP8 delayed,
FP8 tensorwise, and a negative control that must fail (e4m3 for the gradients too, every scale 2^16 too
small: --fp8-format e4m3 --fp8-margin 16), the last three from seed 1234. Each run is compared with bf16 by
the mean lm loss and lm acc of its last 100 iterations: within 1.5% (relative), and within the seeds'
spread. The defaults leave the loss plateau within 1,500 iterations (a smaller batch or another learning
rate may not, and then no comparison means anything: bench/results/fp8_numerics*). Each run's log is kept
in --logs (chapters/figures draws the curves from the results file).

The corpus is minibert.data.corpus --long-documents, preprocessed once into --work-dir."""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

VOCAB = os.path.join(ROOT, "minibert", "vocab", "bert-base-uncased-vocab.txt")
VARIANTS = {"bf16": [], "fp8 delayed": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
            "fp8 tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]}
CONTROL = ("fp8, scales 2^16 too small (control)", ["--fp8-format", "e4m3", "--fp8-margin", "16"])
LINE = re.compile(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([\d.]+).*?lm loss: ([\d.E+-]+)"
                  r".*?lm acc: ([\d.]+)")


def shape(layers, hidden, heads, seq, micro, global_batch=None):
    return ["--num-layers", layers, "--hidden-size", hidden, "--num-attention-heads", heads, "--seq-length", seq,
            "--max-position-embeddings", 512, "--micro-batch-size", micro,
            "--global-batch-size", max(global_batch or micro, micro)]


def train(args, data, iters, log_interval, log_path=None, lr=1e-4, seed=1234):
    """Run minibert/train.py; -> [(iteration, ms per iteration, lm loss, lm acc)] of its log lines."""
    command = [sys.executable, os.path.join(ROOT, "minibert", "train.py"), "--bf16", "--train-iters", iters,
               "--lr", lr, "--lr-warmup-fraction", "0.1", "--min-lr", "1e-5", "--lr-decay-iters", iters,
               "--data-path", data, "--vocab-file", VOCAB, "--split", "980,10,10", "--log-interval", log_interval,
               "--eval-iters", 0, "--seed", seed, *args]
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, cwd=ROOT)
    if log_path:
        with open(log_path, "w") as f:
            f.write("$ " + " ".join(str(c) for c in command[1:]) + "\n" + result.stdout + result.stderr)
    rows = [(int(i), float(ms), float(loss), float(acc)) for i, ms, loss, acc in LINE.findall(result.stdout)]
    if result.returncode != 0 or not rows:
        print(f"  failed ({result.returncode}): {result.stderr.strip().splitlines()[-1:] }", flush=True)
    return rows


def steps(args, data, out):
    models = [(f"4B layer shape x {args.layers_4b} layers, seq 512, micro-batch {micro}, global batch "
               f"{max(args.global_batch_4b, micro)}, CUDA graphs",
               shape(args.layers_4b, 2560, 32, 512, micro, args.global_batch_4b) + ["--cuda-graph-impl", "local"])
              for micro in args.micro_batches_4b]
    models.append(("BERT-large, seq 512, micro-batch 32, CUDA graphs", shape(24, 1024, 16, 512, 32)
                   + ["--cuda-graph-impl", "local"]))
    times = {}
    for round_ in range(args.rounds):
        for model, flags in models:
            for variant, extra in VARIANTS.items():
                rows = train(flags + extra, data, args.iters, 5)
                ms = statistics.median(r[1] for r in rows[2:]) if len(rows) > 2 else float("nan")
                times.setdefault((model, variant), []).append(ms)
                print(f"round {round_ + 1}: {model}, {variant}: {ms:.1f} ms per iteration", flush=True)
    lines = ["| model | variant | ms per iteration (each round) | median | bf16 / this |", "|---|---|---|---|---|"]
    for (model, variant), values in times.items():
        median = statistics.median(values)
        base = statistics.median(times[model, "bf16"])
        lines.append(f"| {model} | {variant} | {', '.join(f'{v:.1f}' for v in values)} | {median:.1f} | "
                     f"{base / median:.3f} |")
    out.write("\n".join(lines) + "\n")


# (name, file slug, extra flags, seed) of the numerics runs; the second bf16 seed measures how far two runs
# that differ in nothing that matters already end apart: the check's noise floor
NUMERICS = [("bf16", "bf16", [], 1234), ("bf16, seed 4321", "bf16_seed4321", [], 4321),
            ("fp8 delayed", "fp8_delayed", VARIANTS["fp8 delayed"], 1234),
            ("fp8 tensorwise", "fp8_tensorwise", VARIANTS["fp8 tensorwise"], 1234),
            (CONTROL[0], "fp8_control", CONTROL[1], 1234)]


def check(last, iters, tolerance=0.015):
    """The numerics table from {run name: (mean lm loss, mean lm acc) of its last 100 iterations, or None}:
    each run against bf16 (seed 1234), judged two ways: within `tolerance` (relative), and within the spread
    of bf16 against itself with another seed (no farther from bf16 than 'bf16, seed 4321' is, in both)."""
    base, other = last.get("bf16"), last.get("bf16, seed 4321")
    spread = (abs(other[0] / base[0] - 1), abs(other[1] / base[1] - 1)) if base and other else None
    lines = [f"Mean of the log lines of the last 100 of {iters} iterations (log interval 10), against bf16 "
             f"(seed 1234); checks: within {100 * tolerance:g}% in loss and accuracy, and within the seeds' spread "
             "(no farther from bf16 than bf16 with seed 4321 is)", "",
             f"| run | lm loss | lm acc | loss vs bf16 | acc vs bf16 | within {100 * tolerance:g}% | "
             "within the seeds' spread |", "|---|---|---|---|---|---|---|"]
    for name, value in last.items():
        if value is None or base is None:
            lines.append(f"| {name} | failed | | | | | |")
            continue
        dl, da = value[0] / base[0] - 1, value[1] / base[1] - 1
        close = "pass" if abs(dl) <= tolerance and abs(da) <= tolerance else "FAIL"
        if name == "bf16, seed 4321":
            within = "(the spread)"
        elif name == "bf16" or spread is None:
            within = ""
        else:
            within = "pass" if abs(dl) <= spread[0] and abs(da) <= spread[1] else "FAIL"
        lines.append(f"| {name} | {value[0]:.4f} | {value[1]:.4f} | {100 * dl:+.2f}% | {100 * da:+.2f}% | {close} | "
                     f"{within} |")
    return lines


def last_100(rows, iters):
    """(mean lm loss, mean lm acc) of the log lines of the last 100 iterations, or None."""
    tail = [r for r in rows if r[0] > iters - 100]
    return (statistics.mean(r[2] for r in tail), statistics.mean(r[3] for r in tail)) if tail else None


def numerics(args, data, out):
    flags = shape(24, 1024, 16, 128, args.micro_batch, args.global_batch) + ["--cuda-graph-impl", "local"]
    os.makedirs(args.logs, exist_ok=True)
    last = {}
    for name, slug, extra, seed in NUMERICS:
        start = time.time()
        rows = train(flags + extra, data, args.iters, 10, os.path.join(args.logs, f"fp8_numerics_{slug}.log"),
                     args.lr, seed)
        last[name] = last_100(rows, args.iters)
        print(f"{name}: {len(rows)} log lines in {time.time() - start:.0f} s; last 100: {last[name]}", flush=True)
    out.write("\n".join(check(last, args.iters)) + "\n")


def run():
    """bench/run.py's rows: BERT-large steps (seq 512, micro-batch 32, CUDA graphs), bf16 against FP8 with
    each recipe, 20 iterations each."""
    from bench.train_bench_data import prepare_corpus
    work_dir = os.path.join(ROOT, "runs", "fp8-bench")
    os.makedirs(work_dir, exist_ok=True)
    data, _ = prepare_corpus("long", None, work_dir, tiny=False)
    flags = shape(24, 1024, 16, 512, 32) + ["--cuda-graph-impl", "local"]
    ms = {}
    for variant, extra in VARIANTS.items():
        rows = train(flags + extra, data, 20, 5)
        ms[variant] = statistics.median(r[1] for r in rows[2:]) if len(rows) > 2 else float("nan")
    return [{"name": f"BERT-large step, {variant}", "value": ms[variant], "unit": "ms",
             "notes": f"bf16 / this = {ms['bf16'] / ms[variant]:.3f}; seq 512, micro-batch 32, CUDA graphs, hybrid"}
            for variant in VARIANTS]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["steps", "numerics"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iters", type=int, default=None, help="iterations a run (steps: 30, numerics: 1500)")
    parser.add_argument("--layers-4b", type=int, default=8)
    parser.add_argument("--micro-batches-4b", type=lambda text: [int(v) for v in text.split(",")], default=[4],
                        help="steps: the 4B layer shape's micro-batch sizes, comma-separated (default 4)")
    parser.add_argument("--global-batch-4b", type=int, default=32,
                        help="steps: the 4B rows' global batch (default 32, examples/bert_4b.sh's: 8 micro-batches "
                             "of 4 a step on one GPU); a micro-batch larger than it makes a step of one micro-batch")
    parser.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "fp8-bench"))
    parser.add_argument("--logs", default=None, help="numerics: where each run's log goes (default: the work dir)")
    parser.add_argument("--global-batch", type=int, default=128, help="numerics: sequences a step (default 128)")
    parser.add_argument("--micro-batch", type=int, default=64, help="numerics: sequences a micro-batch (default 64)")
    parser.add_argument("--lr", type=float, default=2e-4, help="numerics: the peak learning rate (default 2e-4)")
    parser.add_argument("--output", default=None, help="also append the table to this file")
    args = parser.parse_args(argv)
    args.iters = args.iters or (30 if args.what == "steps" else 1500)
    args.logs = args.logs or args.work_dir
    os.makedirs(args.work_dir, exist_ok=True)
    from bench.train_bench_data import prepare_corpus
    data, _ = prepare_corpus("long", None, args.work_dir, tiny=False)

    class Tee:
        def write(self, text):
            print(text, end="", flush=True)
            if args.output:
                with open(args.output, "a") as f:
                    f.write(text)
    (steps if args.what == "steps" else numerics)(args, data, Tee())


if __name__ == "__main__":
    main()
