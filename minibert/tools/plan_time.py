"""About how long one training step takes, and how many bytes each kind of parallelism moves in it.

A model, not a measurement: every number comes from the FLOP count of docs/measuring.md, a few
bandwidths and one efficiency factor, all stated (HARDWARE below; the planner takes each as a flag).

    cell     = one micro-batch's forward + backward on the slowest pipeline stage:
               FLOPs / (peak x MFU)  +  TP collectives  +  PP sends
               (FP8: the Linears' FLOPs / (FP8 peak x MFU) + the rest / (peak x MFU) + the casts' HBM time)
    pipeline = m x cell x (1 + bubble)        bubble = (p-1)/m; interleaved (p-1)/(v m); 0 without PP
    step     = pipeline  +  exposed DP reduce  +  tied-embedding all-reduce  +  optimizer step

FLOPs per layer and micro-batch of b samples, s tokens (forward x 3 for forward + backward, as the
trainer counts them): 6 b s (4h^2 + 2hf) + 12 b s^2 h; the LM head 6 r b s (h V + h^2), r the share of
positions sent through it. Recompute runs part of the forward again: selective the attention core
(+4 b s^2 h), full the whole layer (+1/3). TP divides a stage's FLOPs by t.

FP8 (--fp8-format, minibert/fast/fp8.py): the four Linears of each layer (QKV, attention output, fc1,
fc2) multiply FP8 operands, in the forward and in both products of the backward, 6 b s (4h^2 + 2hf) per
layer (+ a third with full recompute), at --fp8-peak-tflops x MFU; the rest (the attention core, the LM
head) stays at --peak-tflops x MFU. The casts are memory-bound, so they are charged at the HBM bandwidth:
the one-pass cast (fast/fp8_cast.py) reads a 16-bit tensor once and writes its FP8 copy and the copy's
transpose (the backward's other operand layout), 4 bytes an element; tensorwise scaling reads the tensor
once more for its amax (+2). Per micro-batch each Linear casts its input (twice under full recompute)
and the gradient of its output; its weight once per step (the copy serves the step's micro-batches),
spread here over the m micro-batches. A lower bound: the first step's extra amax pass, launch gaps and
the CPU's plain-op casts are left out.

Communication (ring algorithms: a collective over n ranks moves (n-1)/n of its message per GPU for an
all-gather or a reduce-scatter, twice that for an all-reduce; bandwidths are "bus bandwidth" as
nccl-tests reports it, so time = bytes moved per GPU / bandwidth):

    TP   per layer and micro-batch 4 all-reduces of one [b, s, h] activation (2 forward, 2 backward);
         with sequence parallelism 10 all-gathers / reduce-scatters (4 forward, 6 backward: minibert
         gathers the input again for the weight gradient instead of keeping it; 8 with FP8, whose
         Linears keep the gathered input's FP8 copy instead). +1 all-reduce on the
         first stage (the vocab-parallel embedding) and +1 on the last (the LM head's input gradient).
    PP   per micro-batch and model chunk, an activation forward and its gradient backward; each forward
         and backward waits for its exchange over the slower of the stage's links to its neighbours.
    DP   the fp32 main grads: an all-reduce, or with ZeRO-1 a reduce-scatter and, after the update, an
         all-gather of the 16-bit parameters.
    tied embedding (PP > 1): the word table's fp32 grads, all-reduced between the first and last stage.

What is exposed (adds to the step): minibert overlaps no TP or PP communication, so both stretch every
pipeline cell. The DP reduce starts per bucket during the last micro-batch's backward with
--overlap-grad-reduce: then only the last bucket, or what that backward (2/3 of a cell) cannot hide, is
exposed; without the flag all of it is. ZeRO-1's all-gather and the tied-embedding all-reduce come after
the backward: exposed. A group inside one node talks over NVLink, a group that spans nodes over the
network (the rank grid of parallel/state.py decides which). The optimizer step is memory-bound: about
OPTIMIZER_BYTES of HBM traffic per parameter it updates.

Left out: data loading, kernel launch gaps, stragglers, the padding of real batches (a padded position
costs the same in the matmuls; the trainer's model FLOPs count only real tokens, so its logged MFU is
lower than this estimate's on padded data)."""
from minibert.parallel.data_parallel import DEFAULT_BUCKET_SIZE
from minibert.parallel.schedules import bubble_fraction
from minibert.tools import plan_memory as pm

# The hardware model: one GPU and its links; each default with where it comes from.
HARDWARE = {
    "peak_tflops": (790.0, ("dense bf16 matmul TFLOP/s of one GPU (default: a large bf16 matmul as measured in "
                            "docs/measuring.md, section 2, not a datasheet's peak)")),
    "fp8_peak_tflops": (1420.0, ("dense FP8 matmul TFLOP/s of one GPU: the rate of the layers' four Linears "
                                 "with --fp8-format (default: --peak-tflops's default times the speed-up of "
                                 "FP8 products over bf16 ones at the 4B's and 20B's shapes, as measured in "
                                 "bench/results/fp8_sweep_h100_2026-12-07.md)")),
    "mfu": (0.40, ("share of the peak the forward and backward reach (default: an assumption that chapter 7 "
                   "explains)")),
    "hbm_tb_s": (4.1, ("HBM TB/s, for the optimizer step and FP8 casts (default: a device copy as measured in "
                       "docs/measuring.md, section 4, not a datasheet's)")),
    "nvlink_gb_s": (450.0, "NVLink bus bandwidth per GPU, GB/s (default: 18 links x 25 GB/s each way)"),
    "ib_gb_s": (50.0, "network bandwidth per GPU between nodes, GB/s (one 400 Gb/s NIC per GPU)"),
    "gpu_memory_gib": (139.0, "GPU memory a run can use, GiB (default: what the course's GPU offers a run; "
                              "chapter 7)"),
}
OPTIMIZER_BYTES = 40  # per parameter: AdamW reads grad, master, m, v and writes master, m, v (28), the
                      # 16-bit copy (6), the grad norm's read and zeroing the grads (8): ~40


def forward_flops(cfg):
    """One whole layer's forward, one micro-batch: (its four Linears, the attention core QK^T and PV)."""
    b, s, h, f = cfg.micro_batch_size, cfg.seq_length, cfg.hidden_size, cfg.ffn_size
    return 2 * b * s * (4 * h * h + 2 * h * f), 4 * b * s * s * h


def layer_flops(cfg, recompute=None) -> float:
    """One whole layer (all TP ranks together), one micro-batch, forward + backward + recompute."""
    dense, core = forward_flops(cfg)
    return 3 * (dense + core) + {None: 0, "selective": core, "full": dense + core}[recompute]


def linear_flops(cfg, recompute=None) -> float:
    """The four Linears' part of layer_flops: what --fp8-format runs in FP8."""
    dense, _ = forward_flops(cfg)
    return (3 + (recompute == "full")) * dense


def fp8_cast_bytes(cfg, recompute=None) -> float:
    """HBM bytes one layer's FP8 casts move per micro-batch on one TP rank, the weights' share of a step
    included (the module docstring)."""
    tokens, t, m = cfg.micro_batch_size * cfg.seq_length, cfg.tensor_model_parallel_size, cfg.num_micro_batches
    h, f = cfg.hidden_size, cfg.ffn_size
    inputs = tokens * (2 * h + (h + f) / t)  # QKV and fc1 take the whole [b, s, h]; attention out and fc2 a shard
    gradients = tokens * (2 * h + (3 * h + f) / t)  # of the outputs: QKV's and fc1's split, the others' whole
    weights = (4 * h * h + 2 * h * f) / t
    per_element = 4 + 2 * (cfg.fp8_recipe == "tensorwise")
    return per_element * ((1 + (recompute == "full")) * inputs + gradients + weights / m)


def head_flops(cfg) -> float:
    rows = cfg.micro_batch_size * cfg.seq_length * (cfg.mask_prob if cfg.sparse_mlm else 1)
    return 6 * rows * (cfg.hidden_size * cfg.padded_vocab_size + cfg.hidden_size ** 2)


def spans_nodes(ranks, gpus_per_node) -> bool:
    return len({r // gpus_per_node for r in ranks}) > 1


def sustained_flops(cfg, hw) -> float:
    """What the forward and backward sustain: peak x MFU; fp32 runs their matmuls in TF32, at half rate."""
    return hw["peak_tflops"] * 1e12 * hw["mfu"] * (1 if cfg.fp16 or cfg.bf16 else 0.5)


def fp8_sustained_flops(hw) -> float:
    """What the FP8 products sustain: FP8 peak x the same MFU."""
    return hw["fp8_peak_tflops"] * 1e12 * hw["mfu"]


def estimate(cfg, hw, stages, gpus_per_node) -> dict:
    """Seconds and bytes per step (see the module docstring), for a validated config and its stages."""
    tp, pp, dp, m, vp = (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.data_parallel_size,
                         cfg.num_micro_batches, cfg.virtual_pipeline_size)
    message = cfg.micro_batch_size * cfg.seq_length * cfg.hidden_size * pm.activation_bytes(cfg)  # one [b, s, h]
    flops_per_second, fp8_flops_per_second = sustained_flops(cfg, hw), fp8_sustained_flops(hw)
    fp8 = cfg.fp8_format is not None

    def bandwidth(ranks):  # rank 0's group stands for all: the grid repeats itself
        return (hw["ib_gb_s"] if spans_nodes(ranks, gpus_per_node) else hw["nvlink_gb_s"]) * 1e9
    tp_bw, dp_bw = bandwidth(range(tp)), bandwidth([tp * d for d in range(dp)])
    embedding_bw = bandwidth([0, tp * dp * (pp - 1)])

    def pp_bandwidth(rank):  # the slower link to its neighbours (interleaved: the last stage feeds the first)
        neighbours = [n for n in (rank - 1, rank + 1) if 0 <= n < pp]
        neighbours += [pp - 1 - rank] if vp > 1 and rank in (0, pp - 1) else []
        return min(bandwidth([tp * dp * rank, tp * dp * n]) for n in neighbours)

    ring = (tp - 1) / tp
    collectives = (10 - 2 * fp8 + 4 * (cfg.recompute == "full")) if cfg.sequence_parallel else \
        2 * (4 + 2 * (cfg.recompute == "full"))  # in units of (n-1)/n x message: an all-reduce counts 2
    cells = []
    for stage in stages:  # per micro-batch
        flops = (stage.layers * layer_flops(cfg, cfg.recompute) + stage.last * head_flops(cfg)) / tp
        fp8_flops = stage.layers * linear_flops(cfg, cfg.recompute) / tp if fp8 else 0  # a part of flops
        compute = (flops - fp8_flops) / flops_per_second + fp8_flops / fp8_flops_per_second
        casts = stage.layers * fp8_cast_bytes(cfg, cfg.recompute) / (hw["hbm_tb_s"] * 1e12) if fp8 else 0
        tp_bytes = (stage.layers * collectives + 2 * (stage.first + stage.last)) * ring * message
        # PP: each forward and each backward waits for one exchange (an activation in, one out) per chunk
        pp_message = message / (tp if cfg.sequence_parallel else 1)
        pp_time = 0 if pp == 1 else vp * 2 * pp_message / pp_bandwidth(stage.rank)
        pp_bytes = 0 if pp == 1 else pp_message * (vp * 2 - (vp == 1) * (stage.first + stage.last))  # sent
        seconds = compute + casts + tp_bytes / tp_bw + pp_time
        cells.append(dict(cell=seconds, flops=flops, fp8_flops=fp8_flops, compute=compute, casts=casts,
                          tp_bytes=tp_bytes, pp_bytes=pp_bytes, pp_time=pp_time, stage=stage))
    slowest = max(cells, key=lambda c: c["cell"])
    bubble = bubble_fraction(pm.pipeline_kind(cfg), pp, m, vp) if pp > 1 else 0.0
    out = dict(flops_per_second=flops_per_second, fp8_flops_per_second=fp8_flops_per_second,
               stage=slowest["stage"], bubble=bubble, compute=m * slowest["compute"],
               fp8_share=slowest["fp8_flops"] / slowest["flops"], fp8_casts=m * slowest["casts"],
               tp_bytes=m * slowest["tp_bytes"], tp_time=m * slowest["tp_bytes"] / tp_bw,
               pp_bytes=m * slowest["pp_bytes"], pp_time=m * slowest["pp_time"],
               pipeline=m * slowest["cell"] * (1 + bubble))

    busiest = max(stages, key=lambda s: s.parameters)  # its DP reduce is the longest
    grads = busiest.parameters * 4
    if cfg.use_distributed_optimizer:
        weights = busiest.parameters * pm.activation_bytes(cfg)  # the updated 16-bit (or fp32) parameters
        reduce_bytes, gather_bytes = (dp - 1) / dp * grads, (dp - 1) / dp * weights
    else:
        reduce_bytes, gather_bytes = 2 * (dp - 1) / dp * grads, 0.0
    reduce_time = reduce_bytes / dp_bw
    exposed = reduce_time
    if cfg.overlap_grad_reduce and dp > 1:
        bucket = min(busiest.parameters, cfg.ddp_bucket_size or max(DEFAULT_BUCKET_SIZE, 1_000_000 * dp))
        exposed = max(reduce_time * bucket / busiest.parameters, reduce_time - 2 / 3 * slowest["cell"])
    embedding_bytes = cfg.padded_vocab_size * cfg.hidden_size // tp * 4 if pp > 1 else 0
    updated = busiest.parameters / (dp if cfg.use_distributed_optimizer else 1)
    out.update(dp_bytes=reduce_bytes + gather_bytes, dp_time=reduce_time + gather_bytes / dp_bw,
               dp_exposed=exposed + gather_bytes / dp_bw, embedding_bytes=embedding_bytes,
               embedding_time=embedding_bytes / embedding_bw,
               optimizer=updated * OPTIMIZER_BYTES / (hw["hbm_tb_s"] * 1e12))
    out["step"] = out["pipeline"] + out["dp_exposed"] + out["embedding_time"] + out["optimizer"]
    return out
