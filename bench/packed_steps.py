"""Where a packed BERT-large step's time goes: wall clock against GPU work, per variant, on the GPU.

A step is GPU-bound when its wall time is about its kernels' time, host-bound (Python, autograd and
launches, or a synchronisation) when the wall time is longer. For packed micro-batches of two kinds
(synthetic lengths U[128, 512], Megatron samples of the default corpus) and the padded twin, each variant
is timed as bench/train_bench.py times contenders (3 warm-up and 8 timed steps), then two more steps run
under the torch profiler, whose summed kernel time is the GPU work per step. One step also runs under
torch.cuda.set_sync_debug_mode("warn"), which counts the operations that make the host wait for the GPU.

    python bench/packed_steps.py --work-dir /tmp/tb --output packed_steps.md

Variants (PLAN says which run on which batches): packed (the trainer's default: the varlen flash kernel
reads the packed rows) and the same again (the spread of one configuration), packed through the scatter
route (attention on a zeroed [b, s', 3h] buffer, and the 85% rule, as every non-flash backend runs), packed with the fused
LayerNorm off, with Python's automatic garbage collector off, padded (--no-pack-tokens), and packed with
--cuda-graph-impl local (one graph replay per micro-batch; its profiled steps may meet a new row count,
whose capture then shows in their kernel time). Full-length
batches have nothing to pack: there "packed" is the trainer's default path on them.
bench/notes/packing.md reads the results."""
import argparse
import gc
import os
import sys
import warnings

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import minibert.data.batches as batches_module  # noqa: E402
import minibert.model.bert as model_module  # noqa: E402
import minibert.train as train_module  # noqa: E402
from bench import train_bench  # noqa: E402
from bench.train_bench_data import megatron_batches, stream_batches  # noqa: E402
from minibert.config import Config  # noqa: E402
from minibert.model import attention  # noqa: E402
from minibert.train import train_step  # noqa: E402

VARIANTS = {  # name -> (config overrides, attention through the scatter route, automatic gc off)
    "packed (varlen flash)": ({}, False, False),
    "packed, again": ({}, False, False),
    "packed, scatter route": ({}, True, False),
    "packed, --no-bias-dropout-fusion": ({"bias_dropout_fusion": False}, False, False),
    "packed, both fusions off": ({"bias_dropout_fusion": False, "cross_entropy_loss_fusion": False}, False, False),
    "packed, gc off": ({}, False, True),
    "packed, gc off, --no-bias-dropout-fusion": ({"bias_dropout_fusion": False}, False, True),
    "padded (--no-pack-tokens)": ({"pack_tokens": False}, False, False),
    "padded, gc off": ({"pack_tokens": False}, False, True),
    "packed, CUDA graphs": ({"cuda_graph_impl": "local"}, False, False),  # a new row count in the profiled
}                                                                          # steps is captured there too
PLAN = {  # batches -> the variants run on them, in this order
    "full length": ["packed (varlen flash)", "packed, again", "packed, gc off"],
    "long-document corpus": ["packed (varlen flash)", "padded (--no-pack-tokens)", "packed, gc off",
                             "padded, gc off"],
    "U[128,512]": ["packed (varlen flash)", "packed, scatter route", "packed, gc off", "packed, CUDA graphs"],
    "default corpus": ["packed (varlen flash)", "packed, again", "packed, --no-bias-dropout-fusion",
                       "packed, gc off", "packed, gc off, --no-bias-dropout-fusion", "padded (--no-pack-tokens)",
                       "packed, CUDA graphs"],
}


def use_scatter_route(on):
    """Make the flash backend take the scatter route of every other backend (on) or its own varlen route:
    the one decision, attention.reads_packed_rows, as the model and the trainer's get_batch imported it."""
    decide = (lambda backend: False) if on else attention.reads_packed_rows
    model_module.reads_packed_rows = train_module.reads_packed_rows = decide


def kernel_ms_per_step(cfg, batches, device, steps=2, cpu_table=False):
    """Summed kernel time per step over `steps` profiled steps (after the timed ones warmed everything)."""
    model, optimizer, scheduler = train_bench.build_as_trainer(cfg, device)  # the levers on, as trained
    model.train()
    iterator = batches_module.PrefetchingBatches(iter(batches))  # as the trainer's
    for _ in range(3):
        train_step(model, optimizer, scheduler, iterator, cfg, device)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        train_step(model, optimizer, scheduler, iterator, cfg, device)
        torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            train_step(model, optimizer, scheduler, iterator, cfg, device)
        torch.cuda.synchronize()
    if cpu_table:  # the host's side: which operators cost the most CPU time (printed, not in the table)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    total = sum(e.time_range.elapsed_us() for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA)  # kernels and copies, microseconds
    return total / 1e3 / steps, syncs


def attention_kernels(device):
    """The varlen kernel against the padded one on the same samples (U[128,512], b32 h16 d64 bf16, dropout
    0.1): forward + backward, ms per call (triton.testing.do_bench, launched from Python)."""
    from triton.testing import do_bench

    from minibert.data.packing import make_packing, to_device
    from minibert.kernels.flash_attention_packed import flash_attention_qkv
    from minibert.kernels.flash_attention_varlen import flash_attention_varlen
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(128, 513, (32,), generator=g)
    is_pad = torch.arange(512)[None, :] >= lengths[:, None]
    packing = to_device(make_packing(is_pad), device)
    qkv = torch.randn(32, 512, 16, 3, 64, device=device, dtype=torch.bfloat16).requires_grad_()
    rows = qkv.detach().reshape(-1, 16, 3, 64).index_select(0, packing.index).requires_grad_()
    mask = is_pad.to(device)
    grad_padded = torch.randn(32, 16, 512, 64, device=device, dtype=torch.bfloat16)
    grad_rows = torch.randn(rows.shape[0], 16, 64, device=device, dtype=torch.bfloat16)
    padded = do_bench(lambda: flash_attention_qkv(qkv, mask, dropout_p=0.1, seed=1).backward(grad_padded))
    varlen = do_bench(lambda: flash_attention_varlen(rows, packing.cu_seqlens, 512, dropout_p=0.1,
                                                     seed=1).backward(grad_rows))
    return [f"| attention fwd+bwd alone, U[128,512] b32 h16 d64 bf16, dropout 0.1 | padded kernel | {padded:.3f} ms |",
            f"| attention fwd+bwd alone, U[128,512] b32 h16 d64 bf16, dropout 0.1 | varlen kernel | {varlen:.3f} ms |"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    torch.backends.cuda.matmul.allow_tf32 = True
    warmup, steps = train_bench.STEPS["quick"]
    settings = train_bench.Settings(device, False, warmup, steps, work_dir=args.work_dir or "/tmp/packed_steps")
    os.makedirs(settings.work_dir, exist_ok=True)
    cfg = train_bench.minibert_config("large", settings)
    count = train_bench.batches_needed(cfg, settings) + 8  # + the profiled steps
    prefix, _ = train_bench.corpus_prefix("default", settings)
    lengths = np.random.default_rng(train_bench.SEED + 1).integers(128, 513, count * 32)
    long_prefix, _ = train_bench.corpus_prefix("long", settings)
    datasets = {"full length": stream_batches(prefix, count, 32, 512, device),
                "long-document corpus": megatron_batches(long_prefix, count, cfg, device),
                "U[128,512]": stream_batches(prefix, count, 32, 512, device, lengths),
                "default corpus": megatron_batches(prefix, count, cfg, device)}
    lines = ["| batches | variant | wall ms/step | kernel ms/step | wall - kernels | host syncs in one step |",
             "|---|---|---|---|---|---|"]
    for what, names in PLAN.items():
        batches = datasets[what]
        for name in names:
            overrides, scatter, gc_off = VARIANTS[name]
            use_scatter_route(scatter)
            run_cfg = Config(**{**vars(cfg), **overrides})
            if gc_off:
                gc.disable()  # no automatic collections during the steps (measure's gc.collect() still runs)
            try:
                measured, failed = train_bench.attempt("CUDA graphs" in name, f"{what}, {name}", lambda: (
                    train_bench.measure("minibert", run_cfg, batches, settings),
                    kernel_ms_per_step(run_cfg, batches, device,
                                       cpu_table=(what, name) == ("default corpus", "packed, gc off"))))
            finally:
                gc.enable()
            if measured is None:
                line = f"| {what} | {name} | failed: {failed[0]['notes']} | | | |"
            else:
                result, (kernels, syncs) = measured
                wall = 1e3 * result.seconds / result.steps
                line = f"| {what} | {name} | {wall:.1f} | {kernels:.1f} | {wall - kernels:.1f} | {syncs} |"
            print(line, flush=True)
            lines.append(line)
    use_scatter_route(False)
    lines += ["", "| kernel | variant | time |", "|---|---|---|"] + attention_kernels(device)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
