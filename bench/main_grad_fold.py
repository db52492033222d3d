"""How the step's first gradient fold is done, timed both ways in one process (a lever's A/B).

minibert keeps each parameter's gradient in an fp32 main grad. The old way: zero() wrote zeros into the
buffers, and every micro-batch's accumulate() added the 16-bit grads into them (a memset of 4 bytes an
element, then an add that reads 2 + 4 and writes 4). Now zero() writes nothing and the step's first
accumulate() copies (reads 2, writes 4); the later ones add. Both give the same numbers (0 + g = g in
fp32); this times them, alternating, through train_bench's measure() and the trainer's train_step:

    python bench/main_grad_fold.py --work-dir /tmp/fold --output fold.md

Cases: BERT-large s512 b32 on full-length batches and on Megatron's samples of the default corpus, and
BERT-base s128 b256 on full-length batches, each eager and with CUDA graphs. "zero, then add" sets
DataParallelGrads.copy_first to False, the code path --overlap-grad-reduce still takes over several ranks."""
import argparse
import os
import platform
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench import train_bench  # noqa: E402
from bench.train_bench_data import megatron_batches, stream_batches  # noqa: E402
from minibert.atomic import atomic_write  # noqa: E402


def zero_then_add_stepper(cfg, batches, device):
    """train_bench's minibert stepper with the old fold: the buffers zeroed at zero(), every fold an add."""
    model, optimizer, scheduler = train_bench.build_as_trainer(cfg, device)  # the levers on, as trained
    for grads in optimizer.grads:
        grads.copy_first = False
    model.train()
    iterator = train_bench.PrefetchingBatches(iter(batches))  # as train_bench's minibert stepper
    return lambda: train_bench.train_step(model, optimizer, scheduler, iterator, cfg, device).losses["lm loss"]


train_bench.CONTENDERS["zero, then add"] = (zero_then_add_stepper, {})
train_bench.CONTENDERS["zero, then add, CUDA graphs"] = (zero_then_add_stepper, {"cuda_graph_impl": "local"})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", required=True, help="where the default corpus is prepared")
    parser.add_argument("--output", required=True, help="the markdown file to write")
    parser.add_argument("--rounds", type=int, default=2, help="A/B rounds per case (default 2)")
    args = parser.parse_args()
    os.makedirs(args.work_dir, exist_ok=True)
    warmup, steps = train_bench.STEPS["full"]
    settings = train_bench.Settings(torch.device("cuda"), False, warmup, steps, work_dir=args.work_dir)
    prefix, _ = train_bench.corpus_prefix("default", settings)
    lines = ["# The step's first gradient fold: zero then add, or copy (bench/main_grad_fold.py)", "",
             f"- device: {torch.cuda.get_device_name()}; torch {torch.__version__}, Python {platform.python_version()}",
             f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"- {warmup} warm-up and {steps} timed steps per measurement, one micro-batch per step, bf16; "
             f"{args.rounds} rounds, alternating; best of the rounds", "",
             "| case | way | ms per step, each round | best | speed-up of the copy |", "|---|---|---|---|---|"]
    for name, data in (("large", "full-length"), ("large", "default corpus"), ("base", "full-length")):
        cfg = train_bench.minibert_config(name, settings)
        _, _, _, seq, micro = train_bench.shape(name, settings)
        count = train_bench.batches_needed(cfg, settings)
        batches = (stream_batches(prefix, count, micro, seq, settings.device) if data == "full-length"
                   else megatron_batches(prefix, count, cfg, settings.device))
        for graphs in ("", ", CUDA graphs"):
            ways = {"zero, then add": "zero, then add" + graphs, "copy first (now)": "minibert" + graphs}
            times = {way: [] for way in ways}
            for _ in range(args.rounds):
                for way, contender in ways.items():
                    result = train_bench.measure(contender, cfg, batches, settings)
                    times[way].append(1e3 * result.seconds / result.steps)
            case = f"{train_bench.model_label(name, settings)} {data}{' (graphs)' if graphs else ' (eager)'}"
            best = {way: min(t) for way, t in times.items()}
            for way, t in times.items():
                ratio = f"{best['zero, then add'] / best[way]:.3f}x" if way != "zero, then add" else ""
                lines.append(f"| {case} | {way} | {', '.join(f'{x:.2f}' for x in t)} | {best[way]:.2f} | {ratio} |")
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    atomic_write(args.output, lambda f: f.write(text), text=True, make_dirs=True)


if __name__ == "__main__":
    main()
