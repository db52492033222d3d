"""Fused dropout + residual add + LayerNorm: the glue between the big matmuls, in one pass each way.

What you will learn: where a transformer layer spends memory traffic outside its matmuls; how a whole
row lives in a program's registers so that a LayerNorm needs one read; how the LayerNorm backward follows
from the chain rule; how a weight gradient (a sum over every row) is reduced without atomics.

1. Where this op sits
---------------------
Each sublayer f (attention, MLP) ends with dropout, a residual add and a LayerNorm:

    pre-LN  (Megatron's BERT):  x = x + drop(attn(LN1 x));  out = x + drop(mlp(LN2 x))
            -> x_new = x + drop(y) is kept (the next residual) AND normalised (the next sublayer's input)
    post-LN (original BERT):    x = LN1(x + drop(attn(x)));  out = LN2(x + drop(mlp(x)))
            -> only LN(x + drop(y)) is used

so one op serves both: dropout_add_layer_norm(residual, y, ...) -> (x = residual + drop(y), LN(x)).
Pre-LN uses both outputs, post-LN only the second (its grad_x is None in the backward).

2. Why fuse: bytes
------------------
Everything here is a few flops per element, so the time is the bytes. BERT-large at b32 s512 runs it on
[16384, 1024] bf16 tensors: T = 32 MB each (a bool mask is T/2). Eager PyTorch, in training:

    forward                                             backward (pre-LN: grads of both outputs)
    F.dropout    read y, write y' and mask   2.5 T      LayerNorm dx    read dnormed, x, write dx  3 T
    x = r + y'   read r, y', write x         3 T        LN dweight/db   read dnormed, x again      2 T
    LayerNorm    read x, write normed        2 T        dx + grad_x     read 2, write 1            3 T
                                                        dropout bwd     read grad, mask, write     2.5 T
    eager 7.5 T = 240 MB, fused 4 T = 128 MB            eager 10.5 T = 336 MB, fused 5 T = 160 MB

Fused forward: read r, y; write x, normed (4 T). Fused backward: read grad_x, dnormed, x; write
grad_residual, grad_y (5 T); x must be kept for the backward either way, the mask never exists (each
eager dropout keeps a 16 MB mask alive from forward to backward, 48 per step in a 24-layer model).
On the GPU's clock (bench/layer_norm_bench.py, CUDA-graph timing) the fused pair is faster than eager and
moves its 9 T at about a plain copy's rate. Launched from Python one call at a time it is slower than
eager: the autograd Function and the Triton launches cost the host more than the GPU work, which hides
only when the GPU is busy with bigger kernels. The times: bench/results/fusions_h200_2026-12-01.md, read in
bench/notes/fusions.md and chapter 8, section 9.

3. The LayerNorm backward
-------------------------
Per row of h values: mu = mean(x), r = 1/sqrt(var(x) + eps) (biased var), xhat = (x - mu) r,
normed = xhat * w + b. With g = dnormed * w the gradient reaching xhat, and
d xhat_j / d x_i = r (delta_ij - 1/h - xhat_i xhat_j / h)  (mu and r depend on every x_i), we get

    dx_ln = r * (g - mean(g) - xhat * mean(g * xhat))       (per row: two row sums, no h x h matrix)
    dweight = sum over rows of dnormed * xhat,   dbias = sum over rows of dnormed

Then d_total = grad_x + dx_ln is grad_residual, and grad_y = d_total * keep / (1 - p).
The backward reloads the stored x (rounded to its dtype: the LayerNorm normalised exactly that) and the
saved fp32 mean and rstd, so xhat is recomputed, not stored. dweight, dbias: a fixed grid of P programs
(a few per SM), each summing a strided set of row blocks into fp32 registers and writing one [h] row of
a [2, P, h] buffer; torch then sums the P rows (one ATen launch: cheaper on the host than a second
Triton kernel, which was measured to matter: bench/notes/fusions.md). No atomics, so the same bits every
run.

4. Dropout without a mask
-------------------------
The keep/drop decisions are attention dropout's (minibert/kernels/dropout.py) with one stream (0) and the
hidden size as the row width: element (row, col) of the flattened [rows, h] tensor hashes the counter

    counter = row * h + col

under keys mixed from the seed, and is kept iff the hash >= 2 round(2^31 p). The decision depends on
(seed, row, col) only, never on the tile, so the backward regenerates it and hidden_dropout_keep_mask
draws the same one for tests.

Runs on CUDA, or on CPU with TRITON_INTERPRET=1 (the tests).
"""
import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from minibert.errors import UsageError
from minibert.kernels import interpreting
from minibert.kernels.dropout import (
    _dropout_keep,
    _dropout_keys,
    check_counter_range,
    dropout_threshold,
    effective_dropout_p,
    kernel_seed,
    seed_in_memory,
)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_WIDTH = 8192  # a whole row sits in registers: 8192 fp32 over 16 warps is 16 values per thread per tensor


# --------------------------------------------------------------------------------------------------
# 1. The plain twin: what eager PyTorch runs (given the mask)
# --------------------------------------------------------------------------------------------------
def dropout_add_layer_norm_reference(residual, y, weight, bias, eps, keep_mask, dropout_p):
    """Eager PyTorch with a given keep mask (bool, y's shape, True = kept; None = no dropout): three
    kernels forward. dropout_p is rounded as the kernel rounds it (effective_dropout_p)."""
    if keep_mask is not None:
        y = y * keep_mask / (1.0 - effective_dropout_p(dropout_p))
    x = residual + y
    normed = None if weight is None else F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    return x, normed


# --------------------------------------------------------------------------------------------------
# 2. Tiles
# --------------------------------------------------------------------------------------------------
class Tile(NamedTuple):
    block_m: int              # rows per block; a row is one BLOCK_N-wide block (BLOCK_N >= h)
    num_warps: int            # 32 threads each
    programs_per_sm: int = 0  # backward: a grid of this many programs per SM, each looping over row blocks


# Picked by `python bench/layer_norm_bench.py --sweep` (bf16, dropout 0.1, CUDA-graph timing), results in
# bench/notes/fusions.md: 2048 values per block and 16 per thread (2 rows x 4 warps at h 1024; the backward
# on 4 programs per SM) won both directions at [16384, 1024] and came close to the best at [32768, 768].
# Short programs with few warps keep many blocks in flight, which is what a streaming kernel needs; more
# programs per SM (8) or fewer (1) lost.
TILE_ELEMENTS = {"forward": 2048, "backward": 2048}
ELEMENTS_PER_THREAD = {"forward": 16, "backward": 16}
BACKWARD_PROGRAMS_PER_SM = 4  # the partial buffer is then 2 * 4 * SMs * h fp32 (4.3 MB at h 1024, 132 SMs)
# The CPU interpreter runs one program at a time in numpy: few, small programs, and a 2-program backward
# grid (CPU counts as one SM) so the tests cross block edges and the strided loop.
INTERPRETER_TILES = (Tile(4, 1), Tile(2, 1, programs_per_sm=2))


def _block_n(h):
    return max(8, triton.next_power_of_2(h))  # _dropout_keep draws 8 columns per call: a multiple of 8


@functools.lru_cache(maxsize=None)
def pick_tiles(h):
    """(forward, backward) tiles for rows of width h."""
    if interpreting():
        return INTERPRETER_TILES
    tiles = []
    for direction in ("forward", "backward"):
        block_m = min(max(TILE_ELEMENTS[direction] // _block_n(h), 1), 64)  # short rows: several per block
        warps = min(max(block_m * _block_n(h) // (32 * ELEMENTS_PER_THREAD[direction]), 1), 16)
        tiles.append(Tile(block_m, warps, BACKWARD_PROGRAMS_PER_SM if direction == "backward" else 0))
    return tuple(tiles)


# --------------------------------------------------------------------------------------------------
# 3. The kernels
# --------------------------------------------------------------------------------------------------
@triton.jit
def _hidden_keep(seed, rows, start, h, threshold, BLOCK_N: tl.constexpr):
    """bool [BLOCK_M, BLOCK_N], True where element (row, start + c) survives: attention dropout's hash
    (kernels/dropout.py) with one stream, 0, and the row width h. (The keys are mixed again for each block
    of rows: a few scalar instructions.)"""
    k1, k2, limit = _dropout_keys(seed, tl.full([], 0, tl.int32), threshold)
    cols = start + tl.arange(0, BLOCK_N)
    return _dropout_keep(k1, k2, limit, rows[:, None], cols[None, :], h)


@triton.jit(do_not_specialize=["seed", "threshold"])
def _dropout_add_ln_fwd_kernel(RES, Y, W, B, X, NORMED, STATS, n_rows, h, eps, seed, threshold, keep_scale,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr,
                               HAS_LN: tl.constexpr, SEED_IN_MEMORY: tl.constexpr):
    """x = res + drop(y) and normed = LN(x) * w + b for BLOCK_M rows, each row whole in registers.

        [rows, h] viewed flat          program p: rows p*BLOCK_M .. +BLOCK_M, columns 0 .. BLOCK_N-1
        +------- h -------+...+        (columns past h load as 0 and are never stored)
        | program 0       |   |   -> load res, y; x = res + keep * y / (1-p); round, store x;
        | program 1       |   |      mean, rstd of the rounded x (two row sums); store normed, mean, rstd
    """
    if SEED_IN_MEMORY:                                     # a CUDA graph's seed (kernels/dropout.py)
        seed = tl.load(seed)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)                       # [BLOCK_M]
    cols = tl.arange(0, BLOCK_N)                                                     # [BLOCK_N]
    inside = (rows < n_rows)[:, None] & (cols < h)[None, :]                          # [BLOCK_M, BLOCK_N]
    offsets = rows.to(tl.int64)[:, None] * h + cols[None, :]                         # past 2^31 elements
    x = tl.load(RES + offsets, mask=inside, other=0.0)
    y = tl.load(Y + offsets, mask=inside, other=0.0).to(tl.float32)
    if DROPOUT:
        y = tl.where(_hidden_keep(seed, rows, 0, h, threshold, BLOCK_N), y * keep_scale, 0.0)
    x = (x.to(tl.float32) + y).to(X.dtype.element_ty)                                # one rounding
    tl.store(X + offsets, x, mask=inside)
    if HAS_LN:
        x = x.to(tl.float32)                       # the rounded x: what eager's LayerNorm sees, what bwd reloads
        mean = tl.sum(x, axis=1) / h                                                 # [BLOCK_M]
        centred = tl.where(inside, x - mean[:, None], 0.0)                           # padding adds nothing
        rstd = tl.rsqrt(tl.sum(centred * centred, axis=1) / h + eps)                 # biased variance
        w = tl.load(W + cols, mask=cols < h, other=0.0).to(tl.float32)               # [BLOCK_N]
        b = tl.load(B + cols, mask=cols < h, other=0.0).to(tl.float32)
        normed = centred * rstd[:, None] * w[None, :] + b[None, :]
        tl.store(NORMED + offsets, normed.to(NORMED.dtype.element_ty), mask=inside)
        tl.store(STATS + rows, mean, mask=rows < n_rows)                             # STATS [2, rows]:
        tl.store(STATS + n_rows + rows, rstd, mask=rows < n_rows)                    # mean, then rstd


@triton.jit(do_not_specialize=["seed", "threshold"])
def _dropout_add_ln_bwd_kernel(X, W, STATS, DX, DN, DRES, DY, PARTS, n_rows, h,
                               seed, threshold, keep_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               HAS_DX: tl.constexpr, HAS_DN: tl.constexpr, STORE_DY: tl.constexpr,
                               SEED_IN_MEMORY: tl.constexpr):
    """d_total = grad_x + dx_ln (section 3 of the docstring) -> DRES, and d_total * keep / (1-p) -> DY.

    A fixed grid of P programs; program p takes row blocks p, p + P, p + 2P, ... and sums dnormed * xhat
    and dnormed over all of them in fp32 registers, then writes row p of PARTS[0] and PARTS[1] ([2, P, h]).
    HAS_DN = False (normed unused): d_total is grad_x itself, only DY is written.
    """
    if SEED_IN_MEMORY:                                       # a CUDA graph's seed (kernels/dropout.py)
        seed = tl.load(seed)
    cols = tl.arange(0, BLOCK_N)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)        # summed over rows once, at the end
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if HAS_DN:
        w = tl.load(W + cols, mask=cols < h, other=0.0).to(tl.float32)[None, :]     # [1, BLOCK_N]
    for block in range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0)):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)                               # [BLOCK_M]
        inside = (rows < n_rows)[:, None] & (cols < h)[None, :]
        offsets = rows.to(tl.int64)[:, None] * h + cols[None, :]
        d = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if HAS_DX:
            d = tl.load(DX + offsets, mask=inside, other=0.0).to(tl.float32)
        if HAS_DN:
            x = tl.load(X + offsets, mask=inside, other=0.0).to(tl.float32)
            mean = tl.load(STATS + rows, mask=rows < n_rows, other=0.0)
            rstd = tl.load(STATS + n_rows + rows, mask=rows < n_rows, other=0.0)
            dn = tl.load(DN + offsets, mask=inside, other=0.0).to(tl.float32)
            xhat = tl.where(inside, (x - mean[:, None]) * rstd[:, None], 0.0)
            g = dn * w                                                               # dL/dxhat
            mean_g = tl.sum(g, axis=1) / h                                           # [BLOCK_M]
            mean_gx = tl.sum(g * xhat, axis=1) / h
            d += rstd[:, None] * (g - mean_g[:, None] - xhat * mean_gx[:, None])
            dw_acc += dn * xhat
            db_acc += dn
            tl.store(DRES + offsets, d.to(DRES.dtype.element_ty), mask=inside)
        if STORE_DY:
            d = tl.where(_hidden_keep(seed, rows, 0, h, threshold, BLOCK_N), d * keep_scale, 0.0)
            tl.store(DY + offsets, d.to(DY.dtype.element_ty), mask=inside)
    if HAS_DN:
        dw_row = PARTS + tl.program_id(0).to(tl.int64) * h                          # PARTS[0, p]
        db_row = dw_row + tl.num_programs(0).to(tl.int64) * h                        # PARTS[1, p]
        tl.store(dw_row + cols, tl.sum(dw_acc, axis=0), mask=cols < h)
        tl.store(db_row + cols, tl.sum(db_acc, axis=0), mask=cols < h)


@triton.jit(do_not_specialize=["seed", "threshold"])
def _keep_mask_kernel(KEEP, n_rows, h, seed, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """KEEP uint8 [rows, h], for tests: drawn in BLOCK_N-column chunks (the kernels draw whole rows at
    once), which gives the same bits because the counter ignores the tile."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    for start in range(0, h, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        keep = _hidden_keep(seed, rows, start, h, threshold, BLOCK_N)
        tl.store(KEEP + rows.to(tl.int64)[:, None] * h + cols[None, :], keep.to(tl.uint8),
                 mask=(rows < n_rows)[:, None] & (cols < h)[None, :])


# --------------------------------------------------------------------------------------------------
# 4. Launchers and the autograd Function
# --------------------------------------------------------------------------------------------------
def _check_inputs(residual, y, weight, bias, eps, dropout_p):
    """One UsageError per unsupported input, naming what is supported."""
    if not isinstance(residual, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise UsageError("dropout_add_layer_norm: residual and y must be torch tensors")
    if residual.dtype not in SUPPORTED_DTYPES or y.dtype != residual.dtype:
        raise UsageError(f"dropout_add_layer_norm supports float32, float16 and bfloat16 (residual and y "
                         f"alike); got {residual.dtype} and {y.dtype}")
    if residual.shape != y.shape or residual.dim() == 0:
        raise UsageError(f"dropout_add_layer_norm: residual and y must have one shape [..., h]; got "
                         f"{tuple(residual.shape)} and {tuple(y.shape)}")
    h = residual.shape[-1]
    if not 1 <= h <= MAX_WIDTH:
        raise UsageError(f"dropout_add_layer_norm supports widths h from 1 to {MAX_WIDTH} (a row is held in "
                         f"registers); got h = {h}: use nn.LayerNorm")
    if (weight is None) != (bias is None):
        raise UsageError("dropout_add_layer_norm: give weight and bias both (LayerNorm) or neither (only "
                         "dropout + add)")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != (h,)
                              or t.dtype != residual.dtype or t.device != residual.device):
            got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise UsageError(f"dropout_add_layer_norm: {name} must be {residual.dtype} [{h}] on "
                             f"{residual.device}; got {got}")
    if y.device != residual.device:
        raise UsageError(f"dropout_add_layer_norm: residual is on {residual.device} but y on {y.device}")
    if residual.device.type != "cuda" and not interpreting():
        raise UsageError("dropout_add_layer_norm runs on CUDA (or on CPU with TRITON_INTERPRET=1 set before "
                         "triton is imported); use the eager F.dropout + add + nn.LayerNorm on CPU")
    if weight is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0):
        raise UsageError(f"dropout_add_layer_norm: eps must be a positive Python float; got {eps!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise UsageError(f"dropout_add_layer_norm: dropout_p must be in [0, 1); got {dropout_p}")
    if dropout_p > 0:
        check_counter_range(residual.numel())


def _keep_scale(dropout_p):
    return 1.0 / (1.0 - effective_dropout_p(dropout_p))


def _forward(residual, y, weight, bias, eps, dropout_p, seed, tile):
    """Launch the forward on contiguous [..., h] inputs -> (x, normed or None, stats fp32 [2, rows]:
    mean and rstd per row, the only extra thing the backward needs)."""
    h = residual.shape[-1]
    n_rows = residual.numel() // h                                       # [..., h] viewed as [n_rows, h]
    x = torch.empty_like(residual)
    normed = None if weight is None else torch.empty_like(residual)
    stats = torch.empty(2, n_rows, dtype=torch.float32, device=residual.device)
    if n_rows:
        _dropout_add_ln_fwd_kernel[(triton.cdiv(n_rows, tile.block_m),)](
            residual, y, weight, bias, x, normed, stats, n_rows, h, eps, seed, dropout_threshold(dropout_p),
            _keep_scale(dropout_p), BLOCK_M=tile.block_m, BLOCK_N=_block_n(h), DROPOUT=dropout_p > 0,
            HAS_LN=weight is not None, SEED_IN_MEMORY=seed_in_memory(seed),
            num_warps=tile.num_warps)
    return x, normed, stats


@functools.lru_cache(maxsize=None)
def _sm_count(device):
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _backward(x, weight, stats, grad_x, grad_normed, dropout_p, seed, tile, store_dy):
    """Launch the backward -> (d_res, d_y, sums [2, h] in weight's dtype: dweight, dbias; None without
    grad_normed). grad_x or grad_normed may be None (not both); without grad_normed d_res is grad_x itself,
    and d_y is d_res when store_dy is False. Two launches: the row kernel and the partials' sum (torch)."""
    h = x.shape[-1]
    n_rows = x.numel() // h
    has_dn = grad_normed is not None
    programs = min(triton.cdiv(n_rows, tile.block_m), tile.programs_per_sm * _sm_count(x.device))
    d_res = torch.empty_like(x) if has_dn else grad_x                    # without LN, d_total is grad_x
    d_y = torch.empty_like(x) if store_dy else d_res
    parts = torch.empty(2, programs, h, dtype=torch.float32, device=x.device) if has_dn else None
    if n_rows:
        _dropout_add_ln_bwd_kernel[(programs,)](
            x, weight, stats, grad_x, grad_normed, d_res, d_y, parts, n_rows, h, seed,
            dropout_threshold(dropout_p), _keep_scale(dropout_p), BLOCK_M=tile.block_m, BLOCK_N=_block_n(h),
            HAS_DX=grad_x is not None, HAS_DN=has_dn, STORE_DY=store_dy, SEED_IN_MEMORY=seed_in_memory(seed),
            num_warps=tile.num_warps)
    if not has_dn:
        return d_res, d_y, None
    # the few hundred partial rows summed by torch: one launch, cheaper on the host than a second Triton one
    # (a Triton launch costs tens of microseconds of Python; 0 rows: parts [2, 0, h] sums to zeros)
    return d_res, d_y, parts.sum(dim=1).to(weight.dtype)


class _DropoutAddLayerNorm(torch.autograd.Function):
    """Saves x (an output), mean and rstd [rows] fp32; the backward redraws the dropout mask from seed."""

    @staticmethod
    def forward(ctx, residual, y, weight, bias, eps, dropout_p, seed, tiles):
        x, normed, stats = _forward(residual.contiguous(), y.contiguous(), weight, bias, eps, dropout_p, seed,
                                    tiles[0])
        ctx.set_materialize_grads(False)                                 # an unused output's grad is None
        ctx.save_for_backward(x, weight, stats)
        ctx.dropout_p, ctx.seed, ctx.tiles = dropout_p, seed, tiles
        return x, normed

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_x, grad_normed):
        x, weight, stats = ctx.saved_tensors
        need_res, need_y, need_w, need_b = ctx.needs_input_grad[:4]
        grad_normed = grad_normed if weight is not None else None
        store_dy = need_y and ctx.dropout_p > 0
        if grad_x is None and grad_normed is None:                       # neither output reaches the loss
            return (None,) * 8
        if grad_normed is None and not store_dy:                         # d_total = grad_x is every gradient
            return grad_x, grad_x, None, None, None, None, None, None
        d_res, d_y, sums = _backward(x, weight, stats, None if grad_x is None else grad_x.contiguous(),
                                     None if grad_normed is None else grad_normed.contiguous(),
                                     ctx.dropout_p, ctx.seed, ctx.tiles[1], store_dy)
        return (d_res if need_res else None, d_y if need_y else None,
                sums[0] if sums is not None and need_w else None, sums[1] if sums is not None and need_b else None,
                None, None, None, None)


def dropout_add_layer_norm(residual, y, weight, bias, eps, dropout_p=0.0, seed=None):
    """(x, normed) with x = residual + dropout(y) and normed = LayerNorm(x) * weight + bias over the last dim.

    residual, y: [..., h] (any leading shape: [b, s, h], packed [n, h]), one dtype of float32, float16,
    bfloat16, h <= 8192. weight, bias: [h] in that dtype, or both None: then normed is None and only the
    dropout + add runs. Math in fp32; x is rounded to the dtype and LayerNorm normalises the rounded x.
    dropout_p: in [0, 1) (pass 0 in eval), rounded to a multiple of 1/65536; kept values are scaled by
    1 / (1 - effective_dropout_p(dropout_p)). seed=None draws one from torch's CPU generator when
    dropout_p > 0 (torch.manual_seed makes runs repeatable); the mask is hidden_dropout_keep_mask(rows, h,
    seed, dropout_p), rows = residual.numel() // h. Differentiable in residual, y, weight, bias.
    """
    dropout_p = float(dropout_p)
    _check_inputs(residual, y, weight, bias, eps, dropout_p)
    seed = kernel_seed(seed, dropout_p, residual.device)
    return _DropoutAddLayerNorm.apply(residual, y, weight, bias, float(eps), dropout_p, seed,
                                      pick_tiles(residual.shape[-1]))


def hidden_dropout_keep_mask(rows, width, seed, dropout_p, device="cpu"):
    """The kernels' own keep mask, bool [rows, width] (True = kept), for tests and references: element
    (r, c) of residual viewed as [rows, width] is kept iff mask[r, c]."""
    keep = torch.empty(rows, width, dtype=torch.uint8, device=device)
    block_m = 8
    if rows and width:
        _keep_mask_kernel[(triton.cdiv(rows, block_m),)](keep, rows, width, int(seed), dropout_threshold(dropout_p),
                                                         BLOCK_M=block_m, BLOCK_N=64)
    return keep.bool()


# --------------------------------------------------------------------------------------------------
# 5. What production does differently
# --------------------------------------------------------------------------------------------------
# - Megatron-LM runs the LayerNorm from Apex or TransformerEngine (CUDA) and dropout + add as a separate
#   fused function (megatron/core/fusions/fused_bias_dropout.py, which also adds the linear's bias), so x
#   goes through memory once more between the two.
# - FlashAttention's repo has this very fusion in CUDA (csrc/layer_norm, from Apex's FastLayerNorm), with
#   options we leave out (residual kept in fp32, row/column scales, RMSNorm); its forward writes a uint8
#   dropout mask that the backward reads. We regenerate ours from the seed: T/2 fewer bytes each way.
# - Post-LN could skip storing x when only normed is used, at the price of recomputing it in the backward
#   from residual and y (two reads instead of one); we always write x.
# - Rows longer than MAX_WIDTH would loop over chunks with two passes (as softmax.py does); no BERT is so wide.
# - RMSNorm (no mean, no bias) is the same kernel with fewer terms; BERT uses LayerNorm.
