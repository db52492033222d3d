"""Where a training step's GPU time goes, kernel by kernel, for minibert and its peers side by side.

bench/train_bench.py says how fast each contender is; this says why. Each contender (the same builders,
configs and batches as train_bench) takes 3 warm-up steps, 4 timed ones (wall clock), then 2 steps under
the torch profiler. Every kernel of the profiled steps is put in one category by its name (matrix
multiplies, attention, LayerNorm, cross entropy, the optimizer, elementwise, reductions, copies and
indexing, compiled Triton kernels) and the table gives ms per step for each, next to the wall clock:

    python bench/profile_steps.py --work-dir /tmp/prof --output profile_steps.md [--only base]

Cases: "large" (BERT-large s512 b32, full length) and "base" (BERT-base s128 b256, full length), each
for minibert (its levers on as the trainer turns them on), minibert with CUDA graphs, HF eager and HF
compiled; and "default" (BERT-large s512 b32 on Megatron's samples of the default corpus: minibert
packed, and with CUDA graphs); and, only when named
(--only accumulation), minibert packed on the default corpus and on full-length batches with 1 and with 8
micro-batches per optimizer step, every kernel's time divided by the micro-batches per step
(bench/notes/accumulation.md). A graphed contender
gives its wall clock only, which shows the host's share next to the eager one's; the profiler's view of
a graph replay is left out. The
categories come from kernel names (a heuristic that a new library version may need extending: the
"other" row shows what it missed). bench/notes/training.md reads the results."""
import argparse
import os
import sys
import time
from collections import defaultdict

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench import train_bench  # noqa: E402
from bench.train_bench_data import megatron_batches, stream_batches  # noqa: E402
from minibert.atomic import atomic_write  # noqa: E402
from minibert.config import Config  # noqa: E402

CATEGORIES = [  # (category, substrings of the kernel name, lower case), first match wins
    ("attention", ("attention", "flash", "fmha", "cudnn", "sdpa")),
    ("LayerNorm", ("layer_norm", "layernorm", "add_ln")),
    ("optimizer (AdamW, grad norm)", ("multi_tensor", "adam", "foreach", "lpnorm")),
    ("compiled (Inductor's Triton kernels)", ("triton_",)),
    ("matrix multiplies", ("nvjet", "gemm", "cutlass", "xmma", "cublas", "splitk")),
    ("cross entropy", ("cross_entropy", "log_softmax", "nll_loss", "logsumexp")),
    ("softmax", ("softmax",)),
    ("copies and indexing", ("copy", "cat", "index", "scatter", "gather", "memcpy", "memset", "fill")),
    ("reductions", ("reduce",)),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
]


def category(kernel_name):
    name = kernel_name.lower()
    return next((label for label, keys in CATEGORIES if any(k in name for k in keys)), "other")


def profile(contender, cfg, batches, warmup=3, timed=4, profiled=2):
    """-> (wall ms per step, {kernel name: ms per step}) of one contender over `batches`."""
    build, overrides = train_bench.CONTENDERS[contender]
    cfg = Config(**{**vars(cfg), **overrides})
    torch.manual_seed(train_bench.SEED)
    step = build(cfg, list(batches) * 2, torch.device("cuda"))
    graphed = cfg.cuda_graph_impl == "local"
    for _ in range(len(batches) if graphed else warmup):  # graphs: capture every shape before the clock
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(timed):
        step()
    torch.cuda.synchronize()
    wall = 1e3 * (time.perf_counter() - start) / timed
    if graphed:
        return wall, {}
    kernels = defaultdict(float)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled):
            step()
        torch.cuda.synchronize()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += event.time_range.elapsed_us() / 1e3 / profiled
    del step
    if contender == "HF compiled":
        torch.compiler.reset()
    return wall, dict(kernels)


def accumulation_tables(settings, prefix, per_steps=(1, 8)):
    """minibert packed (eager) on the default corpus's samples and on full-length batches, BERT-large s512 b32,
    with each count of micro-batches per optimizer step: kernel times per micro-batch, so that the optimizer's
    share (once per step) and the main-grad fold's (after every micro-batch but the first) can be compared."""
    _, _, _, seq, micro = train_bench.shape("large", settings)
    lines = []
    for case in ("default", "full"):
        for per_step in per_steps:
            cfg = train_bench.minibert_config("large", settings, global_batch_size=micro * per_step)
            count = 9 * per_step  # profile()'s 3 warm-up + 4 timed + 2 profiled steps
            batches = (megatron_batches(prefix, count, cfg, settings.device) if case == "default"
                       else stream_batches(prefix, count, micro, seq, settings.device))
            profiled = batches[7 * per_step:]  # the last 2 steps' micro-batches
            real = sum(int((b["padding_mask"] == 1).sum()) for b in profiled) / len(profiled)
            wall, kernels = profile("minibert packed", cfg, batches)
            per_micro_batch = {name: ms / per_step for name, ms in kernels.items()}
            title = (f"{case}: x{per_step}, ms per MICRO-BATCH (wall {wall / per_step:.1f} ms per micro-batch; "
                     f"{real:.0f} real tokens per profiled micro-batch)")
            lines += tables(title, {f"x{per_step}": (wall / per_step, per_micro_batch)})
            torch.cuda.empty_cache()
    return lines


def tables(title, results):
    """Markdown: the categories per contender (ms per step), then each contender's top kernels."""
    names = list(results)
    by_category = {n: defaultdict(float) for n in names}
    for n in names:
        for kernel, ms in results[n][1].items():
            by_category[n][category(kernel)] += ms
    order = [c for c, _ in CATEGORIES] + ["other"]
    lines = [f"## {title}", "", "| ms per step | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|",
             "| wall clock | " + " | ".join(f"{results[n][0]:.1f}" for n in names) + " |",
             "| all kernels | " + " | ".join(f"{sum(results[n][1].values()):.1f}" for n in names) + " |"]
    for c in order:
        if any(by_category[n][c] for n in names):
            lines.append(f"| {c} | " + " | ".join(f"{by_category[n][c]:.2f}" for n in names) + " |")
    lines.append("")
    for n in names:
        if not results[n][1]:
            continue
        top = sorted(results[n][1].items(), key=lambda kv: -kv[1])[:15]
        lines += [f"{n}, its 15 longest kernels (ms per step):", "", "| kernel | category | ms |", "|---|---|---|"]
        lines += [f"| `{k[:90].replace('|', '/')}` | {category(k)} | {ms:.2f} |" for k, ms in top] + [""]
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", required=True, help="where the corpora are prepared")
    parser.add_argument("--output", required=True, help="the markdown file to write")
    parser.add_argument("--only", choices=["large", "base", "default", "accumulation"],
                        help="run one case (accumulation runs only when named)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: profile_steps.py profiles GPU kernels; run it on a machine with a CUDA GPU")
    os.makedirs(args.work_dir, exist_ok=True)
    settings = train_bench.Settings(torch.device("cuda"), tiny=False, warmup=3, steps=4, work_dir=args.work_dir)
    prefix, _ = train_bench.corpus_prefix("default", settings)
    lines = ["# Where the step's GPU time goes (bench/profile_steps.py)", "",
             f"- device: {torch.cuda.get_device_name()}; {train_bench.versions()}",
             f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"- command: `python bench/profile_steps.py --work-dir {args.work_dir} --output {args.output}"
             + (f" --only {args.only}`" if args.only else "`"), ""]
    for case in ("large", "base"):
        if args.only in (None, case):
            cfg = train_bench.minibert_config(case, settings)
            _, _, _, seq, micro = train_bench.shape(case, settings)
            batches = stream_batches(prefix, 9, micro, seq, settings.device)
            results = {c: profile(c, cfg, batches)
                       for c in ("minibert", "minibert, CUDA graphs", "HF eager", "HF compiled")}
            lines += tables(f"{train_bench.model_label(case, settings)}, full-length batches, bf16", results)
    if args.only in (None, "default"):
        cfg = train_bench.minibert_config("large", settings)
        batches = megatron_batches(prefix, 9, cfg, settings.device)
        results = {c: profile(c, cfg, batches) for c in ("minibert packed", "minibert packed, CUDA graphs")}
        lines += tables("BERT-large s512 b32, Megatron samples of the default corpus, bf16", results)
    if args.only == "accumulation":
        lines += accumulation_tables(settings, prefix)
    text = "\n".join(lines) + "\n"
    atomic_write(args.output, lambda f: f.write(text), text=True, make_dirs=True)
    print(text)


if __name__ == "__main__":
    main()
