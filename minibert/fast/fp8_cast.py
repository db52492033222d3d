"""The FP8 cast in one pass (minibert/fast/fp8.py's casts on a GPU): read a 16-bit tensor once, and write
its FP8 copy (x * scale, saturated), its transposed FP8 copy when the backward needs one, and its amax.

Why a kernel. Written as PyTorch ops, a cast is several passes over the tensor, each a kernel that reads
it from memory: |x|.amax() for the amax, x * scale, clamp, the cast to FP8, and .t().contiguous() for the
transposed copy that cuBLASLt's FP8 GEMM needs in the backward. The GEMM that follows reads the FP8 copy
once and does 2 k FLOPs per element of it; at BERT-large's sizes the passes cost as much as the FP8 GEMM
saves over bf16 (bench/fp8_bench.py measures both). This kernel is one read of the tensor and one write
per copy:

    x [m, k] bf16 --read once-->  tile  --x scale, clamp, to FP8-->  out   [m', k]  (rows >= m: zeros)
                                   |                           \\--> out_t [k, m']  (the transposed copy)
                                   \\--max |x|--> atomic max into amax (a running max over the step)

The scale is read from device memory, not passed as a number, so a CUDA graph that records the kernel
keeps reading the scale that fp8_step updates between replays. The delayed recipe casts with the scale
from earlier steps, so one pass suffices; tensorwise scaling needs this tensor's own amax first (one
more read: PyTorch's amax). m' is m rounded up to the 16s the weight gradient's product reduces over.

The plain twin is fp8.quantize (with .t().contiguous() for the transposed copy); tests/test_fp8.py checks
the two agree bit for bit (through Triton's interpreter on the CPU, and tests/gpu on a GPU)."""
import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_K = 64, 64


@triton.jit
def _cast_kernel(x_ptr, scale_ptr, amax_ptr, out_ptr, out_t_ptr, m, k, m_out, stride_x, fp8_max,
                 RECORD: tl.constexpr, TRANSPOSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :],
                mask=(rows[:, None] < m) & (cols[None, :] < k), other=0.0).to(tl.float32)
    if RECORD:  # |x| >= 0, so the float max of a tile is also its bits' integer max: one atomic per tile
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
    scale = tl.load(scale_ptr)
    y = tl.minimum(tl.maximum(x * scale, -fp8_max), fp8_max).to(out_ptr.dtype.element_ty)
    inside = (rows[:, None] < m_out) & (cols[None, :] < k)
    tl.store(out_ptr + rows[:, None] * k + cols[None, :], y, mask=inside)
    if TRANSPOSE:
        tl.store(out_t_ptr + cols[None, :] * m_out + rows[:, None], y, mask=inside)


def cast(x, dtype, scale, fp8_max, amax=None, rows=None, transpose=False, out=None, out_t=None):
    """x [m, k] (16-bit or fp32, rows contiguous) -> (x8 [rows, k], x8 transposed [k, rows] or None) in FP8
    `dtype`, x * scale saturated at +-fp8_max; rows (>= m; default m): zero rows added at the end. amax: a
    one-element fp32 tensor that gets max(amax, max |x|) (None: not recorded). scale: a one-element fp32
    tensor on x's device. out, out_t: tensors to write the two copies into (default: new ones)."""
    m, k = x.shape
    rows = m if rows is None else rows
    assert x.stride(1) == 1 and rows >= m
    if out is None:
        out = torch.empty(rows, k, dtype=dtype, device=x.device)
    if transpose and out_t is None:
        out_t = torch.empty(k, rows, dtype=dtype, device=x.device)
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(k, BLOCK_K))
    _cast_kernel[grid](x, scale, amax if amax is not None else scale, out, out_t if transpose else out, m, k,
                       rows, x.stride(0), fp8_max, RECORD=amax is not None, TRANSPOSE=transpose,
                       BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K)
    return out, (out_t if transpose else None)
