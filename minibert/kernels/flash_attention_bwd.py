"""Flash attention backward: gradients from Q, K, V, O, dO and the saved log-sum-exp, no s x s matrix stored.

The math (one (batch, head); S = scale * Q K^T with padding bias, P = softmax(S), Z the dropout keep-mask,
O = (P * Z / (1 - p)) V, dO given):
    dV = (P * Z / (1-p))^T dO                  [s, d]
    dP = (dO V^T) * Z / (1-p)                  [s, s], only ever a block at a time
    dS = P * (dP - D),   D = rowsum(dO * O)    softmax backward: D_i = sum_j P_ij dP_ij = dO_i . O_i
    dQ = scale * dS K,   dK = scale * dS^T Q
P itself is recomputed per block as exp2(S * log2(e) - lse), lse saved by the forward (base 2).

Two kernels, as in FA2 but without atomics (so results are deterministic):
    dq kernel   : one program per (query block, batch*head); loops over key blocks, accumulates dQ in
                  registers. It also computes D for its rows (it has dO and O at hand) and stores it.
    dkdv kernel : one program per (key block, batch*head), launched after the dq kernel (it needs D);
                  loops over query blocks, accumulates dK and dV in registers.
          keys ->                                    keys ->
    q   [ ==== dq program ==== ]  (row of blocks)   q  [ | ]  dkdv program = a column of blocks
    ry  [                      ]                    ry [ | ]
P is recomputed in both (7 block matmuls instead of FA2's 5 with atomic dQ adds): the price of determinism.
In the dkdv kernel the tile is transposed (keys on rows), so P^T, dP^T come out of the dots directly; its
dropout mask is drawn query-major like the other two kernels' and transposed (tl.trans): the same bits.

Padding: both kernels stop at kv_len (1 + last real key). Query rows at or past kv_len are padding: their
lse is loaded as +inf, so exp2(. - inf) = 0 removes them exactly. In the dkdv kernel a key row only ever
feeds its own dK, dV row, so the padding bias is skipped in the loop and padded key rows are zeroed once at
the end; the dq kernel sums over keys, so it applies the bias like the forward.

Short sequences (s <= the short tile's block_n, 128 on the GPU): one program can hold every key of a
(batch, head), so a third kernel does the dkdv kernel's loop over query blocks and, since each dS block
then covers all keys, also stores that block's dQ = dS K: 5 block matmuls, P computed once, D never
stored, still no atomics (each dQ row has one writer). backward_into picks it where it fits.
"""
import torch
import triton
import triton.language as tl

from minibert.kernels.dropout import (
    _dropout_keep,
    _dropout_keys,
    dropout_threshold,
    effective_dropout_p,
    seed_in_memory,
)
from minibert.kernels.flash_common import (
    LOG2_E,
    _clean_length,
    _head_rows,
    _key_bias,
    _program_block,
    _row_end,
    grid_layout,
    strides,
)
from minibert.kernels.flash_tiles import head_dim_block, register_cap


@triton.jit(do_not_specialize=["seed"])
def _attention_backward_dq_kernel(
        Q, K, V, O, DO, DQ, LSE, DELTA, BIAS, KV_LEN,
        stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
        stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
        stride_dob, stride_doh, stride_dos, stride_dqb, stride_dqh, stride_dqs,
        n_heads, seq_len, qk_scale, sm_scale, seed, threshold, keep_scale,
        HEAD_DIM: tl.constexpr, D_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_PAD: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr, SEED_IN_MEMORY: tl.constexpr):
    """dQ for BLOCK_M query rows of one (batch, head), and D = rowsum(dO * O) for those rows."""
    if SEED_IN_MEMORY:                                         # a CUDA graph's seed (kernels/dropout.py)
        seed = tl.load(seed)
    bh, start_m, batch, head, kv_len, token0 = _program_block(KV_LEN, n_heads, seq_len, BLOCK_M, HAS_PAD, VARLEN)
    row_end = _row_end(kv_len, seq_len, VARLEN)
    k1, k2, keep_limit = _dropout_keys(seed, bh, threshold)        # the forward's dropout stream

    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_BLOCK)
    d_ok = offs_d < HEAD_DIM
    dq_ptrs = _head_rows(DQ, batch, token0, head, rows, offs_d, stride_dqb, stride_dqh, stride_dqs)
    if start_m >= kv_len:                                      # padding rows only
        tl.store(dq_ptrs, tl.zeros([BLOCK_M, D_BLOCK], DQ.dtype.element_ty),
                 mask=(rows[:, None] < row_end) & d_ok[None, :])
        return

    live = rows < kv_len                                       # rows past kv_len contribute nothing
    row_mask = live[:, None] & d_ok[None, :]
    q = tl.load(_head_rows(Q, batch, token0, head, rows, offs_d, stride_qb, stride_qh, stride_qs),
                mask=row_mask, other=0.0)                                                 # [BLOCK_M, D]
    do = tl.load(_head_rows(DO, batch, token0, head, rows, offs_d, stride_dob, stride_doh, stride_dos),
                 mask=row_mask, other=0.0)                                                # [BLOCK_M, D]
    o = tl.load(_head_rows(O, batch, token0, head, rows, offs_d, stride_ob, stride_oh, stride_os),
                mask=row_mask, other=0.0)                                                 # [BLOCK_M, D]
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)                                # [BLOCK_M]
    tl.store(DELTA + bh.to(tl.int64) * seq_len + rows, delta, mask=rows < seq_len)
    lse = tl.load(LSE + bh.to(tl.int64) * seq_len + rows, mask=live, other=float("inf"))

    k_ptrs = _head_rows(K, batch, token0, head, offs_n, offs_d, stride_kb, stride_kh, stride_ks)
    v_ptrs = _head_rows(V, batch, token0, head, offs_n, offs_d, stride_vb, stride_vh, stride_vs)
    clean_len = _clean_length(KV_LEN, batch, kv_len, HAS_PAD)
    dq = tl.zeros([BLOCK_M, D_BLOCK], tl.float32)
    for start_n in range(0, kv_len, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols[:, None] < kv_len) & d_ok[None, :]
        k = tl.load(k_ptrs + start_n * stride_ks, mask=kv_mask, other=0.0)                # [BLOCK_N, D]
        v = tl.load(v_ptrs + start_n * stride_vs, mask=kv_mask, other=0.0)                # [BLOCK_N, D]
        s = tl.dot(q, tl.trans(k))                                                         # [BLOCK_M, BLOCK_N]
        if start_n + BLOCK_N > clean_len:               # padding in this block (as in the forward)
            s += _key_bias(BIAS, batch, seq_len, cols, kv_len, HAS_PAD)[None, :]
        p = tl.math.exp2(s * qk_scale - lse[:, None])                                      # P, recomputed
        dp = tl.dot(do, tl.trans(v))                                                       # dO V^T
        if DROPOUT:
            keep = _dropout_keep(k1, k2, keep_limit, rows[:, None], cols[None, :], seq_len)  # [BLOCK_M, BLOCK_N]
            dp = tl.where(keep, dp * keep_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(K.dtype.element_ty), k, dq)
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=(rows[:, None] < row_end) & d_ok[None, :])


@triton.jit(do_not_specialize=["seed"])
def _attention_backward_dkdv_kernel(
        Q, K, V, DO, DK, DV, LSE, DELTA, BIAS, KV_LEN,
        stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
        stride_vb, stride_vh, stride_vs, stride_dob, stride_doh, stride_dos,
        stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
        n_heads, seq_len, qk_scale, sm_scale, seed, threshold, keep_scale,
        HEAD_DIM: tl.constexpr, D_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_PAD: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr, SEED_IN_MEMORY: tl.constexpr):
    """dK, dV for BLOCK_N keys of one (batch, head): tiles are transposed, [BLOCK_N keys, BLOCK_M queries]."""
    if SEED_IN_MEMORY:                                         # a CUDA graph's seed (kernels/dropout.py)
        seed = tl.load(seed)
    bh, start_n, batch, head, kv_len, token0 = _program_block(KV_LEN, n_heads, seq_len, BLOCK_N, HAS_PAD, VARLEN)
    k1, k2, keep_limit = _dropout_keys(seed, bh, threshold)        # the forward's dropout stream

    cols = start_n + tl.arange(0, BLOCK_N)                     # this program's keys
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_BLOCK)
    d_ok = offs_d < HEAD_DIM
    out_mask = (cols[:, None] < _row_end(kv_len, seq_len, VARLEN)) & d_ok[None, :]
    dk_ptrs = _head_rows(DK, batch, token0, head, cols, offs_d, stride_dkb, stride_dkh, stride_dks)
    dv_ptrs = _head_rows(DV, batch, token0, head, cols, offs_d, stride_dvb, stride_dvh, stride_dvs)
    if start_n >= kv_len:                                      # padding keys only
        tl.store(dk_ptrs, tl.zeros([BLOCK_N, D_BLOCK], DK.dtype.element_ty), mask=out_mask)
        tl.store(dv_ptrs, tl.zeros([BLOCK_N, D_BLOCK], DV.dtype.element_ty), mask=out_mask)
        return

    kv_mask = (cols[:, None] < kv_len) & d_ok[None, :]
    k = tl.load(_head_rows(K, batch, token0, head, cols, offs_d, stride_kb, stride_kh, stride_ks),
                mask=kv_mask, other=0.0)                                                  # [BLOCK_N, D]
    v = tl.load(_head_rows(V, batch, token0, head, cols, offs_d, stride_vb, stride_vh, stride_vs),
                mask=kv_mask, other=0.0)                                                  # [BLOCK_N, D]
    q_ptrs = _head_rows(Q, batch, token0, head, offs_m, offs_d, stride_qb, stride_qh, stride_qs)
    do_ptrs = _head_rows(DO, batch, token0, head, offs_m, offs_d, stride_dob, stride_doh, stride_dos)
    dk = tl.zeros([BLOCK_N, D_BLOCK], tl.float32)
    dv = tl.zeros([BLOCK_N, D_BLOCK], tl.float32)
    for start_m in range(0, kv_len, BLOCK_M):
        rows = start_m + offs_m
        live = rows < kv_len
        row_mask = live[:, None] & d_ok[None, :]
        q = tl.load(q_ptrs + start_m * stride_qs, mask=row_mask, other=0.0)              # [BLOCK_M, D]
        do = tl.load(do_ptrs + start_m * stride_dos, mask=row_mask, other=0.0)           # [BLOCK_M, D]
        lse = tl.load(LSE + bh.to(tl.int64) * seq_len + rows, mask=live, other=float("inf"))
        delta = tl.load(DELTA + bh.to(tl.int64) * seq_len + rows, mask=live, other=0.0)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])              # P^T [BLOCK_N, BLOCK_M]
        dp_t = tl.dot(v, tl.trans(do))                                                     # (dO V^T)^T
        if DROPOUT:
            keep = _dropout_keep(k1, k2, keep_limit, rows[None, :], cols[:, None], seq_len)  # [BLOCK_N, BLOCK_M]
            dv = tl.dot(tl.where(keep, p_t, 0.0).to(DO.dtype.element_ty), do, dv)
            dp_t = tl.where(keep, dp_t * keep_scale, 0.0)
        else:
            dv = tl.dot(p_t.to(DO.dtype.element_ty), do, dv)
        ds_t = p_t * (dp_t - delta[None, :])                                               # dS^T
        dk = tl.dot(ds_t.to(Q.dtype.element_ty), q, dk)

    # padded keys (and those past kv_len) were not masked in the loop: their rows are zeroed here
    real = _key_bias(BIAS, batch, seq_len, cols, kv_len, HAS_PAD) == 0.0
    tl.store(dk_ptrs, tl.where(real[:, None], dk * sm_scale, 0.0).to(DK.dtype.element_ty), mask=out_mask)
    tl.store(dv_ptrs, tl.where(real[:, None], dv * keep_scale, 0.0).to(DV.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["seed"])
def _attention_backward_short_kernel(
        Q, K, V, O, DO, DQ, DK, DV, LSE, BIAS, KV_LEN,
        stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
        stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
        stride_dob, stride_doh, stride_dos, stride_dqb, stride_dqh, stride_dqs,
        stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
        n_heads, seq_len, qk_scale, sm_scale, seed, threshold, keep_scale,
        HEAD_DIM: tl.constexpr, D_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_PAD: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr, SEED_IN_MEMORY: tl.constexpr):
    """dQ, dK, dV of one (batch, head) whose keys all fit one block (seq_len <= BLOCK_N): the dkdv
    kernel's loop over query blocks, where each dS block is also a whole row block of dQ = dS K."""
    if SEED_IN_MEMORY:                                         # a CUDA graph's seed (kernels/dropout.py)
        seed = tl.load(seed)
    bh, _, batch, head, kv_len, token0 = _program_block(KV_LEN, n_heads, seq_len, BLOCK_N, HAS_PAD, VARLEN)
    row_end = _row_end(kv_len, seq_len, VARLEN)
    k1, k2, keep_limit = _dropout_keys(seed, bh, threshold)        # the forward's dropout stream

    cols = tl.arange(0, BLOCK_N)                               # every key of the sample
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_BLOCK)
    d_ok = offs_d < HEAD_DIM
    kv_mask = (cols[:, None] < kv_len) & d_ok[None, :]
    k = tl.load(_head_rows(K, batch, token0, head, cols, offs_d, stride_kb, stride_kh, stride_ks),
                mask=kv_mask, other=0.0)                                                  # [BLOCK_N, D]
    v = tl.load(_head_rows(V, batch, token0, head, cols, offs_d, stride_vb, stride_vh, stride_vs),
                mask=kv_mask, other=0.0)                                                  # [BLOCK_N, D]
    bias = _key_bias(BIAS, batch, seq_len, cols, kv_len, HAS_PAD)  # dQ sums over keys: mask them
    q_ptrs = _head_rows(Q, batch, token0, head, offs_m, offs_d, stride_qb, stride_qh, stride_qs)
    o_ptrs = _head_rows(O, batch, token0, head, offs_m, offs_d, stride_ob, stride_oh, stride_os)
    do_ptrs = _head_rows(DO, batch, token0, head, offs_m, offs_d, stride_dob, stride_doh, stride_dos)
    dq_ptrs = _head_rows(DQ, batch, token0, head, offs_m, offs_d, stride_dqb, stride_dqh, stride_dqs)
    dk = tl.zeros([BLOCK_N, D_BLOCK], tl.float32)
    dv = tl.zeros([BLOCK_N, D_BLOCK], tl.float32)
    for start_m in range(0, kv_len, BLOCK_M):
        rows = start_m + offs_m
        live = rows < kv_len
        row_mask = live[:, None] & d_ok[None, :]
        q = tl.load(q_ptrs + start_m * stride_qs, mask=row_mask, other=0.0)              # [BLOCK_M, D]
        do = tl.load(do_ptrs + start_m * stride_dos, mask=row_mask, other=0.0)           # [BLOCK_M, D]
        o = tl.load(o_ptrs + start_m * stride_os, mask=row_mask, other=0.0)              # [BLOCK_M, D]
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)                          # D, never stored
        lse = tl.load(LSE + bh.to(tl.int64) * seq_len + rows, mask=live, other=float("inf"))
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale + bias[:, None] - lse[None, :])  # P^T
        dp_t = tl.dot(v, tl.trans(do))                                                     # (dO V^T)^T
        if DROPOUT:
            keep = _dropout_keep(k1, k2, keep_limit, rows[None, :], cols[:, None], seq_len)  # [BLOCK_N, BLOCK_M]
            dv = tl.dot(tl.where(keep, p_t, 0.0).to(DO.dtype.element_ty), do, dv)
            dp_t = tl.where(keep, dp_t * keep_scale, 0.0)
        else:
            dv = tl.dot(p_t.to(DO.dtype.element_ty), do, dv)
        ds_t = (p_t * (dp_t - delta[None, :])).to(Q.dtype.element_ty)                    # dS^T
        dk = tl.dot(ds_t, q, dk)
        dq = tl.dot(tl.trans(ds_t), k)                          # all keys are here: dQ's rows are complete
        tl.store(dq_ptrs + start_m * stride_dqs, (dq * sm_scale).to(DQ.dtype.element_ty),
                 mask=(rows[:, None] < row_end) & d_ok[None, :])
    for start_m in range(tl.cdiv(kv_len, BLOCK_M) * BLOCK_M, row_end, BLOCK_M):   # padding rows: dQ = 0
        rows = start_m + offs_m
        tl.store(dq_ptrs + start_m * stride_dqs, tl.zeros([BLOCK_M, D_BLOCK], DQ.dtype.element_ty),
                 mask=(rows[:, None] < row_end) & d_ok[None, :])

    out_mask = (cols[:, None] < row_end) & d_ok[None, :]
    real = bias == 0.0
    tl.store(_head_rows(DK, batch, token0, head, cols, offs_d, stride_dkb, stride_dkh, stride_dks),
             tl.where(real[:, None], dk * sm_scale, 0.0).to(DK.dtype.element_ty), mask=out_mask)
    tl.store(_head_rows(DV, batch, token0, head, cols, offs_d, stride_dvb, stride_dvh, stride_dvs),
             tl.where(real[:, None], dv * keep_scale, 0.0).to(DV.dtype.element_ty), mask=out_mask)


def _launch(kernel, grid, tensors, stats, bias, kv_len, scale, dropout_p, seed, tile, block_n, varlen):
    """kernel[grid] with the argument list the three backward kernels share: their tensors, then lse (and
    delta), the key bias and the lengths (lse stands in for an absent one: never read), the tensors'
    strides, then the scalars and the tile's constants."""
    d = tensors[0].shape[-1]                                   # tensors[0] is q
    _, h, s = grid_layout(tensors[0], varlen)
    lengths = varlen.cu_seqlens if varlen is not None else kv_len
    kernel[grid](
        *tensors, *stats, bias if bias is not None else stats[0], lengths if lengths is not None else stats[0],
        *(stride for t in tensors for stride in strides(t, varlen)),
        h, s, scale * LOG2_E, scale, seed, dropout_threshold(dropout_p),
        1.0 / (1.0 - effective_dropout_p(dropout_p)),
        HEAD_DIM=d, D_BLOCK=head_dim_block(d), BLOCK_M=tile.block_m, BLOCK_N=block_n,
        HAS_PAD=bias is not None, DROPOUT=dropout_p > 0, VARLEN=varlen is not None,
        SEED_IN_MEMORY=seed_in_memory(seed), num_warps=tile.num_warps, num_stages=tile.num_stages,
        **register_cap(tile))


def launch_dq(grad_out, q, k, v, out, lse, delta, dq, bias, kv_len, scale, dropout_p, seed, tile, varlen=None):
    """dq kernel (also fills delta [b, heads, s]): one program per block of block_m queries."""
    b, h, s = grid_layout(q, varlen)
    _launch(_attention_backward_dq_kernel, (triton.cdiv(s, tile.block_m) * b * h,), (q, k, v, out, grad_out, dq),
            (lse, delta), bias, kv_len, scale, dropout_p, seed, tile, tile.block_n, varlen)


def launch_dkdv(grad_out, q, k, v, lse, delta, dk, dv, bias, kv_len, scale, dropout_p, seed, tile, varlen=None):
    """dkdv kernel (reads the delta written by launch_dq): one program per block of block_n keys."""
    b, h, s = grid_layout(q, varlen)
    _launch(_attention_backward_dkdv_kernel, (triton.cdiv(s, tile.block_n) * b * h,), (q, k, v, grad_out, dk, dv),
            (lse, delta), bias, kv_len, scale, dropout_p, seed, tile, tile.block_n, varlen)


def short_block(tile, seq_len):
    """The key block of the one-kernel backward when a program can hold all seq_len keys (tile: its Tile,
    block_n the most keys it holds; None where the head dim or dtype leaves no room), else None."""
    if tile is None or seq_len > tile.block_n:
        return None
    return max(16, triton.next_power_of_2(seq_len))


def launch_short(grad_out, q, k, v, out, lse, dq, dk, dv, bias, kv_len, scale, dropout_p, seed, tile, varlen=None):
    """The one-kernel backward: one program per (batch, head), its keys in one block of short_block()."""
    b, h, s = grid_layout(q, varlen)
    _launch(_attention_backward_short_kernel, (b * h,), (q, k, v, out, grad_out, dq, dk, dv), (lse,), bias, kv_len,
            scale, dropout_p, seed, tile, short_block(tile, s), varlen)


def backward_into(grad_out, q, k, v, out, lse, dq, dk, dv, bias, kv_len, scale, dropout_p, seed, tiles,
                  varlen=None):
    """Write dq, dk, dv (views the caller allocated, any strides with a unit last one). tiles: pick_tiles's
    (forward, dq, dkdv, short). Sequences short enough for one program to hold every key take the one
    kernel (5 block matmuls, P computed once); longer ones the dq kernel, then the dkdv kernel."""
    _, dq_tile, dkdv_tile, short_tile = tiles
    s = grid_layout(q, varlen)[2]
    if short_block(short_tile, s) is not None:
        launch_short(grad_out, q, k, v, out, lse, dq, dk, dv, bias, kv_len, scale, dropout_p, seed, short_tile,
                     varlen)
        return
    delta = torch.empty_like(lse)                              # [b, heads, s] float32, filled by the dq kernel
    launch_dq(grad_out, q, k, v, out, lse, delta, dq, bias, kv_len, scale, dropout_p, seed, dq_tile, varlen)
    launch_dkdv(grad_out, q, k, v, lse, delta, dk, dv, bias, kv_len, scale, dropout_p, seed, dkdv_tile, varlen)


def attention_backward(grad_out, q, k, v, out, lse, bias, kv_len, scale, dropout_p, seed, tiles):
    """(dq, dk, dv) for flash attention's forward; arguments as attention_forward plus its out and lse,
    and pick_tiles's four tiles (tests pass others, or None as the short tile to force the two kernels)."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    backward_into(grad_out, q, k, v, out, lse, dq, dk, dv, bias, kv_len, scale, dropout_p, seed, tiles)
    return dq, dk, dv
