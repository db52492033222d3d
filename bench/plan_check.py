"""The planner's estimates against measured runs on one GPU: memory (torch's max allocated, from the
trainer's memory line) and time per iteration (the trainer's log line), for BERT-large, the 4B preset, a
20B-shaped model with fewer layers (its layers are the 20B's), and BERT-large with full recompute.

    python bench/plan_check.py [--output FILE]        (GPU; ~4 minutes on an H200)

Each configuration runs `python -m minibert.tools.plan ... --nnodes 1 --nproc-per-node 1` and then
`python minibert/train.py` with the same flags on the long-document corpus for a few iterations. The
planner's memory counts weights, grads, optimizer and activations (not the CUDA context or allocator
slack); its time assumes --mfu (default 0.40, an assumption stated in the report)."""
import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [  # name, model flags, iterations, log interval
    ("BERT-large (340m preset), micro 32", ["--preset", "340m", "--micro-batch-size", 32, "--global-batch-size", 32],
     12, 4),
    ("BERT-large, full recompute", ["--preset", "340m", "--micro-batch-size", 32, "--global-batch-size", 32,
                                    "--recompute-granularity", "full", "--recompute-method", "uniform"], 12, 4),
    ("4B preset, micro 4 x 8", ["--preset", "4b", "--micro-batch-size", 4, "--global-batch-size", 32], 4, 2),
    ("20B-shaped, 4 layers, micro 2", ["--num-layers", 4, "--hidden-size", 6144, "--num-attention-heads", 96,
                                       "--seq-length", 512, "--micro-batch-size", 2, "--global-batch-size", 2], 6, 2),
]
COMMON = ["--bf16", "--lr", "1e-4", "--lr-warmup-iters", 0, "--eval-iters", 0, "--split", "1,0,0"]


def python(*args, timeout=600):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", help="write the markdown table here")
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args(argv)
    work = args.work_dir or tempfile.mkdtemp()
    os.makedirs(work, exist_ok=True)
    corpus = os.path.join(work, "long.txt")
    python("-m", "minibert.data.corpus", "--long-documents", "--output", corpus)
    python("minibert/preprocess.py", "--input", corpus, "--output-prefix", os.path.join(work, "long"),
           "--vocab-file", "minibert/vocab/bert-base-uncased-vocab.txt", "--split-sentences", "--workers", 4)
    data = ["--data-path", os.path.join(work, "long_text_sentence")]
    rows = ["| configuration | planner memory | measured max allocated | measured / planner | planner ms/iter "
            "| measured ms/iter | measured / planner | measured MFU |", "|---|---|---|---|---|---|---|---|"]
    for name, flags, iterations, interval in CONFIGS:
        run_flags = flags + COMMON + ["--train-iters", iterations, "--log-interval", interval]
        plan = python("-m", "minibert.tools.plan", *run_flags, "--nnodes", 1, "--nproc-per-node", 1)
        memory = re.search(r"this run: ([\d.]+) of", plan.stdout)
        step = re.search(r"= step\s+([\d.]+) ms", plan.stdout)
        train = python("minibert/train.py", *run_flags, *data)
        logs = re.findall(r"elapsed time per iteration \(ms\): ([\d.]+) .*?MFU: ([\d.]+)%", train.stdout)
        allocated = re.search(r"max allocated: ([\d.]+)", train.stdout)
        if plan.returncode or train.returncode or not (memory and step and logs and allocated):
            print(f"{name}: planner rc {plan.returncode}, train rc {train.returncode}\n{plan.stderr[-1500:]}\n"
                  f"{train.stderr[-3000:]}", flush=True)
            rows.append(f"| {name} | failed | | | | | | |")
            continue
        planned_gib, planned_ms = float(memory[1]), float(step[1])
        measured_gib = float(allocated[1]) / 1024  # the memory line is in MB (2^20 bytes)
        measured_ms, mfu = float(logs[-1][0]), float(logs[-1][1])
        rows.append(f"| {name} | {planned_gib:.1f} GiB | {measured_gib:.1f} GiB | {measured_gib / planned_gib:.2f} "
                    f"| {planned_ms:.0f} | {measured_ms:.0f} | {measured_ms / planned_ms:.2f} | {mfu:.1f}% |")
        print(rows[-1], flush=True)
    text = "\n".join(rows) + "\n"
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
