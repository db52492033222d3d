"""AdamW on the fp32 masters and the copy back to the 16-bit model, in one pass over memory.

What you will learn: why an optimizer step is a memory-bound pass whose cost is counted in bytes per
parameter, and how one kernel that reads each flat buffer once and writes the 16-bit weights on its way
out moves fewer bytes than a library's fused optimizer followed by a copy.

The update (decoupled weight decay, as torch.optim.AdamW and Megatron's 'adam'), per element, at step t:

    g  = grad / divisor                      divisor = (fp16: loss scale) x (clipping's factor)
    p  = p (1 - lr wd)                       wd = 0 for biases and LayerNorm weights
    m  = b1 m + (1 - b1) g                   v = b2 v + (1 - b2) g^2
    p  = p - lr / (1 - b1^t) x m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    p16 = p rounded to the model's dtype     (16-bit runs only: the weights the next forward reads)

The plain twin (minibert.training.optim's MixedPrecisionOptimizer; --no-adam-fusion, and every CPU run) is
PyTorch's fused AdamW, one multi-tensor kernel, then one copy per bucket. Bytes per parameter, fp32 unless said:

    torch fused AdamW   read p, g, m, v (16); write p, m, v (12), and g (4): with a grad_scale it
                        stores the divided gradient back                                      32
    copy back           read p (4), write p16 (2)                                              6   = 38
    this kernel         read p, g, m, v (16); write p, m, v (12) and p16 (2)                       = 30

BERT-large has 336M parameters: 12.8 GB a step against 10.1 GB. The update alone (bench/adamw_bench.py)
and whole graphed training steps with and without the kernel (`make bench`) are timed in
bench/results/adamw_h100_2026-12-05.txt, bench/results/benchmarks_h100_2026-12-05.md and BENCHMARKS.md; chapter 8, section 8 reads them.

How the work is cut. The optimizer's state lies in flat buffers, one per bucket shard (the part of a
gradient bucket this rank updates; minibert/parallel/data_parallel.py), each holding many parameters
with a few padding elements between them. The launcher cuts every parameter's range into chunks of BLOCK
elements and gives each program one chunk through three small tables: where it starts, where its
parameter ends, and whether its parameter is decayed. So padding is never touched, a 1-D parameter is
never decayed, and one launch serves a whole bucket of hundreds of parameters.

Skipping a step. An fp16 overflow or a non-finite norm is known only on the device (`found_inf`, a 0-d
tensor); each program reads it and empties its range, so a skipped step stores nothing, without a host
sync. The bias corrections need the step number t; the host knows it (it counts the steps that were
made, from each step's one sync), so they arrive as two scalars the host computed in double precision.

FusedAdamW is the optimizer with this kernel as its update; apply(optimizer) turns a built one into it.
Runs on CUDA, or on CPU with TRITON_INTERPRET=1 (the tests: the same kernel source, interpreted)."""
import math

import torch
import triton
import triton.language as tl

from minibert.kernels import interpreting
from minibert.training.optim import MixedPrecisionOptimizer, no_weight_decay

# Elements per program, and warps: 512 and 4 (4 elements a thread, one 16-byte load of each fp32 buffer),
# picked by `python bench/adamw_bench.py --sweep`, results in bench/results/adamw_h100_2026-12-05.txt. The smaller the
# program, the faster, down to this size (the reading: more, smaller programs keep more loads in flight);
# 256 x 4 was barely faster, with twice the programs and tables.
BLOCK, WARPS = 512, 4


def block_size():
    """Elements a program updates: small under the interpreter, so tiny test models get many programs."""
    return 64 if interpreting() else BLOCK


@triton.jit
def _adamw_kernel(P, G, M, V, P16, STARTS, ENDS, DECAYS, DIVISOR, FOUND_INF,
                  lr, weight_decay, beta1, beta2, eps, step_size, bias_correction2_sqrt,
                  BLOCK: tl.constexpr, COPY: tl.constexpr):
    """One chunk of one parameter: [STARTS[pid], min(STARTS[pid] + BLOCK, ENDS[pid])) of the flat buffers."""
    pid = tl.program_id(0)
    start = tl.load(STARTS + pid)
    end = tl.where(tl.load(FOUND_INF) == 0, tl.load(ENDS + pid), start)  # a skipped step: an empty range
    decay = tl.load(DECAYS + pid)                          # 1.0: decayed, 0.0: a bias or a LayerNorm weight
    offsets = start + tl.arange(0, BLOCK)
    inside = offsets < end
    g = tl.load(G + offsets, mask=inside, other=0.0) / tl.load(DIVISOR)
    p = tl.load(P + offsets, mask=inside, other=0.0)
    m = tl.load(M + offsets, mask=inside, other=0.0)
    v = tl.load(V + offsets, mask=inside, other=0.0)
    p = p * (1.0 - lr * weight_decay * decay)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)
    tl.store(P + offsets, p, mask=inside)
    tl.store(M + offsets, m, mask=inside)
    tl.store(V + offsets, v, mask=inside)
    if COPY:
        tl.store(P16 + offsets, p.to(P16.dtype.element_ty), mask=inside)


def program_table(ranges, decayed, block, device):
    """(starts, ends, decays): one row per program, a BLOCK-element chunk of one parameter's [start, end)
    in a flat buffer. `ranges`: [(start, end)] of the parameters; `decayed`: a bool per parameter."""
    starts, ends, decays = [], [], []
    for (a, b), d in zip(ranges, decayed):
        chunk_starts = range(a, b, block)
        starts.extend(chunk_starts)
        ends.extend([b] * len(chunk_starts))
        decays.extend([1.0 if d else 0.0] * len(chunk_starts))
    return (torch.tensor(starts, dtype=torch.int64, device=device), torch.tensor(ends, dtype=torch.int64, device=device),
            torch.tensor(decays, dtype=torch.float32, device=device))


def bias_corrections(step, lr, beta1, beta2):
    """(lr / (1 - b1^t), sqrt(1 - b2^t)) in double precision: the two scalars the kernel takes."""
    return lr / (1.0 - beta1 ** step), math.sqrt(1.0 - beta2 ** step)


def adamw_(master, grad, exp_avg, exp_avg_sq, table, *, divisor, found_inf, lr, weight_decay, betas, eps,
           step, model_copy=None, block=None, warps=WARPS):
    """One AdamW step in place over flat fp32 buffers (master, grad, exp_avg, exp_avg_sq: one shape), the
    chunks of `table` (program_table, made with the same `block`), and the weights rounded into
    `model_copy` (a flat 16-bit buffer of the same length; None: fp32 run, nothing to copy). divisor and
    found_inf: 0-d fp32 device tensors; step: the number of this step, counting from 1."""
    starts, ends, decays = table
    if starts.numel() == 0:
        return
    beta1, beta2 = betas
    step_size, bias_correction2_sqrt = bias_corrections(step, lr, beta1, beta2)
    _adamw_kernel[(starts.numel(),)](
        master, grad, exp_avg, exp_avg_sq, master if model_copy is None else model_copy, starts, ends, decays,
        divisor, found_inf, lr, weight_decay, beta1, beta2, eps, step_size, bias_correction2_sqrt,
        BLOCK=block or block_size(), COPY=model_copy is not None, num_warps=1 if interpreting() else warps)


class FusedAdamW(MixedPrecisionOptimizer):
    """MixedPrecisionOptimizer whose update is adamw_ above, one launch per bucket shard."""

    def update(self, divisor, found_inf):
        group = self.param_groups[0]  # the decayed parameters' group (if none, no chunk is decayed)
        for shard in self.shards:
            if getattr(shard, "table", None) is None:  # made at the first step, kept
                shard.table = program_table([(pc.lo, pc.hi) for pc in shard.pieces],
                                            [not no_weight_decay(pc.name, pc.param) for pc in shard.pieces],
                                            block_size(), shard.master.device)
            adamw_(shard.master, shard.grad, shard.exp_avg, shard.exp_avg_sq, shard.table, divisor=divisor,
                   found_inf=found_inf, lr=group["lr"], weight_decay=group["weight_decay"], betas=group["betas"],
                   eps=group["eps"], step=self.steps_made + 1, model_copy=shard.model_values)


def apply(optimizer):
    """A built MixedPrecisionOptimizer -> FusedAdamW (its buffers, state and groups kept)."""
    optimizer.__class__ = FusedAdamW
    return optimizer
