"""Fused bias + GeLU: the MLP's activation and its bias gradient, each in one pass (--bias-gelu-fusion).

What you will learn: what the GeLU between the MLP's two matmuls costs when it runs as its own kernels;
how its derivative is written; and how a kernel that already reads a whole gradient can also produce the
bias gradient, the one sum over rows that otherwise reads it again.

The MLP is out = fc2(gelu(fc1(x))), with fc1(x) = x W1^T + b1, [rows, F] (F = 4h: 4096 for BERT-large).
The plain twin is `F.gelu(linear(x, W1, b1))`: the bias rides in the matmul's epilogue, then

    forward   gelu        read z, write a                        z = y + b1, a = gelu(z)     2 passes
    backward  gelu'       read da, read z, write dz              dz = da * gelu'(z)          3 passes
              bias grad   read dz                                db1 = sum over rows of dz   1 pass

each pass [rows, F] in 16 bits (134 MB per BERT-large layer at b32 s512). On the H200 the two GeLU kernels
took 2.15 + 2.95 ms of a BERT-large step (bench/profile_steps_h200_aligned.md), and fc1's bias gradient
35.7 us a layer as a GEMV (minibert/linear.py). Fused, the matmul leaves the bias out and

    forward   bias_gelu   read y, write a         (the bias is a [F] vector, from cache)        2 passes
    backward  bias_gelu'  read da, read y, write dz, and per block of rows a partial sum of dz  3 passes

the bias gradient becoming a [row blocks, F] fp32 buffer of partial sums (partial.sum(0), a few us) instead
of another pass over dz. Expected: about the fc1 bias GEMV per layer (0.86 ms per BERT-large step) plus
whatever the two GeLU kernels run below the bandwidth. Measured on the H200 (bench/bias_gelu_bench.py,
bf16 [16384, 4096], the swept tiles below): forward 0.098 ms against F.gelu's 0.089, backward 0.173
against gelu_backward + GEMV's 0.156. The plain kernels stream near 3 TB/s; the forward has no bytes to
save, and the backward's column sums cost more than the read of dz they save. In whole steps 0.95-1.00x,
so --bias-gelu-fusion is off by default: a fusion that saves a pass and still loses (chapter 8, 4.15).

GeLU is the erf form (F.gelu's default, BERT's and HuggingFace's), not Megatron's tanh approximation:

    gelu(z)  = z * Phi(z),              Phi(z) = (1 + erf(z / sqrt 2)) / 2      (the normal CDF)
    gelu'(z) = Phi(z) + z * phi(z),     phi(z) = exp(-z^2 / 2) / sqrt(2 pi)      (the normal density)

computed in fp32 from the 16-bit inputs, rounded once on the store, as F.gelu does. The partial sums are
fp32 too and added in a fixed order, so the bias gradient is deterministic.

Runs on CUDA, or on CPU with TRITON_INTERPRET=1 (the tests: the same kernel source, interpreted)."""
import torch
import triton
import triton.language as tl

from minibert.kernels import interpreting


def bias_gelu_reference(y, bias):
    """The plain twin: gelu(y + bias), autograd's backward (bias gradient: a sum over rows)."""
    return torch.nn.functional.gelu(y + bias)


# (BLOCK_M rows, BLOCK_N columns, warps) per direction: the best of `python bench/bias_gelu_bench.py --sweep`
# on the H200 (2026-12-02 04:13 UTC, bf16 [16384, 4096]): forward 4 x 1024 x 4 warps, 2.77 TB/s (the first
# choice, 32 x 256 x 8, ran at 2.68); backward 8 x 512 x 4 warps, 2.33 TB/s (against 1.68). Still below the
# plain path (gelu 0.089 ms, gelu_backward + GEMV 0.157, against 0.097 and 0.173): see the module docstring.
TILES = {"forward": (4, 1024, 4), "backward": (8, 512, 4)}


def _tiles(direction="forward"):
    """The tile of one direction's kernel; small under the interpreter (numpy), both directions alike."""
    return (16, 32, 1) if interpreting() else TILES[direction]


@triton.jit
def _biased(Y, B, offsets, inside, cols, n_cols):
    """z = y + b for a tile, in fp32 (both kernels start here)."""
    return (tl.load(Y + offsets, mask=inside, other=0.0).to(tl.float32)
            + tl.load(B + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :])


@triton.jit
def _bias_gelu_fwd_kernel(Y, B, OUT, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out = gelu(y + b) for a BLOCK_M x BLOCK_N tile (rows contiguous, n_cols apart)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offsets = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    z = _biased(Y, B, offsets, inside, cols, n_cols)
    out = z * 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))              # z * Phi(z); 1 / sqrt 2
    tl.store(OUT + offsets, out.to(OUT.dtype.element_ty), mask=inside)


@triton.jit
def _bias_gelu_bwd_kernel(Y, B, DA, DZ, PARTIAL, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dz = da * gelu'(y + b) for a tile, and the tile's column sums of dz into PARTIAL[row block, cols]."""
    block_m = tl.program_id(0)
    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offsets = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    z = _biased(Y, B, offsets, inside, cols, n_cols)
    da = tl.load(DA + offsets, mask=inside, other=0.0).to(tl.float32)
    cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))                 # Phi(z)
    pdf = tl.exp(-0.5 * z * z) * 0.3989422804014327                         # phi(z); 1 / sqrt(2 pi)
    dz = da * (cdf + z * pdf)
    tl.store(DZ + offsets, dz.to(DZ.dtype.element_ty), mask=inside)
    # masked elements loaded da = 0, so they add nothing to the column sums
    tl.store(PARTIAL + block_m.to(tl.int64) * n_cols + cols, tl.sum(dz, 0), mask=cols < n_cols)


def _grid(n_rows, n_cols, tiles):
    block_m, block_n, _ = tiles
    return (triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, block_n))


def forward_2d(y2, bias, tiles):
    """The forward kernel on a contiguous [rows, F] y2: gelu(y2 + bias)."""
    out = torch.empty_like(y2)
    block_m, block_n, warps = tiles
    _bias_gelu_fwd_kernel[_grid(*y2.shape, tiles)](y2, bias, out, *y2.shape, BLOCK_M=block_m, BLOCK_N=block_n,
                                                   num_warps=warps)
    return out


def backward_2d(y2, bias, da, tiles):
    """The backward kernel on contiguous [rows, F] y2 and da: (dy, dbias)."""
    dz = torch.empty_like(y2)
    grid = _grid(*y2.shape, tiles)
    partial = torch.empty(grid[0], y2.shape[1], dtype=torch.float32, device=y2.device)
    block_m, block_n, warps = tiles
    _bias_gelu_bwd_kernel[grid](y2, bias, da, dz, partial, *y2.shape, BLOCK_M=block_m, BLOCK_N=block_n,
                                num_warps=warps)
    return dz, partial.sum(0).to(bias.dtype)


class BiasGeLU(torch.autograd.Function):
    """gelu(y + bias) over the last dim; saves y and the bias (as F.gelu saves its input)."""

    @staticmethod
    def forward(ctx, y, bias):
        y2 = y.contiguous().view(-1, y.shape[-1])
        ctx.save_for_backward(y2, bias)
        return forward_2d(y2, bias, _tiles()).view(y.shape)

    @staticmethod
    def backward(ctx, grad_out):
        y2, bias = ctx.saved_tensors
        dz, dbias = backward_2d(y2, bias, grad_out.contiguous().view(y2.shape), _tiles("backward"))
        return dz.view(grad_out.shape), dbias


def bias_gelu(y, bias):
    """gelu(y + bias), y [..., F] (the matmul's output without its bias), bias [F]; one Triton kernel per
    direction, the backward also giving the bias gradient. Same dtype in and out (fp16/bf16/fp32)."""
    if y.shape[-1] != bias.shape[-1] or bias.dim() != 1 or y.dtype != bias.dtype or y.device != bias.device:
        raise ValueError(f"bias_gelu: y [..., F] and bias [F] of one dtype and device; got {tuple(y.shape)} "
                         f"{y.dtype} {y.device} and {tuple(bias.shape)} {bias.dtype} {bias.device}")
    return BiasGeLU.apply(y, bias)
