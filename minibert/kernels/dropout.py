"""Attention dropout inside a kernel: counter-based random numbers (Philox), regenerated, never stored.

Dropout on the attention probabilities needs one keep/drop decision per (batch*head, query, key): b*h*s^2
of them, far too many to store between the forward and the backward. A counter-based generator makes each
decision a pure function of (seed, position), so the forward, the dq kernel and the dkdv kernel (whose
tiles are transposed) each recompute exactly the same mask, whatever their tile sizes.

One Philox-4x32 evaluation (tl.randint4x) gives 128 random bits; we cut them into eight 16-bit numbers, so
one call serves 8 keys of a query row, and compare each with a threshold t = round(65536 p): the rate is
then exactly t / 65536 (p rounded to a multiple of 1/65536), and kept values are scaled by
1 / (1 - t/65536), so the expectation is exact. FlashAttention-2 uses 8-bit numbers (16 per call); on the
H200 the 16-bit scheme took the fwd+bwd at dropout 0.1 from 1.40 ms (one call per element) to 0.70 ms.

The fused dropout + residual + LayerNorm (kernels/layer_norm.py) draws its hidden-dropout mask with the
same function: one stream (bh = 0) and the hidden size as the row width.

The seed of each call (draw_seed) is a Python number drawn from torch's CPU generator, passed to the kernel
as an argument. Under a CUDA graph (minibert/cuda_graphs.py) that number would be frozen into the graph and
every replay would drop the same entries, so while a graph is being captured the seed is drawn on the
device instead, as a one-element tensor the kernel loads (SEED_IN_MEMORY): the draw is a launch the graph
records, and torch's CUDA generator gives every replay new numbers.
"""
import contextlib

import torch
import triton
import triton.language as tl


DROPOUT_LEVELS = 2 ** 16  # dropout draws 16-bit numbers: p is rounded to a multiple of 1/65536 (8 bits: 1/256)


def dropout_threshold(dropout_p):
    """The integer t the kernels compare 16-bit random numbers u with: drop iff u < t. The dropout rate is
    then exactly t / 65536, the multiple of 1/65536 nearest dropout_p (at most 7.6e-6 away; 0.1 -> 6554 ->
    0.100006), capped at 65535 so that some probability is always kept."""
    return min(round(dropout_p * DROPOUT_LEVELS), DROPOUT_LEVELS - 1)


_seeds_on_device = False  # set by seeds_on_device(): a graph's warm-up draws as its capture will


def draw_seed(dropout_p, device):
    """The Philox seed of one kernel call: 0 without dropout; a Python int from torch's CPU generator (so
    torch.manual_seed makes runs repeatable); while a CUDA graph is being captured on `device` (or inside
    seeds_on_device()), an int64 tensor [1] drawn there by torch's CUDA generator, which advances at every
    replay of the graph."""
    if dropout_p <= 0:
        return 0
    if device.type == "cuda" and (_seeds_on_device or torch.cuda.is_current_stream_capturing()):
        return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=device)
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


@contextlib.contextmanager
def seeds_on_device():
    """Draw the seeds as a capture does, outside one: the warm-up before a capture runs (and so compiles)
    the kernels' SEED_IN_MEMORY variants, so that nothing is compiled or loaded while a graph is recorded."""
    global _seeds_on_device
    _seeds_on_device = True
    try:
        yield
    finally:
        _seeds_on_device = False


def kernel_seed(seed, dropout_p, device):
    """A kernel's seed argument from what its caller passed: None -> draw_seed; draw_seed's tensor as it
    is; any other number as a Python int."""
    if seed is None:
        return draw_seed(dropout_p, device)
    return seed if seed_in_memory(seed) else int(seed)


def seed_in_memory(seed) -> bool:
    """The kernels' SEED_IN_MEMORY switch: True when `seed` is draw_seed's device tensor (a pointer to load
    the seed from), False for a Python int (passed by value)."""
    return isinstance(seed, torch.Tensor)


def effective_dropout_p(dropout_p):
    """The rate the kernels really drop at (t / 65536); kept values are scaled by 1 / (1 - this)."""
    return dropout_threshold(dropout_p) / DROPOUT_LEVELS


@triton.jit
def _dropout_keep(seed, bh, rows, start_n, seq_len, threshold, BLOCK_N: tl.constexpr):
    """bool [BLOCK_M, BLOCK_N], True where P[bh, row, start_n + c] survives dropout; rows: [BLOCK_M] query
    indices. Query-major: the dkdv kernel, whose tiles are [keys, queries], transposes it. One Philox call
    serves 8 keys of one query row (g = key // 8):

        Philox(seed, counter = (bh * s + row) * ceil(s / 8) + g)  ->  r0, r1, r2, r3 (random uint32)
        key   8g+0   8g+1   8g+2   8g+3   8g+4   8g+5   8g+6   8g+7
        u     r0 lo  r0 hi  r1 lo  r1 hi  r2 lo  r2 hi  r3 lo  r3 hi     16-bit halves, kept iff u >= threshold

    The counter is a function of (bh, row, key // 8) alone and 8 divides every BLOCK_N, so the mask does not
    depend on the tile: the three kernels draw the same one. Keys past s draw anything; they are masked."""
    groups = start_n // 8 + tl.arange(0, BLOCK_N // 8)                                 # [BLOCK_N / 8]
    counters = (bh.to(tl.int64) * seq_len + rows[:, None]) * tl.cdiv(seq_len, 8) + groups[None, :]
    r0, r1, r2, r3 = tl.randint4x(seed, counters)                                      # each [BLOCK_M, BLOCK_N / 8]
    # tl.interleave(a, b) = a0 b0 a1 b1 ... along the last axis (a join, then a reshape)
    words = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))               # [M, N/2]: r0 r1 r2 r3 r0 ..
    halves = tl.interleave(words & 0xFFFF, words >> 16)                                # [M, N]: r0lo r0hi r1lo ..
    return halves >= threshold.to(tl.uint32)


@triton.jit(do_not_specialize=["seed"])
def _dropout_mask_kernel(KEEP, seq_len, seed, threshold, BLOCK: tl.constexpr):
    """Writes the keep-mask the attention kernels use, KEEP uint8 [b*heads, s, s] (for tests only)."""
    bh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    for start in range(0, seq_len, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        keep = _dropout_keep(seed, bh, rows, start, seq_len, threshold, BLOCK)           # [BLOCK, BLOCK]
        ptrs = KEEP + (bh.to(tl.int64) * seq_len + rows[:, None]) * seq_len + cols[None, :]
        tl.store(ptrs, keep.to(tl.uint8), mask=(rows[:, None] < seq_len) & (cols[None, :] < seq_len))


def dropout_mask(batch, heads, seq_len, seed, dropout_p, device="cpu", block=32):
    """The kernels' own dropout keep-mask, bool [batch, heads, s, s] (True = kept), for building references;
    block (a multiple of 8) is the tile it is drawn in, which does not change the mask."""
    keep = torch.empty(batch * heads, seq_len, seq_len, dtype=torch.uint8, device=device)
    _dropout_mask_kernel[(triton.cdiv(seq_len, block), batch * heads)](
        keep, seq_len, seed, dropout_threshold(dropout_p), BLOCK=block)
    return keep.view(batch, heads, seq_len, seq_len).bool()
