"""Flash attention in Triton: attention without ever writing the s x s matrix, with key padding and dropout.

This file is the forward pass and the autograd Function; the backward lives next door in flash_attention_bwd.py,
what both passes share (the layouts, which block a program owns, the key mask) in flash_common.py, and the block
sizes both run with (tiles) in flash_tiles.py.

1. Why: memory traffic
----------------------
Plain attention, out = softmax(scale * Q K^T + mask) V, materialises the scores S and probabilities P:
    Q [b, heads, s, d] @ K^T -> S [b, heads, s, s] -> softmax -> P [b, heads, s, s] -> dropout -> P @ V
For BERT-large at b32 h16 s512 in bf16 one s x s tensor is 32*16*512*512*2 B = 268 MB, while Q, K, V and the
output are 33.5 MB each. `attention_reference` below (the plain PyTorch version) moves, per layer:
    forward : write S, read S, write P, read P, write the dropped P', read P'        6 x 268 MB = 1.6 GB
    backward: write dP', read dP', read P, write dS, read dS twice, read P'   at least 7 x 268 MB = 1.9 GB
about 3.5 GB against ~0.1 TFLOP of matmul work (6 matmuls of 2*b*heads*s*s*d FLOPs, forward and backward):
at a GPU's copy rate and matmul peak (docs/measuring.md) the bytes take several times as long as the math.
And P, P' stay alive for the backward (537 MB per layer). Flash attention (Dao et al. 2022, FA2 2023) never
stores S or P: each program keeps a block of query rows in registers and streams K, V past it, so HBM sees
Q, K, V and O once (~134 MB) plus one float per row (the log-sum-exp) for the backward, which recomputes P
from Q, K.

2. Online softmax (the forward)
-------------------------------
Softmax needs the row max and row sum over ALL keys, but we see keys one block at a time. Keep, per row,
a running max m, a running sum l = sum_j exp(s_j - m) and an unnormalised output acc = sum_j exp(s_j - m) v_j.
When a new block raises the max from m to m', everything summed so far was measured against the old max:
    alpha = exp(m - m'),   l <- alpha * l + sum_j exp(s_j - m'),   acc <- alpha * acc + exp(s - m') @ V_blk
and at the end out = acc / l, lse = m + log(l) (saved: P = exp(s - lse) without any max or sum later).
    keys ->   [ blk 0 ][ blk 1 ][ blk 2 ] ...          one program = BLOCK_M query rows x every key block
    q rows    [  S_0  ][  S_1  ][  S_2  ]  -> m, l, acc updated after each block; S_j dies in registers
We work in base 2: exp(x) = exp2(x * log2(e)), and log2(e) is folded into the scale, so one fused
multiply-add and one exp2 per score; lse is kept in base 2 too (both kernels agree on it).

Padding. BERT batches are right-padded: key j of batch row i is real iff j < length_i. We compute per batch
row kv_len = 1 + index of its last real key and skip every key block past it, and every query block past it
(its rows are padding: we write zeros and do no work, also in the backward). Inside the loop the key mask is
applied as a MASKED = -2^100 bias wherever a block holds padding, so any mask (holes, left padding) stays
correct; a finite value rather than -inf keeps exp2(MASKED * scale - m) exactly 0 without inf - inf = NaN,
and a power of two keeps MASKED * scale exact (the forward's s * scale - m is one fused multiply-add).
Blocks before a row's first padded key skip the bias. A fully padded batch row has kv_len = 0: its output
is 0 and its gradients are 0, never NaN.

Dropout on P happens inside the kernel, from a counter-based generator: each keep/drop decision is a pure
function of (seed, batch*head, query, key), so the backward redraws the forward's mask and no mask is
stored. The function is a keyed 32-bit integer hash (minibert/kernels/dropout.py):
    counter = query * s + key,   x = hash(counter; keys from seed and batch*head),   kept iff x >= 2t
with t = round(p * 2^31), so the dropout rate is t / 2^31 and the decision depends on the element alone,
never on the tile sizes. Each thread hashes the scores it holds, in the layout the tensor cores left them
in, for ~9 integer instructions per score and no data moved between threads. (Philox, the usual generator,
costs ~60 instructions per call: sharing one call between 8 keys needed the bits moved through shared
memory, and was slower than this hash at BERT-large's shapes; the timings: chapter 3, section 7 and appendix B, and
bench/notes/training.md.)
The running sum l uses the undropped P (dropout acts after softmax); kept values are scaled by
1 / (1 - t / 2^31) once, on the output.

3. What production does (and we leave to Triton's compiler)
-----------------------------------------------------------
FA2 (CUDA) splits work across warps like we split across programs; FA3 on Hopper adds warp specialisation
(producer warps issue TMA bulk copies, consumer warpgroups run asynchronous wgmma), ping-pong scheduling so
one warpgroup's softmax hides under the other's matmul, and FP8. Triton pipelines our loads (num_stages)
and emits wgmma on Hopper by itself; we keep plain pointer loads so one kernel runs everywhere. FA2 draws
one Philox call per 16 dropout decisions (8-bit thresholds: p rounded to a multiple of 1/256) and gives
each thread the bits of its own elements (the thread index is part of the counter), so no bits move but the
mask depends on the kernel's thread layout; our hash gets the same "no bits move" from one cheap call per
element, and its mask is independent of tiles and warps, which lets each kernel pick its own. FA2 also takes
unpadded "varlen" batches (cu_seqlens) that skip padding without masking; these kernels do too, compiled
with VARLEN=True (flash_attention_varlen.py explains the layout).
"""
import math

import torch
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
from minibert.kernels.flash_attention_bwd import attention_backward
from minibert.kernels.flash_common import (
    _MASKED,
    LOG2_E,
    _clean_length,
    _head_rows,
    _key_bias,
    _program_block,
    _row_end,
    grid_layout,
    strides,
)
from minibert.kernels.flash_tiles import head_dim_block, pick_tiles, register_cap

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 128  # the d block lives in registers; 128 is what FA2 and our tiles are sized for


def attention_reference(q, k, v, padding_mask=None, scale=None, keep_mask=None, dropout_p=0.0):
    """Plain PyTorch attention, the oracle for tests (any dtype; tests use float64).

    q, k, v [b, heads, s, d]; padding_mask bool [b, s] True = padding key; keep_mask bool [b, heads, s, s]
    (True = kept) applies dropout with 1/(1-dropout_p) scaling. A row with no real key outputs 0.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale              # [b, heads, s, s]
    if padding_mask is not None:
        scores = scores.masked_fill(padding_mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)             # all-padding rows: NaN -> 0
    if keep_mask is not None:
        probs = probs * keep_mask / (1.0 - dropout_p)
    return torch.matmul(probs, v)                                     # [b, heads, s, d]


# ---------------------------------------------------------------------------------------------------------
# The padding bias and lengths: made once per call, read by both passes (flash_common.py)
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _padding_kernel(PAD, BIAS, KV_LEN, seq_len, BLOCK: tl.constexpr):
    """Per batch row: BIAS float32 [s] (0 real, MASKED padding) and KV_LEN [2]: 1 + index of the last real
    key, and the index of the first padded key (s if none; equal to the first for right padding)."""
    batch = tl.program_id(0)
    last = tl.zeros([BLOCK], tl.int32)
    first_pad = tl.full([BLOCK], seq_len, tl.int32)
    for start in range(0, seq_len, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < seq_len
        padded = tl.load(PAD + batch * seq_len + cols, mask=inside, other=1) != 0
        tl.store(BIAS + batch * seq_len + cols, tl.where(padded, _MASKED, 0.0), mask=inside)
        last = tl.maximum(last, tl.where(padded, 0, cols + 1))
        first_pad = tl.minimum(first_pad, tl.where(padded & inside, cols, seq_len))
    tl.store(KV_LEN + 2 * batch, tl.max(last, 0))
    tl.store(KV_LEN + 2 * batch + 1, tl.min(first_pad, 0))


# ---------------------------------------------------------------------------------------------------------
# The forward kernel
# ---------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["seed"])
def _attention_forward_kernel(
        Q, K, V, O, LSE, BIAS, KV_LEN,
        stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
        stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
        n_heads, seq_len, qk_scale, seed, threshold, out_scale,
        HEAD_DIM: tl.constexpr, D_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_PAD: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr, SEED_IN_MEMORY: tl.constexpr):
    """One program = BLOCK_M query rows of one (batch, head); it streams every key block up to kv_len."""
    if SEED_IN_MEMORY:                                    # a CUDA graph's seed, drawn on the device (dropout.py)
        seed = tl.load(seed)
    bh, start_m, batch, head, kv_len, token0 = _program_block(KV_LEN, n_heads, seq_len, BLOCK_M, HAS_PAD, VARLEN)
    row_end = _row_end(kv_len, seq_len, VARLEN)
    k1, k2, keep_limit = _dropout_keys(seed, bh, threshold)   # this (batch, head)'s dropout stream

    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_BLOCK)
    d_ok = offs_d < HEAD_DIM                              # d=80 runs in a 128-wide block, masked
    o_ptrs = _head_rows(O, batch, token0, head, rows, offs_d, stride_ob, stride_oh, stride_os)
    lse_ptrs = LSE + bh.to(tl.int64) * seq_len + rows
    if start_m >= kv_len:                                 # only padding here: zeros, no work
        tl.store(o_ptrs, tl.zeros([BLOCK_M, D_BLOCK], O.dtype.element_ty),
                 mask=(rows[:, None] < row_end) & d_ok[None, :])
        tl.store(lse_ptrs, tl.zeros([BLOCK_M], tl.float32), mask=rows < seq_len)
        return

    q_ptrs = _head_rows(Q, batch, token0, head, rows, offs_d, stride_qb, stride_qh, stride_qs)
    k_ptrs = _head_rows(K, batch, token0, head, offs_n, offs_d, stride_kb, stride_kh, stride_ks)
    v_ptrs = _head_rows(V, batch, token0, head, offs_n, offs_d, stride_vb, stride_vh, stride_vs)
    q = tl.load(q_ptrs, mask=(rows[:, None] < row_end) & d_ok[None, :], other=0.0)   # [BLOCK_M, D]
    clean_len = _clean_length(KV_LEN, batch, kv_len, HAS_PAD)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (base-2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)                 # running sum of exp2(s - m), undropped
    acc = tl.zeros([BLOCK_M, D_BLOCK], tl.float32)        # running sum of exp2(s - m) @ V
    for start_n in range(0, kv_len, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols[:, None] < kv_len) & d_ok[None, :]
        k = tl.load(k_ptrs + start_n * stride_ks, mask=kv_mask, other=0.0)           # [BLOCK_N, D]
        v = tl.load(v_ptrs + start_n * stride_vs, mask=kv_mask, other=0.0)           # [BLOCK_N, D]
        s = tl.dot(q, tl.trans(k))                        # [BLOCK_M, BLOCK_N], unscaled: see below
        if start_n + BLOCK_N > clean_len:                 # padding (or the end) inside this block
            s += _key_bias(BIAS, batch, seq_len, cols, kv_len, HAS_PAD)[None, :]
        # qk_scale > 0, so the scaled max is the max scaled, and s * qk_scale - m is one fused multiply-add
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)                 # rescales what was summed against the old max
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DROPOUT:
            p = tl.where(_dropout_keep(k1, k2, keep_limit, rows[:, None], cols[None, :], seq_len), p, 0.0)
        acc = tl.dot(p.to(V.dtype.element_ty), v, acc)
        m_i = m_new

    # every row saw key kv_len - 1, a real key, so l_i >= 1: no division by zero
    acc = acc * (out_scale / l_i)[:, None]                # out_scale = 1 / (1 - effective dropout p)
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=(rows[:, None] < row_end) & d_ok[None, :])
    tl.store(lse_ptrs, m_i + tl.math.log2(l_i), mask=rows < seq_len)


# ---------------------------------------------------------------------------------------------------------
# Launchers and the autograd Function
# ---------------------------------------------------------------------------------------------------------
def check_inputs(q, k, v, padding_mask, dropout_p):
    """One clear UsageError for anything the kernels do not support."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise UsageError("flash_attention: q, k, v must be torch tensors")
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise UsageError(f"flash_attention supports q, k, v of one shape [batch, heads, seq, head_dim]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise UsageError(f"flash_attention supports float16, bfloat16 and float32 (all three alike); got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}; use --attention-backend local for others")
    d = q.shape[-1]
    if d % 8 or not 16 <= d <= MAX_HEAD_DIM:
        raise UsageError(f"flash_attention supports head dims that are multiples of 8 from 16 to "
                         f"{MAX_HEAD_DIM} (32, 64, 80, 128...); got {d}: use --attention-backend local")
    if q.numel() == 0:
        raise UsageError(f"flash_attention needs non-empty inputs; got shape {tuple(q.shape)}")
    if not (q.device == k.device == v.device):
        raise UsageError("flash_attention: q, k, v must be on one device")
    if q.device.type != "cuda" and not interpreting():
        raise UsageError("flash_attention runs on CUDA (or on CPU with TRITON_INTERPRET=1); "
                         "use --attention-backend local on CPU")
    if padding_mask is not None and (padding_mask.dtype != torch.bool or padding_mask.device != q.device
                                     or tuple(padding_mask.shape) != (q.shape[0], q.shape[2])):
        raise UsageError(f"flash_attention: padding_mask must be bool [batch, seq] = "
                         f"[{q.shape[0]}, {q.shape[2]}] on {q.device}, True = padding; got "
                         f"{padding_mask.dtype} {tuple(padding_mask.shape)} on {padding_mask.device}")
    if not 0.0 <= dropout_p < 1.0:
        raise UsageError(f"flash_attention: dropout_p must be in [0, 1); got {dropout_p}")
    if dropout_p > 0:
        check_counter_range(q.shape[2] * q.shape[2])


def prepare_padding(padding_mask):
    """bool [b, s] (True = padding) -> (bias float32 [b, s]: 0 or MASKED, kv_len int32 [b, 2]: per row 1 +
    the index of its last real key and the index of its first padded key), one launch."""
    b, s = padding_mask.shape
    bias = torch.empty(b, s, dtype=torch.float32, device=padding_mask.device)
    kv_len = torch.empty(b, 2, dtype=torch.int32, device=padding_mask.device)
    pad = padding_mask.contiguous().view(torch.uint8)
    _padding_kernel[(b,)](pad, bias, kv_len, s, BLOCK=min(1024, triton.next_power_of_2(s)))
    return bias, kv_len


def _last_dim_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def attention_forward(q, k, v, bias, kv_len, scale, dropout_p, seed, tile, out=None, varlen=None):
    """Launch the forward. bias, kv_len: from prepare_padding, or None for no padding (or varlen).
    Returns out [b, heads, s, d] (stored as [b, s, heads, d], so merging heads is a free view) and
    lse float32 [b, heads, s] (base 2); with varlen (a Varlen; q, k, v [n, heads, d]) out is
    [n, heads, d] and lse [batch, heads, max_len]."""
    d = q.shape[-1]
    b, h, s = grid_layout(q, varlen)
    if out is None and varlen is None:
        out = torch.empty(b, s, h, d, dtype=q.dtype, device=q.device).transpose(1, 2)   # [b, h, s, d] view
    elif out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)                       # [n, h, d]
    lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(s, tile.block_m) * b * h,)
    lengths = varlen.cu_seqlens if varlen is not None else kv_len
    _attention_forward_kernel[grid](
        q, k, v, out, lse, bias if bias is not None else lse, lengths if lengths is not None else lse,
        *strides(q, varlen), *strides(k, varlen), *strides(v, varlen), *strides(out, varlen),
        h, s, scale * LOG2_E, seed, dropout_threshold(dropout_p),
        1.0 / (1.0 - effective_dropout_p(dropout_p)),
        HEAD_DIM=d, D_BLOCK=head_dim_block(d), BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
        HAS_PAD=bias is not None, DROPOUT=dropout_p > 0, VARLEN=varlen is not None,
        SEED_IN_MEMORY=seed_in_memory(seed), num_warps=tile.num_warps, num_stages=tile.num_stages,
        **register_cap(tile))
    return out, lse


class FlashAttention(torch.autograd.Function):
    """out = dropout(softmax(scale * q k^T + padding bias)) v; saves only out and lse for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, padding_mask, scale, dropout_p, seed):
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        bias, kv_len = prepare_padding(padding_mask) if padding_mask is not None else (None, None)
        tiles = pick_tiles(q.shape[-1], q.dtype, q.shape[2])
        out, lse = attention_forward(q, k, v, bias, kv_len, scale, dropout_p, seed, tiles[0])
        ctx.save_for_backward(q, k, v, out, lse, bias, kv_len)
        ctx.scale, ctx.dropout_p, ctx.seed, ctx.tiles = scale, dropout_p, seed, tiles
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, bias, kv_len = ctx.saved_tensors
        dq, dk, dv = attention_backward(_last_dim_contiguous(grad_out), q, k, v, out, lse, bias, kv_len,
                                        ctx.scale, ctx.dropout_p, ctx.seed, ctx.tiles)
        return dq, dk, dv, None, None, None, None


def softmax_scale(scale, head_dim):
    """The scores' scale: 1 / sqrt(head_dim) by default; the kernels need it positive and finite (the
    forward takes the running max of the unscaled scores)."""
    scale = head_dim ** -0.5 if scale is None else float(scale)
    if not 0.0 < scale < math.inf:
        raise UsageError(f"flash attention needs a positive, finite softmax scale; got {scale}")
    return scale


def flash_attention(q, k, v, padding_mask=None, scale=None, dropout_p=0.0, seed=None):
    """Attention over q, k, v [b, heads, s, d] (fp16/bf16; fp32 for references, TF32 dots on a GPU).

    padding_mask: bool [b, s], True = padding key (its probability is 0). Output rows of padded queries are
    unspecified but finite (zeros in query blocks entirely past the last real key); their gradients assume
    the loss ignores them. scale defaults to 1/sqrt(d). dropout_p drops attention probabilities in-kernel (a
    keyed hash per element; the rate is rounded to a multiple of 2^-31, see dropout_threshold); seed=None
    draws one from torch's CPU generator (so torch.manual_seed makes runs repeatable; kernels/dropout.py:
    draw_seed, also for CUDA graphs); the same seed gives the same output and gradients.
    Head dims: multiples of 8 in [16, 128]. Returns [b, heads, s, d].
    """
    check_inputs(q, k, v, padding_mask, dropout_p)
    scale = softmax_scale(scale, q.shape[-1])
    seed = kernel_seed(seed, dropout_p, q.device)
    return FlashAttention.apply(q, k, v, padding_mask, scale, float(dropout_p), seed)
