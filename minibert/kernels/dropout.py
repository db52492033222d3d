"""Dropout inside a kernel: a keep/drop decision that is a pure function of (seed, position), never stored.

Dropout on the attention probabilities needs one keep/drop decision per (batch*head, query, key): b*h*s^2
of them, far too many to store between the forward and the backward. If each decision is a pure function
of (seed, position), the forward, the dq kernel and the dkdv kernel (whose tiles are transposed) each
recompute exactly the same mask, whatever their tile sizes. Such a function is a *counter-based* random
number generator: no state, just a scrambling of the position's number (the counter) under a key.

The function here is an integer hash, evaluated for each element where the element already sits:

    per kernel call and stream:  k1, k2 = two 32-bit keys mixed from (seed, stream)   (once per program)
    per element (row, col):      c = row * width + col                          (the counter, 32 bits)
                                 x = c * 0x9E3779B1 + k1;  x ^= x >> 16;  x = x * 0x7FEB352D + k2
                                 x ^= x >> 15;  x = x * 0x846CA68B             (all mod 2^32)
                                 kept iff x >= 2t,   t = round(p * 2^31)

A stream is one (batch, head) for attention (width = s) and the single stream 0 for the hidden dropout of
the fused LayerNorm (kernels/layer_norm.py, width = h). Each step is a bijection of 32-bit numbers (odd
multiplies, xor-shifts, adding a key), so different elements of one stream never share an x; the two keys
enter at different stages, so two seeds give unrelated masks, not shifted copies of one. The rate is exactly
2t / 2^32 = t / 2^31 (p rounded to a multiple of 2^-31), and kept values are scaled by 1 / (1 - t / 2^31),
so the expected output is exactly the undropped one. The multipliers are those of a well-known two-round
32-bit mixer ("lowbias32"); tests measure what dropout needs of it: the rate, and no correlation between
neighbours, rows, heads or seeds.

Why a hash and not Philox, the generator cuRAND and FlashAttention use: one Philox-4x32-10 call (10 rounds,
~60 integer instructions) gives 128 bits, so spending them well means sharing one call between several
elements, and those elements sit in different threads of the tensor cores' layout: the bits then travel
through shared memory. This hash costs ~9 instructions per element, in the thread that holds the element,
with nothing to move. Of the three ways timed in flash attention's fwd+bwd (one Philox call per element,
one per 8 keys, this hash) the hash is the fastest; chapter 3, appendix B, says what was tried.
The hash is not a cryptographic or Crush-tested generator, and dropout does not need one.

The seed of each call (draw_seed) is a Python number drawn from torch's CPU generator, passed to the kernel
as an argument. Under a CUDA graph (minibert/fast/cuda_graphs.py) that number would be frozen into the graph and
every replay would drop the same entries, so while a graph is being captured the seed is drawn on the
device instead, as a one-element tensor the kernel loads (SEED_IN_MEMORY): the draw is a launch the graph
records, and torch's CUDA generator gives every replay new numbers.
"""
import contextlib

import torch
import triton
import triton.language as tl

from minibert.errors import UsageError

DROPOUT_LEVELS = 2 ** 31  # p is rounded to a multiple of 2^-31
MAX_COUNTER = 2 ** 32     # counters (row * width + col) are 32-bit: one stream holds at most 2^32 elements


def dropout_threshold(dropout_p):
    """The integer t the kernels compare with: an element is dropped iff its 32-bit hash x < 2t. The dropout
    rate is then exactly t / 2^31, the multiple of 2^-31 nearest dropout_p (0.1 -> 214748365 ->
    0.1000000001), capped at 2^31 - 1 so that some probability is always kept. (t fits an int32, the type
    the kernels take it as.)"""
    return min(round(dropout_p * DROPOUT_LEVELS), DROPOUT_LEVELS - 1)


_seeds_on_device = False  # set by seeds_on_device(): a graph's warm-up draws as its capture will


def draw_seed(dropout_p, device):
    """The dropout seed of one kernel call: 0 without dropout; a Python int from torch's CPU generator (so
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


def check_counter_range(elements_per_stream):
    """The counter of an element is 32 bits: past 2^32 elements in one stream the masks would repeat."""
    if elements_per_stream > MAX_COUNTER:
        raise UsageError(f"in-kernel dropout over {elements_per_stream} elements per stream (more than 2^32): "
                         "use a smaller micro-batch or sequence, or turn this dropout off")


def effective_dropout_p(dropout_p):
    """The rate the kernels really drop at (t / 2^31); kept values are scaled by 1 / (1 - this)."""
    return dropout_threshold(dropout_p) / DROPOUT_LEVELS


# The constants of the hash (module docstring): the golden-ratio multiplier that spreads the counter, the
# two multipliers of the mixer, and two constants that separate the keys. (Kernels may only read globals
# wrapped as tl.constexpr; reference_keep_mask reads the plain numbers.)
SPREAD, MIX1, MIX2, KEY1, KEY2 = 0x9E3779B1, 0x7FEB352D, 0x846CA68B, 0x9E3779B9, 0x6A09E667
_SPREAD, _MIX1, _MIX2, _KEY1, _KEY2 = (tl.constexpr(c) for c in (SPREAD, MIX1, MIX2, KEY1, KEY2))


@triton.jit
def _mix32(x):
    """The full two-round mixer on uint32 values: used once per program, for the keys."""
    x = x ^ (x >> 16)
    x = x * _MIX1
    x = x ^ (x >> 15)
    x = x * _MIX2
    return x ^ (x >> 16)


@triton.jit
def _dropout_keys(seed, stream, threshold):
    """(k1, k2, limit) for one kernel call and one stream (int32 scalar: batch*heads + head, or 0): the
    two keys of the hash and the uint32 limit 2t an element's hash must reach to be kept. Once per program."""
    k1 = _mix32(seed.to(tl.uint32) ^ _mix32(stream.to(tl.uint32) + _KEY1))
    k2 = _mix32(k1 + _KEY2)
    return k1, k2, threshold.to(tl.uint32) * 2


@triton.jit
def _dropout_keep(k1, k2, limit, rows, cols, width):
    """bool, True where element (row, col) of a [rows, width] stream survives dropout. rows and cols are
    broadcastable int32 index tensors: rows[:, None] and cols[None, :] give a [len(rows), len(cols)] tile,
    rows[None, :] and cols[:, None] its transpose (the dkdv kernel's [keys, queries] tiles). Every
    operation is elementwise, so each thread hashes the elements it holds, in the layout they already have.
    The row part (one multiply-add per row) and the column part (per column) are computed on the vectors;
    per element: one add, two xor-shifts, two multiplies, one compare."""
    row_part = rows.to(tl.uint32) * (width.to(tl.uint32) * _SPREAD) + k1
    x = row_part + cols.to(tl.uint32) * _SPREAD            # = (row * width + col) * _SPREAD + k1 (mod 2^32)
    x = x ^ (x >> 16)
    x = x * _MIX1 + k2
    x = x ^ (x >> 15)
    x = x * _MIX2
    return x >= limit


def _mix32_reference(x):
    """_mix32 on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = (x * MIX1) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * MIX2) & 0xFFFFFFFF
    return x ^ (x >> 16)


def reference_keep_mask(seed, stream, rows, width, dropout_p):
    """The same decisions in plain torch (int64 arithmetic, masked to 32 bits): bool [rows, width], True =
    kept, for the elements (row, col) of one stream. The kernels must give exactly this (tests)."""
    m = 0xFFFFFFFF
    k1 = _mix32_reference(torch.tensor(seed & m) ^ _mix32_reference(torch.tensor((stream + KEY1) & m)))
    k2 = _mix32_reference((k1 + KEY2) & m)
    counter = torch.arange(rows, dtype=torch.int64)[:, None] * width + torch.arange(width)[None, :]
    x = (counter * SPREAD + k1) & m
    x = x ^ (x >> 16)
    x = (x * MIX1 + k2) & m
    x = x ^ (x >> 15)
    x = (x * MIX2) & m
    return x >= 2 * dropout_threshold(dropout_p)


@triton.jit(do_not_specialize=["seed"])
def _dropout_mask_kernel(KEEP, seq_len, seed, threshold, BLOCK: tl.constexpr):
    """Writes the keep-mask the attention kernels use, KEEP uint8 [b*heads, s, s] (for tests only)."""
    bh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    k1, k2, limit = _dropout_keys(seed, bh, threshold)
    for start in range(0, seq_len, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        keep = _dropout_keep(k1, k2, limit, rows[:, None], cols[None, :], seq_len)        # [BLOCK, BLOCK]
        ptrs = KEEP + (bh.to(tl.int64) * seq_len + rows[:, None]) * seq_len + cols[None, :]
        tl.store(ptrs, keep.to(tl.uint8), mask=(rows[:, None] < seq_len) & (cols[None, :] < seq_len))


def dropout_mask(batch, heads, seq_len, seed, dropout_p, device="cpu", block=32):
    """The kernels' own dropout keep-mask, bool [batch, heads, s, s] (True = kept), for building references;
    block is the tile it is drawn in, which does not change the mask."""
    check_counter_range(seq_len * seq_len)
    keep = torch.empty(batch * heads, seq_len, seq_len, dtype=torch.uint8, device=device)
    _dropout_mask_kernel[(triton.cdiv(seq_len, block), batch * heads)](
        keep, seq_len, seed, dropout_threshold(dropout_p), BLOCK=block)
    return keep.view(batch, heads, seq_len, seq_len).bool()
