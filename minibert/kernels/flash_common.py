"""What the flash attention kernels share: the forward (flash_attention.py) and the backward
(flash_attention_bwd.py) must find and mask exactly the same elements (and so draw the same dropout bits
for them, kernels/dropout.py), so both read their blocks through the helpers here.

    program id  -> (batch, head, block of rows)      _program_block: one (batch, head)'s blocks run fastest
    block rows  -> pointers                          _head_rows: padded [b, heads, s, d] or varlen [n, heads, d]
    key columns -> additive bias                     _key_bias: 0 for a real key, MASKED for padding

Two layouts. Padded: q, k, v [b, heads, s, d] views, with a padding mask that flash_attention.prepare_padding
turns into a bias [b, s] and lengths [b, 2] once per call (KV_LEN below). Varlen: packed rows [n, heads, d],
samples found through cu_seqlens (a Varlen; flash_attention_varlen.py), KV_LEN holding cu_seqlens.
grid_layout and strides give the launchers of both passes the grid and the strides of either.
"""
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

LOG2_E = math.log2(math.e)  # exp(x) = exp2(x * LOG2_E): the scale absorbs it
# The padding bias, about -1.3e30: a power of two, so a score that carries it times any scale is exact (the
# forward's fused s * scale - max must give exactly 0 for a block of padding seen before any real key).
MASKED = -2.0 ** 100
_MASKED = tl.constexpr(MASKED)


# ---------------------------------------------------------------------------------------------------------
# The two layouts, as the launchers of both passes see them
# ---------------------------------------------------------------------------------------------------------
class Varlen(NamedTuple):
    """The varlen layout (flash_attention_varlen.py): q, k, v and out are [n, heads, d] views of packed
    rows, sample i's rows are cu_seqlens[i] .. cu_seqlens[i + 1] - 1 (int32 [batch + 1] on the device),
    and max_len >= every sample's length is the s the grid, lse and the dropout counters are laid out for."""
    cu_seqlens: torch.Tensor
    batch: int
    max_len: int


def grid_layout(q, varlen=None):
    """(batch, heads, s) the kernels' grid and their lse / delta rows run over."""
    if varlen is None:
        b, h, s, _ = q.shape                              # [b, heads, s, d]
        return b, h, s
    return varlen.batch, q.shape[1], varlen.max_len       # [n, heads, d]


def strides(t, varlen=None):
    """(batch, head, row) strides: of a [b, heads, s, d] view, or of a varlen [n, heads, d] one, which has
    no batch stride (the kernels find a sample's first row through cu_seqlens)."""
    if varlen is None:
        return t.stride(0), t.stride(1), t.stride(2)
    return 0, t.stride(1), t.stride(0)


# ---------------------------------------------------------------------------------------------------------
# Inside the kernels: which block a program owns, where its rows are, which keys are padding
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _key_length(KV_LEN, batch, seq_len, HAS_PAD: tl.constexpr):
    """1 + index of the last real key of this batch row (0 if none); everything past it is skipped."""
    if HAS_PAD:
        return tl.load(KV_LEN + 2 * batch)
    return seq_len


@triton.jit
def _clean_length(KV_LEN, batch, kv_len, HAS_PAD: tl.constexpr):
    """How many leading keys of this batch row are all real: key blocks inside them need no bias. With a
    padding mask, the index of the first padded key (prepare_padding stores it next to kv_len; never past
    it, since key kv_len - 1 is the last real one); without one (no mask, or the varlen layout) every key
    below kv_len is real."""
    if HAS_PAD:
        return tl.load(KV_LEN + 2 * batch + 1)
    return kv_len


@triton.jit
def _program_block(KV_LEN, n_heads, seq_len, BLOCK: tl.constexpr, HAS_PAD: tl.constexpr, VARLEN: tl.constexpr):
    """Which block this program owns -> (bh, start, batch, head, kv_len, token0). Program ids run the blocks
    of one (batch, head) fastest, then heads, then batch, so neighbouring programs share K, V (or Q, dO) in
    L2. All three kernels use this order; BLOCK is the size of the block a program owns.

    token0 is the row where this sample's tokens start: 0 in the padded layout [b, s, ...], where the batch
    stride finds the sample; in the varlen layout (VARLEN, packed rows [n, ...], see
    flash_attention_varlen.py) KV_LEN holds cu_seqlens, the sample's rows are cu_seqlens[batch] ..
    cu_seqlens[batch + 1] - 1, and the batch stride is 0."""
    n_blocks = tl.cdiv(seq_len, BLOCK)
    bh = tl.program_id(0) // n_blocks                     # = batch * n_heads + head
    start = (tl.program_id(0) % n_blocks) * BLOCK
    batch = bh // n_heads
    head = bh % n_heads
    if VARLEN:
        token0 = tl.load(KV_LEN + batch).to(tl.int64)
        kv_len = tl.load(KV_LEN + batch + 1) - tl.load(KV_LEN + batch)
    else:
        token0 = batch.to(tl.int64) * 0
        kv_len = _key_length(KV_LEN, batch, seq_len, HAS_PAD)
    return bh, start, batch, head, kv_len, token0


@triton.jit
def _row_end(kv_len, seq_len, VARLEN: tl.constexpr):
    """Rows (queries or keys) at or past this are never read or written: past s in the padded layout
    (padded rows are written: zeros or finite values), past the sample's own length in the varlen layout,
    where the next rows belong to the next sample."""
    if VARLEN:
        return kv_len
    return seq_len


@triton.jit
def _sample_start(batch, token0, stride_b, stride_s):
    """Offset (int64) of row 0 of this sample: batch * stride_b (padded) or token0 * stride_s (varlen)."""
    return batch.to(tl.int64) * stride_b + token0 * stride_s


@triton.jit
def _head_rows(X, batch, token0, head, rows, offs_d, stride_b, stride_h, stride_s):
    """Pointers [len(rows), D_BLOCK] to the given rows of one head of one sample (padded or varlen)."""
    return (X + _sample_start(batch, token0, stride_b, stride_s) + head * stride_h
            + rows[:, None] * stride_s + offs_d[None, :])


@triton.jit
def _key_bias(BIAS, batch, seq_len, cols, kv_len, HAS_PAD: tl.constexpr):
    """[BLOCK_N] additive bias: 0 for a real key, MASKED (-2^100) for padding or a column past kv_len.
    (float32, not the bool mask: 4-byte loads are what Triton's pipeliner prefetches.)"""
    if HAS_PAD:
        return tl.load(BIAS + batch * seq_len + cols, mask=cols < kv_len, other=_MASKED)
    return tl.where(cols < kv_len, 0.0, _MASKED)
