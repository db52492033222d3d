"""Every kernel of minibert's BERT-base step with its full name and launches, then the operators that
launched the most GPU time (by input shapes): the detail bench/profile_steps.py's categories leave out.

    python bench/kernel_table.py --work-dir /tmp/pk [--graphs] > kernels.txt
"""
import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench import train_bench  # noqa: E402
from bench.train_bench_data import stream_batches  # noqa: E402

SMALL_OPS = ("aten::fill_", "aten::zero_", "aten::ones", "aten::new_ones", "aten::zeros", "aten::copy_",
             "aten::mul_", "aten::add_")


def kernel_ms(prof, per):
    """{kernel name: [ms, launches]} of a profile's GPU kernels, both divided by `per` (steps, layers)."""
    kernels = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(event.name, [0.0, 0])
            entry[0] += event.time_range.elapsed_us() / (1e3 * per)
            entry[1] += 1 / per
    return kernels


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", required=True, help="where the corpus is prepared")
    parser.add_argument("--case", default="base", choices=["base", "large"])
    parser.add_argument("--graphs", action="store_true", help="--cuda-graph-impl local: profile the replays")
    args = parser.parse_args()
    os.makedirs(args.work_dir, exist_ok=True)
    settings = train_bench.Settings(torch.device("cuda"), tiny=False, warmup=3, steps=4, work_dir=args.work_dir)
    prefix, _ = train_bench.corpus_prefix("default", settings)
    cfg = train_bench.minibert_config(args.case, settings, **({"cuda_graph_impl": "local"} if args.graphs else {}))
    _, _, _, seq, micro = train_bench.shape(args.case, settings)
    step = train_bench.minibert_stepper(cfg, stream_batches(prefix, 12, micro, seq, settings.device), settings.device)
    for _ in range(4):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    kernels = kernel_ms(prof, per=2)
    print(f"all kernels: {sum(ms for ms, _ in kernels.values()):.2f} ms per step")
    for name, (ms, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:45]:
        print(f"{ms:7.3f} ms {round(count):5d}x  {name[:260]}")
    averages = prof.key_averages(group_by_input_shape=True)
    print(averages.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=40,
                         max_shapes_column_width=80))
    # the small operators the table above cuts off: fills and copies, each with its shapes and its caller
    print("fills and copies (ms per step, launches per step, input shapes):")
    small = [a for a in averages if a.key in SMALL_OPS]
    for a in sorted(small, key=lambda a: -a.self_device_time_total):
        print(f"{a.self_device_time_total / 2e3:7.3f} ms {a.count // 2:5d}x  {a.key:16s} {a.input_shapes}")


if __name__ == "__main__":
    main()
