"""The planner: will this layout run, what does each GPU hold, and about how long is a step?

    python -m minibert.tools.plan [the trainer's flags] --nnodes N --nproc-per-node G [hardware flags]

It takes exactly the flags minibert/train.py takes (the same parser, plus the launch and hardware
flags) and checks them exactly as the trainer will on N x G GPUs, with
minibert.validate.validate(cfg, world_size=N*G, device_type="cuda"). That function stops at the first
problem; the planner first lists *every* broken layout rule, one line each, then exits 2:

    world = TP x PP x DP               heads, hidden and FFN divisible by TP    seq <= max positions
    layers split over the PP stages (or their --decoder-first/last counts)    hidden divisible by heads
    global batch divisible by micro x DP        interleaved: micro-batches per step a multiple of PP
    sequence parallel: seq divisible by TP      FP8: --bf16, hidden and FFN per TP rank multiples of 16

plus the first problem of any other kind (a missing flag, a bad LR schedule), which validate finds on a
copy of the config whose layout has been made valid.

For a layout that runs it prints the exact parameter count (from the shapes minibert's BertModel has),
memory per GPU (plan_memory.py: weights, fp32 grads, optimizer with and without ZeRO-1, activations
with and without recompute, for the most loaded pipeline stage), the pipeline bubble, the bytes each
kind of parallelism moves per step, and a step time from a stated hardware model (plan_time.py; with
--fp8-format, the layers' Linears at an FP8 rate).

What production does: Megatron checks layouts in megatron/training/arguments.py (validate_args, one
assert at a time) and estimates memory in theoretical_memory_usage.py; it ships no step-time model."""
import dataclasses
import os
import sys

if __package__ in (None, ""):  # run as a script from a checkout: make `minibert` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

from minibert.config import PRESETS, Config, build_parser, compute_dtype
from minibert.errors import UsageError, exit_on_usage_error, print_error_line
from minibert.parallel.schedules import layer_ranges
from minibert.tools import plan_memory as pm
from minibert.tools.plan_time import HARDWARE, estimate, spans_nodes
from minibert.training.build import backend_for
from minibert.training.training_log import PEAK_FLOPS, model_flops
from minibert.validate import validate


def build_plan_parser():
    parser = build_parser()
    parser.description = "minibert planner: check a layout, estimate parameters, memory and step time"
    parser.add_argument("--nnodes", type=int, default=1, help="nodes in the run")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="GPUs (processes) per node")
    for name, (default, help_text) in HARDWARE.items():
        parser.add_argument("--" + name.replace("_", "-"), type=float, default=default, help=help_text)
    return parser


# ---------------------------------------------------------------- every problem of a layout
def layout_problems(cfg, world) -> list:
    """Every broken layout rule of a config (its preset applied), one message each."""
    shape = (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.seq_length, cfg.micro_batch_size)
    if None in shape or min(shape) <= 0:
        return []  # validate names the missing or non-positive flag (other_problem)
    tp, pp, problems = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, []
    if tp < 1 or pp < 1:
        return [f"--tensor-model-parallel-size {tp} and --pipeline-model-parallel-size {pp} must be at least 1"]
    dp = world // (tp * pp) if world % (tp * pp) == 0 else None
    if dp is None:
        problems.append(f"TP {tp} x PP {pp} needs {tp * pp} GPUs for one copy of the model, but the run has "
                        f"{world}: launch a multiple of {tp * pp} GPUs (--nnodes x --nproc-per-node), or lower "
                        "--tensor-model-parallel-size / --pipeline-model-parallel-size")
    if cfg.hidden_size % cfg.num_attention_heads:
        problems.append(f"--hidden-size {cfg.hidden_size} must be divisible by --num-attention-heads "
                        f"{cfg.num_attention_heads}")
    for flag, value in (("--num-attention-heads", cfg.num_attention_heads), ("--hidden-size", cfg.hidden_size),
                        ("--ffn-hidden-size", cfg.ffn_size)):
        if value % tp:
            problems.append(f"{flag} {value} must be divisible by --tensor-model-parallel-size {tp}: each TP "
                            "rank holds an equal share of it")
    if cfg.seq_length > cfg.max_positions:
        problems.append(f"--seq-length {cfg.seq_length} is larger than --max-position-embeddings "
                        f"{cfg.max_positions}: raise --max-position-embeddings or lower --seq-length")
    if cfg.sequence_parallel and tp > 1 and cfg.seq_length % tp:
        problems.append(f"--sequence-parallel: --seq-length {cfg.seq_length} must be divisible by "
                        f"--tensor-model-parallel-size {tp}")
    problems += fp8_problems(cfg)
    pipeline = pipeline_problems(cfg)
    problems += pipeline
    if dp is not None:
        global_batch = cfg.global_batch_size or cfg.micro_batch_size * dp
        per_step = cfg.micro_batch_size * dp
        if global_batch % per_step:
            problems.append(f"--global-batch-size {global_batch} must be a multiple of --micro-batch-size x DP "
                            f"= {cfg.micro_batch_size} x {dp} = {per_step}")
        elif not pipeline and cfg.virtual_pipeline_size > 1 and (global_batch // per_step) % pp:
            problems.append(f"the interleaved schedule needs the micro-batches per step ({global_batch // per_step}"
                            f") to be a multiple of --pipeline-model-parallel-size {pp}: change "
                            "--global-batch-size or --micro-batch-size")
    return problems


def fp8_problems(cfg) -> list:
    """validate.py's FP8 rules, in its words (all but its GPU check: the planner's GPU is not the run's)."""
    if cfg.fp8_format is None:
        return []
    tp, problems = cfg.tensor_model_parallel_size, []
    if not cfg.bf16:
        problems.append(f"--fp8-format {cfg.fp8_format} runs the layers' matrix products in FP8 inside a bf16 "
                        "model: add --bf16")
    for flag, size in (("--hidden-size", cfg.hidden_size), ("--ffn-hidden-size", cfg.ffn_size)):
        if size % (16 * tp):
            problems.append(f"--fp8-format: {flag} {size} must be a multiple of 16 x --tensor-model-parallel-size "
                            f"{tp} = {16 * tp} (an FP8 matrix product takes its dimensions in multiples of 16, "
                            "on each tensor-parallel rank)")
    return problems


def pipeline_problems(cfg) -> list:
    layers, pp, lps = cfg.num_layers, cfg.pipeline_model_parallel_size, cfg.num_layers_per_virtual_pipeline_stage
    uneven = cfg.decoder_first_pipeline_num_layers is not None or cfg.decoder_last_pipeline_num_layers is not None
    if lps is not None and (pp < 2 or lps <= 0 or layers % (pp * lps)):
        return [f"--num-layers-per-virtual-pipeline-stage {lps}: the interleaved schedule needs "
                f"--pipeline-model-parallel-size >= 2 and --num-layers {layers} divisible by PP x {lps}"]
    if lps is None and not uneven and layers % pp:
        divisors = ", ".join(str(d) for d in range(1, layers + 1) if layers % d == 0)
        return [f"--num-layers {layers} cannot be split evenly over --pipeline-model-parallel-size {pp} stages: "
                f"use a PP that divides {layers} ({divisors}), or give the first/last stage its own count "
                "(--decoder-first/last-pipeline-num-layers)"]
    try:
        vp = layers // (pp * lps) if lps else 1
        layer_ranges(layers, pp, vp, cfg.decoder_first_pipeline_num_layers, cfg.decoder_last_pipeline_num_layers)
    except ValueError as e:
        return [str(e)]
    return []


def other_problem(cfg) -> list:
    """validate() stops at its first problem, so ask it about the rest on a copy whose layout rules are
    all made true (those are listed by layout_problems): what it finds is a problem of another kind."""
    neutral = dataclasses.replace(cfg, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                  num_layers_per_virtual_pipeline_stage=None, decoder_first_pipeline_num_layers=None,
                                  decoder_last_pipeline_num_layers=None, sequence_parallel=False,
                                  global_batch_size=None, fp8_format=None)
    if neutral.hidden_size and neutral.num_attention_heads and neutral.hidden_size % neutral.num_attention_heads:
        neutral.num_attention_heads = 1
    if neutral.seq_length and neutral.seq_length > neutral.max_positions:
        neutral.max_position_embeddings = neutral.seq_length
    try:
        validate(neutral, world_size=1, device_type="cuda", warn=None)
    except UsageError as e:
        return [str(e)]
    return []


def refuse(problems):
    for message in problems:
        print_error_line("error: " + " ".join(message.split()))
    sys.exit(2)


# ---------------------------------------------------------------- the report
def gib(n):
    return f"{n / pm.GiB:.2f}"


def table(rows) -> str:
    """Rows of cells -> aligned text: the first column left-aligned, the others right-aligned."""
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                                      for i, (c, w) in enumerate(zip(row, widths))).rstrip() for row in rows)


def plural(n, word) -> str:
    return f"{n} {word}" + ("s" if n != 1 else "")


def describe(stage) -> str:
    parts = [f"{stage.layers} layers"] + (["the embedding"] if stage.first else []) + \
            (["the heads" + ("" if stage.first else " and the word-table copy")] if stage.last else [])
    return f"pipeline stage {stage.rank} (" + ", ".join(parts) + ")"


def header(cfg, world, nnodes, gpus_per_node, precision, backend) -> list:
    tp, pp, dp, vp = (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.data_parallel_size,
                      cfg.virtual_pipeline_size)
    lines = [f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads, FFN "
             f"{cfg.ffn_size}, seq {cfg.seq_length}, vocab {cfg.vocab_size} (padded to {cfg.padded_vocab_size}), "
             f"{'post' if cfg.post_ln else 'pre'}-LN, {'no binary head' if cfg.bert_no_binary_head else 'SOP head'}",
             f"layout: {plural(world, 'GPU')} = {plural(nnodes, 'node')} x {plural(gpus_per_node, 'GPU')} = "
             f"TP {tp} x PP {pp} x DP {dp}"
             + (", sequence parallel" if cfg.sequence_parallel else "")
             + (f", interleaved with {vp} model chunks per stage" if vp > 1 else ""),
             f"batch: global {cfg.global_batch_size} = micro {cfg.micro_batch_size} x DP {dp} x "
             f"{cfg.num_micro_batches} micro-batches per step; {precision}"
             + (f" + FP8 ({cfg.fp8_format}, {cfg.fp8_recipe} scaling)" if cfg.fp8_format else "")
             + f"; attention {backend} "
             f"({'keeps no s x s matrix' if backend == 'flash' else 'keeps the s x s scores'})"]
    for kind, size, ranks in (("TP", tp, range(tp)), ("DP", dp, [tp * d for d in range(dp)])):
        if size > 1 and spans_nodes(ranks, gpus_per_node):
            lines.append(f"note: the {kind} group spans nodes, so its collectives run over the network")
    return lines


def memory_section(cfg, stage, tables, backend, precision, hw) -> list:
    dp, low = cfg.data_parallel_size, cfg.fp16 or cfg.bf16
    b, s, h = cfg.micro_batch_size, cfg.seq_length, cfg.hidden_size
    heads = cfg.num_attention_heads // cfg.tensor_model_parallel_size
    mine = (cfg.recompute, cfg.use_distributed_optimizer)
    full = pm.state_bytes(stage.parameters, cfg)
    a = pm.layer_activations(cfg, backend)
    core_unit, core_name = (b * heads * s, "a b s") if backend == "flash" else (b * heads * s * s, "a b s^2")
    mib = lambda n: f"{n / 2 ** 20:.1f}"  # noqa: E731
    per_layer = {r: pm.layer_activations(cfg, backend, r).total for r in ("selective", "full")}
    acts = {r: pm.stage_activations(cfg, stage, backend, r) for r in (None, "selective", "full")}
    lines = [f"memory per GPU: {describe(stage)}, the most loaded (GiB = 2^30 bytes)",
             table([["part", "bytes/param", "GiB"],
                    [f"weights ({precision})", 2 if low else 4, gib(full["weights"])],
                    ["gradients (fp32 main grads)", 4, gib(full["grads"])],
                    [f"optimizer ({'fp32 master + ' if low else ''}Adam m, v)", 12 if low else 8,
                     gib(full["optimizer"])],
                    [f"optimizer with ZeRO-1 (/ DP {dp})", f"{(12 if low else 8) / dp:.3g}",
                     gib(pm.state_bytes(stage.parameters, cfg, True)["optimizer"])]]
                   + ([["FP8 copies of the layers' Linear weights, w8 and w8^T", 2,
                        gib(pm.fp8_weight_copies(cfg, stage))]] if cfg.fp8_format else [])),
             f"activations of one layer and one micro-batch [b {b}, s {s}, h {h}], {heads} heads per GPU:",
             table([["part", "bytes", "MiB"],
                    ["LayerNorm inputs, dropout masks" + (" (/ TP: SP)" if cfg.sequence_parallel else ""),
                     f"{a.outside / (b * s * h):.3g} b s h", mib(a.outside)],
                    ["q, k, v, attention output, MLP (split by TP)", f"{a.inside / (b * s * h):.3g} b s h",
                     mib(a.inside)],
                    [f"attention core ({backend})", f"{a.core / core_unit:.3g} {core_name}", mib(a.core)],
                    ["LayerNorm statistics (fp32)", f"{a.stats / (b * s):.3g} b s", mib(a.stats)],
                    ["= one layer, no recompute", "", mib(a.total)],
                    ["  selective recompute (no attention core)", "", mib(per_layer["selective"])],
                    ["  full recompute (the layer's input)", "", mib(per_layer["full"])]]),
             f"{'model chunks' if cfg.virtual_pipeline_size > 1 else 'micro-batches'} in flight at the peak: "
             f"{stage.in_flight}, each of {stage.layers // cfg.virtual_pipeline_size} layers"
             + (" + the embedding" if stage.first else "")
             + (" + the LM head and loss at their peak" if stage.last else ""),
             table([["total per GPU (GiB)", "activations", "no ZeRO-1", f"ZeRO-1 (DP {dp})"]]
                   + [[name, gib(acts[r])] + [gib(tables[stage.rank][r, z]) + (" <- this run" if mine == (r, z) else "")
                                               for z in (False, True)]
                      for r, name in ((None, "no recompute"), ("selective", "selective recompute"),
                                      ("full", "full recompute"))])]
    total = tables[stage.rank][mine]
    verdict = "fits" if total <= hw["gpu_memory_gib"] * pm.GiB else "DOES NOT FIT"
    lines.append(f"this run: {gib(total)} of {hw['gpu_memory_gib']:g} GiB per GPU: {verdict} (not counted: the CUDA "
                 "context, allocator slack, temporary buffers; keep ~10% free)")
    return lines


def time_section(cfg, hw, est, world, days=True) -> list:
    pp, vp, m = cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_size, cfg.num_micro_batches
    ms = lambda seconds: f"{seconds * 1e3:.1f} ms"  # noqa: E731
    sp, zero1 = cfg.sequence_parallel, cfg.use_distributed_optimizer
    lines = ["pipeline bubble: " + ("none (one stage)" if pp == 1 else
             f"(p-1)/{'(v m)' if vp > 1 else 'm'} = {pp - 1}/{vp * m if vp > 1 else m} = {est['bubble']:.3f}"
             " of the compute time"),
             "communication per step and GPU (bytes this GPU sends; time at the bandwidths below)",
             table([["what", "GiB", "time", "exposed"],
                    [f"TP: {'gathers/reduce-scatters' if sp else '4 all-reduces'} of [b, s, h] per layer, "
                     "micro-batch", gib(est["tp_bytes"]), ms(est["tp_time"]), ms(est["tp_time"])],
                    ["PP: an activation and its gradient per micro-batch", gib(est["pp_bytes"]), ms(est["pp_time"]),
                     ms(est["pp_time"])],
                    [f"DP: {'reduce-scatter + all-gather' if zero1 else 'all-reduce'} of the fp32 grads"
                     + (" (overlapped)" if cfg.overlap_grad_reduce else ""),
                     gib(est["dp_bytes"]), ms(est["dp_time"]), ms(est["dp_exposed"])],
                    ["PP: tied word-embedding grads, first + last stage", gib(est["embedding_bytes"]),
                     ms(est["embedding_time"]), ms(est["embedding_time"])]]),
             f"step time: {hw['peak_tflops']:g} TFLOP/s x MFU {hw['mfu']:g}" + ("" if cfg.fp16 or cfg.bf16 else
             " / 2 (fp32: TF32)") + f" = {est['flops_per_second'] / 1e12:.0f} TFLOP/s; NVLink "
             f"{hw['nvlink_gb_s']:g} GB/s, network {hw['ib_gb_s']:g} GB/s per GPU, HBM {hw['hbm_tb_s']:g} TB/s"]
    if cfg.fp8_format:
        lines.append(f"FP8 ({cfg.fp8_format}): each layer's QKV, attention output, fc1 and fc2 products, forward and "
                     f"both backward ({100 * est['fp8_share']:.0f}% of the stage's FLOPs), at "
                     f"{hw['fp8_peak_tflops']:g} TFLOP/s x MFU {hw['mfu']:g} = "
                     f"{est['fp8_flops_per_second'] / 1e12:.0f} TFLOP/s; the attention core and the LM head at the "
                     "bf16 rate; the casts at the HBM bandwidth")
    lines += [table([[f"compute, slowest stage ({est['stage'].rank})", ms(est["compute"])]]
                    + ([["+ FP8 casts (HBM-bound, a lower bound)", ms(est["fp8_casts"])]] if cfg.fp8_format else [])
                    + [["+ TP and PP communication", ms(est["tp_time"] + est["pp_time"])],
                       [f"x (1 + bubble {est['bubble']:.3f})", ms(est["pipeline"])],
                       ["+ exposed DP and embedding reduce", ms(est["dp_exposed"] + est["embedding_time"])],
                       ["+ optimizer step (HBM-bound)", ms(est["optimizer"])],
                       ["= step", ms(est["step"])]])]
    tflops = est["model_flops"] / world / est["step"]
    return lines + [f"expected log line: elapsed time per iteration (ms): {est['step'] * 1e3:.1f} | throughput per GPU "
                    f"(TFLOP/s/GPU): {tflops / 1e12:.1f} | tokens per second: "
                    f"{cfg.global_batch_size * cfg.seq_length / est['step']:.0f} | "
                    f"MFU: {100 * tflops / PEAK_FLOPS:.1f}%"] + (
        [f"--train-iters {cfg.train_iters}: {est['step'] * cfg.train_iters / 86400:.2f} days at that rate"] if days else [])


def report(cfg, hw, world, nnodes, gpus_per_node, days=True) -> str:
    """The plan as text; days: add the days-to-train line (--train-iters was given)."""
    precision = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[compute_dtype(cfg)]
    backend = backend_for(cfg, "cuda")
    all_stages = pm.stages(cfg)
    tables = {s.rank: pm.memory_table(cfg, s, backend) for s in all_stages}
    mine = (cfg.recompute, cfg.use_distributed_optimizer)
    most_memory = max(all_stages, key=lambda s: tables[s.rank][mine])
    most_parameters = max(all_stages, key=lambda s: s.parameters)
    total = pm.total_parameters(cfg)
    lines = header(cfg, world, nnodes, gpus_per_node, precision, backend) + [
        "", f"total parameters: {total} ({total / 1e6:.1f}M)",
        f"parameters per GPU: {most_parameters.parameters} ({most_parameters.parameters / 1e6:.1f}M; "
        f"{describe(most_parameters)}" + (f", split over TP {cfg.tensor_model_parallel_size}"
                                          if cfg.tensor_model_parallel_size > 1 else "") + ")", ""]
    lines += memory_section(cfg, most_memory, tables, backend, precision, hw)
    if cfg.pipeline_model_parallel_size > 1:
        lines.append("per stage (GiB, this run): " + "; ".join(
            f"{s.rank}: {gib(tables[s.rank][mine])} ({s.layers} layers, {s.in_flight} in flight)" for s in all_stages))
    est = estimate(cfg, hw, all_stages, gpus_per_node)
    lengths = torch.full((cfg.global_batch_size,), float(cfg.seq_length), dtype=torch.float64)
    rows = cfg.global_batch_size * cfg.seq_length * (cfg.mask_prob if cfg.sparse_mlm else 1)
    est["model_flops"] = model_flops(cfg, lengths, rows)  # what the trainer counts: no recompute, no padding
    return "\n".join(lines + [""] + time_section(cfg, hw, est, world, days))


def apply_preset(cfg):
    """As validate does it: a preset fills the model flags that were not given."""
    if cfg.preset is not None:
        for name, value in PRESETS[cfg.preset].items():
            if getattr(cfg, name) is None:
                setattr(cfg, name, value)


@exit_on_usage_error
def main(argv=None):
    args = vars(build_plan_parser().parse_args(argv))
    nnodes, gpus_per_node = args.pop("nnodes"), args.pop("nproc_per_node")
    hw = {name: args.pop(name) for name in HARDWARE}
    problems = [f"--{name.replace('_', '-')} {value:g} must be positive" for name, value in hw.items() if value <= 0]
    problems += ["--mfu must be at most 1"] if hw["mfu"] > 1 else []
    problems += [f"--nnodes {nnodes} and --nproc-per-node {gpus_per_node} must be at least 1"] \
        if nnodes < 1 or gpus_per_node < 1 else []
    cfg = Config(**args)
    if cfg.use_checkpoint_args and cfg.load:  # as train.setup: the model's shape from the checkpoint
        from minibert.train import use_checkpoint_args
        use_checkpoint_args(cfg)
    apply_preset(cfg)
    # a plan needs the model, the batch and the layout; the schedule only adds the days-to-train line, so the
    # trainer's required --train-iters and --lr get placeholders here when they are not given
    days = cfg.train_iters is not None
    cfg.train_iters = 1 if cfg.train_iters is None else cfg.train_iters
    cfg.lr = 0.0 if cfg.lr is None else cfg.lr
    world = max(nnodes, 1) * max(gpus_per_node, 1)
    problems += layout_problems(cfg, world)
    problems += other_problem(cfg)
    if problems:
        refuse(problems)
    validate(cfg, world_size=world, device_type="cuda",  # exactly the trainer's check on N x G GPUs
             warn=lambda message: print(f"warning: {message}", file=sys.stderr, flush=True))
    print(report(cfg, hw, world, nnodes, gpus_per_node, days))


if __name__ == "__main__":
    main()
