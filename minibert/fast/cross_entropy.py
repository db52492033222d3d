"""Fused cross entropy: the masked-LM loss and its gradient, each in one pass over the logits.

What you will learn: why the LM loss, not a matmul, can be the heaviest memory traffic of a BERT step; how
a row's logsumexp is computed in one streaming pass (the online max-and-sum recurrence); why the backward
needs only the logits and two numbers per row; and why a fused kernel must check what the plain one checks.

The masked-LM head ends in logits [n, V], one row per position (n = b * s), and the loss is

    loss_i = logsumexp_j(x_ij) - x_i,label_i            (0 where label_i == ignore_index)
    d loss_i / d x_ij = softmax(x_i)_j - [j == label_i] = exp(x_ij - lse_i) - [j == label_i]

The plain twin is minibert.model.loss.lm_cross_entropy: F.cross_entropy(logits.float(), labels, ignore_index=-1,
reduction="none"). The fp32 cast is there for accuracy (a bf16 log-softmax keeps ~3 digits), but it costs
memory traffic. BERT-large, micro-batch 32 x 512: n = 16384, padded vocab V = 30592, so the bf16 logits are
16384 * 30592 * 2 B = 1.0 GB (call it L; fp32 copies are 2 L). The plain path moves:

    forward   logits.float()            read L,  write 2L
              log_softmax               read 2L, write 2L    (kept for the backward: 2 GB held)
              nll_loss (picks labels)   ~0                    forward: 7 L
    backward  nll_loss backward         write 2L (zeros, then -g at each label)
              log_softmax backward      read 2L + 2L, write 2L
              .float() backward (cast)  read 2L, write L      backward: 11 L      total: 18 L = 18 GB

and the fused kernels here move: forward read L (writes n fp32 losses, maxima and log-sums, ~0); backward read L,
write L. Total 3 L = 3 GB, 6x fewer bytes, and between forward and backward it holds 128 KB (two fp32 per row)
instead of 2 GB of log-probabilities; its extra peak memory is the gradient itself.
bench/cross_entropy_bench.py times both paths and their peak memory, every row labelled and 15% labelled:
results in bench/results/fusions_h200_2026-12-01.md, read in bench/notes/fusions.md and chapter 8, section 7.
Rows whose label is ignore_index (85% of positions in dense MLM) are not even read: their loss and gradient
are 0 whatever the logits are (eager still reads every row).

The online logsumexp. One pass over a row in chunks c = 1, 2, ... of BLOCK_V columns keeps a running max m
and a running sum s of exp(x - m):

    m_c = max(m_{c-1}, max_{j in c} x_j)
    s_c = s_{c-1} * exp(m_{c-1} - m_c) + sum_{j in c} exp(x_j - m_c)        m_0 = -inf, s_0 = 0
    lse = m_last + log(s_last)

Rescaling the old sum by exp(m_old - m_new) keeps every exp argument <= 0, so nothing overflows (logits
near the bf16/fp32 maximum included), and one exp per element is all it costs. The target logit is one load
at the label's column: loss = (m - x_label) + log(s). The forward saves the logits (the caller's tensor, no
copy), the labels and, per row, m and log(s) (fp32 [n] each); the backward recomputes
softmax_j = exp((x_j - m) - log(s)) chunk by chunk: nothing of size [n, V] is ever stored.

The accuracy comes for free. With m and x_label in hand, the prediction is right exactly when x_label == m
(the label's logit is the row's largest; a tie counts as right). The forward writes that flag per row
(bool [n], n bytes), which the trainer sums into the masked-LM accuracy: no second pass over the logits.

Why two numbers and not lse = m + log(s): the sum rounds log(s) to a multiple of ulp(m). At |x| ~ 1e4
that is 1e-3, at 1e38 (bf16 reaches 3.4e38) all of it: 10 tied maxima would each get softmax exp(0) = 1
instead of 1/10. (x - m) - log(s) subtracts in the order eager log_softmax does, so no precision is lost.

Why the labels are checked. F.cross_entropy refuses a label outside [0, V) (other than ignore_index); a
kernel that loads x[label] would read another row's logit, or outside the tensor, and return a plausible
wrong loss. On CPU tensors fused_cross_entropy raises ValueError first ((labels >= V).any() is cheap there).
On CUDA that check would stall the host until the GPU catches up (a sync every step), so it is not made;
instead the kernel never loads outside [0, V): an out-of-range label gives a NaN loss and NaN gradients,
which the training loop's loss checks see.

Runs on CUDA, or on CPU with TRITON_INTERPRET=1 (the tests: the same kernel source, interpreted, slow).
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minibert.kernels import interpreting


# --------------------------------------------------------------------------------------------------
# 1. Tuning knobs
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CrossEntropyConfig:
    """How one row is walked: each program owns one row and loops over it in chunks."""
    block_v: int    # columns per chunk, a power of 2 (capped at the row length rounded up to a power of 2)
    num_warps: int  # 32 threads each; block_v / (32 * num_warps) elements per thread per chunk


# A BERT row is 30k columns (60 KB in bf16): one row per program is already a long stream, and n >= 4096
# rows keep every SM busy, so only the chunk shape matters. Picked by `python bench/cross_entropy_bench.py
# --sweep` (bf16 [16384, 30592] viewed to 30524 columns, every row labelled), results in
# bench/notes/fusions.md: the forward is best with ONE warp and 2048 columns (64 per thread), because each
# chunk ends in two row reductions (max, sum) and within one warp those are register shuffles, with no
# shared memory and no barrier; 64 one-warp programs per SM keep enough loads in flight. The backward has
# no reduction: 2048 columns over 8 warps (8 per thread); the chunk widths and warp counts near it time
# alike.
GPU_CONFIG = {"forward": CrossEntropyConfig(block_v=2048, num_warps=1),
              "backward": CrossEntropyConfig(block_v=2048, num_warps=8)}
# The interpreter runs a chunk as numpy ops on the CPU: small chunks keep tests fast and make the test
# shapes (V = 7 .. 1531) cover one chunk, several chunks and a partial last chunk.
INTERPRETER_CONFIG = CrossEntropyConfig(block_v=256, num_warps=1)


def kernel_config(n_cols, direction):
    """The chunk shape used for rows of n_cols columns ("forward" or "backward")."""
    base = INTERPRETER_CONFIG if interpreting() else GPU_CONFIG[direction]
    block_v = min(base.block_v, triton.next_power_of_2(n_cols))
    return CrossEntropyConfig(block_v=block_v, num_warps=max(1, min(base.num_warps, block_v // 256)))


# --------------------------------------------------------------------------------------------------
# 2. The kernels: one program per row
# --------------------------------------------------------------------------------------------------
@triton.jit
def _cross_entropy_fwd_kernel(logits_ptr, labels_ptr, loss_ptr, max_ptr, log_sum_ptr, correct_ptr, n_cols,
                              row_stride, ignore_index, BLOCK_V: tl.constexpr):
    """loss[row] = (m - x[row, label]) + log(s), m = max_j x[row, j], s = sum_j exp(x[row, j] - m);
    m and log(s) saved for the backward; correct[row] = (x[row, label] == m), False on ignored rows.

        x [n, V], row r starts at r * row_stride     (a column slice of a wider buffer: row_stride >= V)
        +---- chunk 0 ----+---- chunk 1 ----+-- chunk 2 --+....+   columns >= V load as -inf: exp -> 0
        online (max, sum) over the chunks; then one load at x[r, label]
    """
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride                   # int64: n * stride passes 2^31
    label = tl.load(labels_ptr + row)                                        # int64 scalar
    ignored = label == ignore_index
    in_range = (label >= 0) & (label < n_cols)
    running_max = tl.full([], float("-inf"), tl.float32)
    running_sum = tl.zeros([], tl.float32)
    for start in range(0, tl.where(ignored, 0, n_cols), BLOCK_V):          # ignored rows: no iteration
        cols = start + tl.arange(0, BLOCK_V)                                 # [BLOCK_V]
        x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)        # all -inf so far: no -inf - -inf
        # tl.exp is exp2(x * log2(e)) on the GPU; (x - max) <= 0 is formed first, so it underflows, never overflows
        running_sum = running_sum * tl.exp(running_max - safe_max) + tl.sum(tl.exp(x - safe_max), axis=0)
        running_max = new_max
    log_sum = tl.log(tl.where(ignored, 1.0, running_sum))                 # ignored: sum 0, keep log(0) out
    log_sum = tl.where(in_range | ignored, log_sum, float("nan"))          # a bad label poisons loss and grad
    target = tl.load(row_ptr + label, mask=in_range & ~ignored, other=0.0).to(tl.float32)  # never out of bounds
    tl.store(max_ptr + row, tl.where(ignored, 0.0, running_max))
    tl.store(log_sum_ptr + row, tl.where(ignored, 0.0, log_sum))
    tl.store(loss_ptr + row, tl.where(ignored, 0.0, (running_max - target) + log_sum))
    tl.store(correct_ptr + row, in_range & ~ignored & (target == running_max))  # the label is the argmax


@triton.jit
def _cross_entropy_bwd_kernel(logits_ptr, labels_ptr, max_ptr, log_sum_ptr, grad_loss_ptr, grad_ptr, n_cols,
                              row_stride, grad_width, grad_loss_stride, ignore_index, BLOCK_V: tl.constexpr):
    """grad[row, j] = (exp((x[row, j] - m) - log(s)) - [j == label]) * grad_loss[row]; 0 on ignored rows.

    grad is a new contiguous [n, grad_width] tensor: grad_width = V, or the row stride of a wider buffer
    whose first V columns are the logits (its columns >= V get 0: see _padded_base); grad_loss may have
    any stride (0 when expanded from a sum).
    Ignored rows skip both loads (a fully masked load moves no bytes) and store zeros, whatever their logits
    and grad_loss are: x = 0, m = log(s) = 0 (the forward stored those) keep softmax finite, and g = 0.
    """
    row = tl.program_id(0)
    label = tl.load(labels_ptr + row)
    ignored = label == ignore_index
    row_max = tl.load(max_ptr + row)
    log_sum = tl.load(log_sum_ptr + row)
    g = tl.load(grad_loss_ptr + row.to(tl.int64) * grad_loss_stride, mask=~ignored, other=0.0)
    in_row = logits_ptr + row.to(tl.int64) * row_stride
    out_row = grad_ptr + row.to(tl.int64) * grad_width
    n_read = tl.where(ignored, 0, n_cols)                                    # ignored rows read nothing
    for start in range(0, grad_width, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(in_row + cols, mask=cols < n_read, other=0.0).to(tl.float32)
        softmax = tl.exp((x - row_max) - log_sum)                            # <= 1: never overflows
        grad = tl.where(cols == label, softmax - 1.0, softmax) * g           # ignored: g = 0, m = log(s) = 0
        grad = tl.where(cols < n_cols, grad, 0.0)                            # a wider buffer's extra columns
        tl.store(out_row + cols, grad.to(grad_ptr.dtype.element_ty), mask=cols < grad_width)


# --------------------------------------------------------------------------------------------------
# 3. Launchers, the autograd Function, the public function
# --------------------------------------------------------------------------------------------------
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_inputs(logits, labels, ignore_index):
    """One clear error per unsupported input; the label range on CPU only (see the module docstring)."""
    if not isinstance(logits, torch.Tensor) or logits.dtype not in SUPPORTED_DTYPES:
        got = logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise TypeError(f"fused_cross_entropy: logits must be a float32, float16 or bfloat16 tensor; got {got}")
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"fused_cross_entropy: logits must be 2-D [n, V] with V >= 1; got {tuple(logits.shape)}")
    if logits.stride(1) != 1 and logits.shape[1] > 1:
        raise ValueError(f"fused_cross_entropy: each row of logits must be contiguous (stride(1) == 1; any row "
                         f"stride is fine); got strides {logits.stride()}. The kernel never copies the logits: "
                         f"pass logits.contiguous() if a copy is what you want")
    if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64:
        got = labels.dtype if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise TypeError(f"fused_cross_entropy: labels must be an int64 tensor (as F.cross_entropy); got {got}")
    if labels.shape != logits.shape[:1]:
        raise ValueError(f"fused_cross_entropy: labels must be [n] = [{logits.shape[0]}], one per row of logits; "
                         f"got {tuple(labels.shape)}")
    if labels.device != logits.device:
        raise ValueError(f"fused_cross_entropy: labels are on {labels.device} but logits are on {logits.device}")
    if logits.device.type != "cuda" and not interpreting():
        raise ValueError(f"fused_cross_entropy runs on CUDA tensors (or on CPU with TRITON_INTERPRET=1 set "
                         f"before triton is imported); got a tensor on {logits.device}")
    if logits.device.type == "cpu":  # cheap here; on CUDA it would be a host sync (the kernel gives NaN instead)
        bad = (labels != ignore_index) & ((labels < 0) | (labels >= logits.shape[1]))
        if bad.any():
            row = int(bad.nonzero()[0, 0])
            raise ValueError(f"fused_cross_entropy: label {int(labels[row])} at row {row} is outside "
                             f"[0, {logits.shape[1]}) and is not ignore_index={ignore_index}")


def _forward(logits, labels, ignore_index, config=None):
    """-> loss, row_max, log_sum: fp32 [n] each, and correct: bool [n] (the label's logit is the row's
    max). config: a CrossEntropyConfig (the benchmark's sweep)."""
    n, n_cols = logits.shape
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    row_max, log_sum = torch.empty_like(loss), torch.empty_like(loss)
    correct = torch.empty(n, dtype=torch.bool, device=logits.device)
    if n > 0:
        config = config or kernel_config(n_cols, "forward")
        _cross_entropy_fwd_kernel[(n,)](logits, labels, loss, row_max, log_sum, correct, n_cols, logits.stride(0),
                                        ignore_index, BLOCK_V=config.block_v, num_warps=config.num_warps)
    return loss, row_max, log_sum, correct


def _backward(logits, labels, row_max, log_sum, grad_loss, ignore_index, config=None, grad_width=None):
    """-> grad [n, grad_width] (default V), contiguous, in logits.dtype; columns >= V are 0."""
    n, n_cols = logits.shape
    grad_width = grad_width or n_cols
    grad = torch.empty((n, grad_width), dtype=logits.dtype, device=logits.device)
    if n > 0:
        config = config or kernel_config(n_cols, "backward")
        _cross_entropy_bwd_kernel[(n,)](logits, labels, row_max, log_sum, grad_loss, grad, n_cols,
                                        logits.stride(0), grad_width, grad_loss.stride(0), ignore_index,
                                        BLOCK_V=config.block_v, num_warps=config.num_warps)
    return grad


def _padded_base(logits):
    """The contiguous [n, W] tensor whose first V columns logits [n, V] is, viewed 2-D, or None.

    The LM head multiplies the whole padded table, [n, padded vocab], and keeps the real vocab's columns as
    a view (minibert.model.bert.TiedDecoder). Autograd's backward of that view makes a zeroed [n, padded vocab]
    tensor and copies the gradient into its first V columns: a fill and a strided copy of the whole
    gradient, the copy alone one of a BERT-base step's larger kernels after the matmuls and attention
    (bench/results/kernel_table_h200_2026-12-03.md; bench/notes/training.md).
    Taking the wider tensor as the Function's input instead, the backward writes that padded gradient
    itself (zeros past V) and autograd has nothing to copy; the forward reads the same V columns."""
    base = logits._base
    if base is None or not base.is_contiguous() or logits.shape[1] == 0 or base.requires_grad != logits.requires_grad:
        return None
    width = base.shape[-1]
    if (logits.stride() != (width, 1) or logits.storage_offset() != base.storage_offset()
            or base.numel() != logits.shape[0] * width or width <= logits.shape[1]):
        return None
    return base.view(logits.shape[0], width)


class _FusedCrossEntropy(torch.autograd.Function):
    """-> (loss, correct). Forward saves the logits as given (a view, not a copy), the labels, and m, log(s):
    fp32 [n] each. logits may be wider than the n_cols columns the loss covers (a padded base: _padded_base);
    its other columns are never read and get gradient 0. correct (bool [n]) has no gradient."""

    @staticmethod
    def forward(ctx, logits, labels, ignore_index, n_cols):
        real = logits[:, :n_cols]
        loss, row_max, log_sum, correct = _forward(real, labels, ignore_index)
        ctx.save_for_backward(logits, labels, row_max, log_sum)
        ctx.ignore_index, ctx.n_cols = ignore_index, n_cols
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, grad_correct):
        logits, labels, row_max, log_sum = ctx.saved_tensors
        grad = _backward(logits[:, :ctx.n_cols], labels, row_max, log_sum, grad_loss, ctx.ignore_index,
                         grad_width=logits.shape[1])
        return grad, None, None, None


def fused_cross_entropy(logits, labels, ignore_index=-1, with_correct=False):
    """Per-row cross entropy in fp32, differentiable, one read of the logits each way.

    logits: [n, V] float32/float16/bfloat16, rows contiguous, any row stride (logits_full[:, :V] is read in
    place). labels: int64 [n]; rows with ignore_index give loss 0 and gradient 0. Returns fp32 [n], equal to
    F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="none") up to summation
    order; the gradient w.r.t. logits is the fp32 gradient rounded once to logits.dtype.
    with_correct=True: -> (loss, correct), correct bool [n]: the label's logit equals the row's max (ties
    count as right; False on ignored rows), as minibert.model.loss.label_is_max computes it.
    """
    _check_inputs(logits, labels, ignore_index)
    wide = _padded_base(logits)  # the padded logits the view was cut from: gradient without autograd's copy
    loss, correct = _FusedCrossEntropy.apply(logits if wide is None else wide, labels.contiguous(),
                                             int(ignore_index), logits.shape[1])  # labels: n ints, cheap
    return (loss, correct) if with_correct else loss


# --------------------------------------------------------------------------------------------------
# 4. What production does differently
# --------------------------------------------------------------------------------------------------
# - Megatron-LM's tensor-parallel loss (megatron/core/tensor_parallel/cross_entropy.py) splits V over ranks:
#   each rank has logits [n, V / TP]; it all-reduces the row max, then the sum of exp, then the target logit
#   (which only its owner rank has). Its fused variant (megatron/core/fusions/fused_cross_entropy.py) packs
#   those into fewer all-reduces. The per-rank arithmetic is this file's; the collectives are the new part.
# - Megatron's backward writes the gradient in place into the saved softmax buffer. Some fused kernels go
#   further: they compute the gradient inside the forward (grad_loss is 1/count for a mean loss) and write it
#   over the logits, so the backward is free and no second [n, V] buffer exists. That needs the reduction to
#   be known in the forward and destroys the logits; here the loss is per row and the caller may reuse them.
# - The largest saving is to never materialise [n, V] at all: chunk the rows, and compute each chunk's logits
#   (hidden @ W_emb^T), loss and gradient (grad_hidden, grad_W) before the next. That fuses the LM head matmul
#   with this loss; it is what to reach for when V is 100k+ and the logits, not the activations, cap the batch.
# - Label smoothing and class weights (F.cross_entropy options) are left out: BERT pretraining uses neither.
