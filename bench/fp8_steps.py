"""FP8 against bf16 in whole training runs through minibert/train.py, on one GPU: step time, and the loss
curves of a longer run.

    python bench/fp8_steps.py steps    [--rounds 2] [--iters 30] [--layers-4b 8] [--micro-batches-4b 4,16]
                                       [--global-batch-4b 32] [--output PATH]
    python bench/fp8_steps.py numerics [--iters 1500] [--global-batch 16] [--micro-batch 16] [--lr 1e-4]
                                       [--output PATH] [--logs DIR]

steps: BERT-large (seq 512, micro-batch 32, CUDA graphs) and the 4B preset's layer shape (hidden 2560, 32
heads, seq 512, micro-batch 4 or those of --micro-batches-4b, the recipe's global batch of 32 sequences
(--global-batch-4b); --layers-4b of its 48 layers, so that it fits a GPU with CUDA graphs), each
in bf16, FP8 with delayed scaling and FP8 with tensorwise scaling (hybrid format), the variants alternating
in each round; a run's time is the median of its logged "elapsed time per iteration" after the first two
log intervals (warm-up and capture). The ratio is bf16's time / FP8's (above 1: FP8 is faster).

numerics: BERT-large at seq 128 (--micro-batch, --global-batch sequences a step, peak --lr, CUDA graphs) for
--iters iterations on the long-document corpus from one seed, in bf16, FP8 delayed, FP8 tensorwise, and a negative
control that must fail the check (e4m3 for the gradients too, every scale 2^16 too small: --fp8-format e4m3
--fp8-margin 16). The check: the mean lm loss and lm acc of the last 100 iterations within 1.5% (relative)
of bf16's, which means something only once the runs have left the loss plateau (bench/results/fp8_numerics_*).
Each run's log is kept in --logs (chapters/figures draws the curves from them).

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


def train(args, data, iters, log_interval, log_path=None, lr=1e-4):
    """Run minibert/train.py; -> [(iteration, ms per iteration, lm loss, lm acc)] of its log lines."""
    command = [sys.executable, os.path.join(ROOT, "minibert", "train.py"), "--bf16", "--train-iters", iters,
               "--lr", lr, "--lr-warmup-fraction", "0.1", "--min-lr", "1e-5", "--lr-decay-iters", iters,
               "--data-path", data, "--vocab-file", VOCAB, "--split", "980,10,10", "--log-interval", log_interval,
               "--eval-iters", 0, "--seed", 1234, *args]
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


def numerics(args, data, out):
    runs = {**{name: extra for name, extra in VARIANTS.items()}, CONTROL[0]: CONTROL[1]}
    flags = shape(24, 1024, 16, 128, args.micro_batch, args.global_batch) + ["--cuda-graph-impl", "local"]
    os.makedirs(args.logs, exist_ok=True)
    last = {}
    for name, extra in runs.items():
        start = time.time()
        slug = re.sub(r"[^a-z0-9]+", "_", name.split(",")[0].lower()).strip("_") + ("_control" if "control" in name else "")
        rows = train(flags + extra, data, args.iters, 10, os.path.join(args.logs, f"fp8_numerics_{slug}.log"),
                     args.lr)
        tail = [r for r in rows if r[0] > args.iters - 100]
        last[name] = (statistics.mean(r[2] for r in tail), statistics.mean(r[3] for r in tail)) if tail else None
        print(f"{name}: {len(rows)} log lines in {time.time() - start:.0f} s; last 100: {last[name]}", flush=True)
    base = last["bf16"]
    lines = [f"Mean of the log lines of the last 100 of {args.iters} iterations (log interval 10); check: within "
             "1.5% of bf16, loss and accuracy", "", "| run | lm loss | lm acc | loss vs bf16 | acc vs bf16 | check |",
             "|---|---|---|---|---|---|"]
    for name, value in last.items():
        if value is None or base is None:
            lines.append(f"| {name} | failed | | | | |")
            continue
        dl, da = value[0] / base[0] - 1, value[1] / base[1] - 1
        verdict = "pass" if abs(dl) <= 0.015 and abs(da) <= 0.015 else "FAIL"
        lines.append(f"| {name} | {value[0]:.4f} | {value[1]:.4f} | {100 * dl:+.2f}% | {100 * da:+.2f}% | {verdict} |")
    out.write("\n".join(lines) + "\n")


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
    parser.add_argument("--global-batch", type=int, default=16,
                        help="numerics: sequences a step (default 16: one micro-batch)")
    parser.add_argument("--micro-batch", type=int, default=16, help="numerics: sequences a micro-batch (default 16)")
    parser.add_argument("--lr", type=float, default=1e-4, help="numerics: the peak learning rate (default 1e-4)")
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
