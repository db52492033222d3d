"""Where a training step's wall clock goes between the host and the GPU, phase by phase.

bench/profile_steps.py sums kernel times; the wall clock can be longer, by the time the GPU waits for the
host. This script finds where that wait sits. It runs the trainer's own train_step (the same builders, levers and
batches as bench/train_bench.py) and marks six points of each step twice: the host's clock
(time.perf_counter) and a CUDA event queued on the stream at the same moment, whose time is when the GPU
reached that point of its queue:

    start -> batches (next_batches: get_batch and the copies to the GPU)
          -> queued (the schedule: every micro-batch's forward and backward queued, or replayed)
          -> status (the gradient reduction and norm queued, up to the host sync that reads them)
          -> adam   (the sync returned: the host read the norm; clipping queued)
          -> end    (AdamW and the copy back to the 16-bit weights queued)

For each span the table gives the host's ms and the GPU's ms. Where the GPU's span is longer than the
kernels it holds, the GPU was idle waiting for the host's next call; a span whose GPU time equals its
host time while the host was the slower side is that wait:

    python bench/step_timeline.py --work-dir /tmp/tl --output step_timeline.md [--only base]
"""
import argparse
import functools
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import minibert.train as train_module  # noqa: E402
from bench import train_bench  # noqa: E402
from bench.train_bench_data import stream_batches  # noqa: E402
from minibert.atomic import atomic_write  # noqa: E402
from minibert.config import Config  # noqa: E402
from minibert.data.batches import PrefetchingBatches  # noqa: E402

POINTS = ("start", "batches", "queued", "status", "adam", "end")


class Marks:
    """One step's marks: point -> (host seconds, CUDA event)."""

    def __init__(self):
        self.steps = []

    def mark(self, point):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        if point == "start":
            self.steps.append({})
        self.steps[-1][point] = (time.perf_counter(), event)

    def spans(self, skip):
        """-> {span name: (mean host ms, mean GPU ms)} over the steps after the first `skip`, and the mean
        step (start to next start) on both clocks."""
        torch.cuda.synchronize()
        steps = self.steps[skip:]
        rows = {}
        for a, b in zip(POINTS, POINTS[1:]):
            host = [1e3 * (s[b][0] - s[a][0]) for s in steps]
            gpu = [s[a][1].elapsed_time(s[b][1]) for s in steps]
            rows[f"{a} -> {b}"] = (sum(host) / len(host), sum(gpu) / len(gpu))
        host = [1e3 * (n["start"][0] - s["end"][0]) for s, n in zip(steps, steps[1:])]
        gpu = [s["end"][1].elapsed_time(n["start"][1]) for s, n in zip(steps, steps[1:])]
        rows["end -> next start (the bench loop)"] = (sum(host) / len(host), sum(gpu) / len(gpu))
        host = [1e3 * (n["start"][0] - s["start"][0]) for s, n in zip(steps, steps[1:])]
        gpu = [s["start"][1].elapsed_time(n["start"][1]) for s, n in zip(steps, steps[1:])]
        rows["whole step"] = (sum(host) / len(host), sum(gpu) / len(gpu))
        return rows


def wrap(owner, name, marks, before=None, after=None):
    """Replace owner.name by a version that marks `before` on entry and `after` on exit; -> undo()."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def marked(*args, **kwargs):
        if before:
            marks.mark(before)
        result = original(*args, **kwargs)
        if after:
            marks.mark(after)
        return result
    setattr(owner, name, marked)
    return lambda: setattr(owner, name, original)


def timeline(case, overrides, work_dir, steps=12, skip=4):
    """-> the spans of `steps` steps of one case (train_bench's shapes and corpus) after 4 warm-up ones."""
    settings = train_bench.Settings(device=torch.device("cuda"), tiny=False, warmup=3, steps=8, work_dir=work_dir)
    cfg = train_bench.minibert_config(case, settings)
    cfg = Config(**{**vars(cfg), **overrides})
    prefix, _ = train_bench.corpus_prefix("default", settings)
    batches = stream_batches(prefix, steps + skip + 4, cfg.micro_batch_size, cfg.seq_length, settings.device)
    torch.manual_seed(train_bench.SEED)
    model, optimizer, scheduler = train_bench.build_as_trainer(cfg, settings.device)  # the levers on, as trained
    model.train()
    marks = Marks()
    undo = [wrap(train_module, "next_batches", marks, "start", "batches"),
            wrap(train_module, "forward_backward_captured", marks, None, "queued"),
            wrap(train_module, "forward_backward_no_pipelining", marks, None, "queued"),
            wrap(optimizer, "_global_status", marks, None, "status"),
            wrap(optimizer, "update", marks, "adam", None),
            wrap(optimizer, "step", marks, None, "end")]
    iterator = PrefetchingBatches(iter(batches))  # as the trainer's (and train_bench's) iterator
    try:
        for _ in range(steps + skip):
            train_module.train_step(model, optimizer, scheduler, iterator, cfg, settings.device)
        return marks.spans(skip)
    finally:
        for restore in undo:
            restore()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", required=True, help="where the corpus is prepared")
    parser.add_argument("--output", required=True, help="the markdown file to write")
    parser.add_argument("--only", choices=["large", "base"], help="run one model")
    args = parser.parse_args()
    os.makedirs(args.work_dir, exist_ok=True)
    lines = ["# A step's spans on the host's clock and the GPU's (bench/step_timeline.py)", "",
             f"- device: {torch.cuda.get_device_name()}; torch {torch.__version__}",
             f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             "- command: `python bench/step_timeline.py --work-dir ... --output ..."
             + (f" --only {args.only}`" if args.only else "`"), ""]
    for case in ("base", "large"):
        if args.only and case != args.only:
            continue
        for label, overrides in (("CUDA graphs", {"cuda_graph_impl": "local"}), ("eager", {})):
            rows = timeline(case, overrides, args.work_dir)
            title = train_bench.model_label(case, train_bench.Settings(torch.device("cuda"), False, 0, 0))
            lines += [f"## {title}, full-length batches, {label}", "", "| span | host ms | GPU ms |", "|---|---|---|"]
            lines += [f"| {name} | {host:.2f} | {gpu:.2f} |" for name, (host, gpu) in rows.items()] + [""]
            print("\n".join(lines[-len(rows) - 4:]), flush=True)
    atomic_write(args.output, lambda f: f.write("\n".join(lines) + "\n"), text=True)


if __name__ == "__main__":
    main()
